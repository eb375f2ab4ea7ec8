"""Answers a question from a reading's cache: what the cache holds of the text (past the window, the passages of
the kept notes read again), then the chosen notes in reading order, each tagged with its segment and page, then
the question; the answer ends at a sentence end and cites the notes that hold its words.

Cache layout of an answer inside one window (the document was prefilled once, while reading):

    [prefix][segment 0]...[segment n-1][notes + question][answer tokens]      <- cut back to the document's end

and past the window, where the cache holds only the last window (ReadAgent's look-up, in WiM's terms: context
plus margins, which the paper's ablation found better than either alone):

    [prefix][passage of kept note a][passage of kept note b]...[notes + question][answer tokens]

Inside one window the `recall` style keeps the document and re-reads the kept notes' passages after it, so that
the facts the notes point to sit next to the question, not in the middle of a long text:

    [prefix][segment 0]...[segment n-1][passage of kept note a]...[notes + question][answer tokens]

The look-up window replaces the last window in the cache (kept first, for remargin and follow-ups).
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from .attribution import PIECE_END, attributed, cited, without_citations
from .events import Answer, AnswerToken, Event, Notice
from .generate import DecodeResult, Meter, Rewound, Stopped
from .prompts import fit_notes, note_lines, prompt

if TYPE_CHECKING:
    from .wim import Reading

# notes: past the window, the last window and the notes; lookup: past the window, the kept notes' passages re-read
# in place of the last window; passages: the same inside one window too (the document's other segments left out);
# recall: inside one window, the kept notes' passages re-read after the whole document, next to the question (past
# the window, lookup); filled: past the window, the kept notes' passages and, in the room left, the passages the
# margins scored likeliest (inside one window, the text).
ANSWER_STYLES = ("notes", "lookup", "passages", "recall", "filled")
# answer_window's results whose window is built afresh from re-read passages: no cache of the text needed.
FRESH_WINDOWS = ("passages", "likeliest", "filled")


def answer_window(style: str, multiwindow: bool, has_notes: bool) -> str:
    """What an answer in `style` reads besides its notes and the question: `text`, what the reading's cache holds
    (the document; past the window, its last window); `passages`, the kept notes' passages re-read into a fresh
    window (no cache of the text needed); `recall`, the document and then those passages again; `likeliest`,
    past the window with no note kept, the passages the margins scored likeliest to help, re-read into a fresh
    window (the last window is only where the text happened to end); `filled`, past the window, the kept notes'
    passages and then the likeliest others as far as they fit. Inside one window, without a note to point at
    passages, every style reads the text."""
    if not has_notes:
        return "likeliest" if multiwindow and style != "notes" else "text"
    if style == "passages" or (multiwindow and style in ("lookup", "recall")):
        return "passages"
    if multiwindow and style == "filled":
        return "filled"
    return "recall" if style == "recall" else "text"


NOT_STATED = re.compile(r"\b(?:does not|doesn't|do not|did not) (?:say|state|mention|tell)|\bnot (?:stated|mentioned|"
                        r"given|specified)\b", re.IGNORECASE)
# A sentence ends at . ! ? (after a quote or bracket too, or a citation right after it).
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*(?:\s*\[[^\]]*\])*(?=\s|$)")


def note_label(segment) -> str:
    """How a note names where it came from: its segment, and its pages when the text has pages."""
    pages = segment.pages
    where = f"segment {segment.index + 1}"
    if pages:
        where += f", page {pages[0]}" if pages[0] == pages[1] else f", pages {pages[0]}-{pages[1]}"
    return where


def span_label(segments, first: int, last: int) -> str:
    """How a note over segments `first`..`last` (a group note, engine/group_notes.py) names where it came from."""
    if first == last:
        return note_label(segments[first])
    where = f"segments {first + 1}-{last + 1}"
    a, b = segments[first].pages, segments[last].pages
    if a and b:
        where += f", page {a[0]}" if a[0] == b[1] else f", pages {a[0]}-{b[1]}"
    return where


# The words an answer that reasons first begins its answer with (engine/prompts/answer_reasoned.txt asks for them).
ANSWER_AFTER = "Answer:"


def reasons_first(template: str) -> bool:
    """Whether an answer prompt asks for reasoning before the answer (it names the words that begin it)."""
    return f'"{ANSWER_AFTER}"' in template


def split_answer(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a text that reasons before its answer: what comes before and after the first
    "Answer:". Where it wrote none (its reasoning ran to the token cap, say), or nothing after it, all of it is
    the answer."""
    reasoning, marker, answer = text.partition(ANSWER_AFTER)
    if not marker or not answer.strip():
        return "", (reasoning if marker else text).strip()
    return reasoning.strip(), answer.strip()


def says_not_stated(text: str) -> bool:
    return bool(NOT_STATED.search(text))


def complete_sentences(text: str, ending: str, retried: int = 0) -> str:
    """An answer cut at its token cap or at a repetition ends at its last complete sentence (a short answer with
    no sentence end, say a single name, stays as it is). One that looped (ended at it, or `retried`: taken back
    and gone on) names each item once."""
    text = text.strip()
    if ending == "repeat" or retried:
        text = without_repeated_items(text)
    if ending not in ("limit", "repeat"):
        return text
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    return text[:ends[-1]].strip() if ends else text


# An answer's pieces as attribution splits them (sentences, list items; a date's comma inside its piece), with
# the separators kept so the text can be put back together.
_PIECES = re.compile(f"({PIECE_END.pattern})")


def without_repeated_items(text: str) -> str:
    """A list whose loop began by naming items again ("Trowel, lute, trowel, pocket watch"): the loop check drops
    the repeated tail token for token, but an item whose copy is tokenized apart (the first item has no space
    before it) survives it; leave out each item an earlier one already names, with the separator before it."""
    parts = _PIECES.split(text)  # item, separator, item, ...
    if len(parts) < 3:
        return text
    seen, kept = {_item_key(parts[0])}, [parts[0]]
    for separator, item in zip(parts[1::2], parts[2::2]):
        key = _item_key(item)
        if key and key in seen:
            continue
        seen.add(key)
        kept += [separator, item]
    return "".join(kept).strip().rstrip(",;").rstrip()  # a dropped last item leaves its separator's comma


def _item_key(item: str) -> str:
    return re.sub(r"\W+", " ", without_citations(item)).strip().lower()


@dataclass
class AnswerWindow:
    """What the cache held for the last answer: the token ids fed after the prefix, and which segments' passages
    they re-read (empty inside one window, where the document itself is in the cache)."""
    passages: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


class Answering:
    """The answers of one reading, from its cache."""

    def __init__(self, reading: "Reading"):
        self.reading = reading
        self.window = AnswerWindow()

    def answer(self, query: str, margins: list[int] | dict[int, str] | None = None,
               stop: threading.Event | None = None, plain: bool = False, template: str | None = None,
               style: str | None = None) -> Iterator[Event]:
        """See Reading.answer. `template`: the answer prompt's text (default engine/prompts/answer.txt);
        `style`: one of ANSWER_STYLES (default Settings.answer_style)."""
        r = self.reading
        if not r.read_segments:
            raise RuntimeError("Nothing has been read yet: call read() first.")
        if plain and r.multiwindow:
            raise RuntimeError("A multi-window reading holds only its last window: plain reading answers from "
                               "its own read.")
        query = query.strip()
        r.meter = r.runner.meter = Meter()
        notes = self._chosen(margins)
        wim = r.settings.mode == "wim" and not plain
        reads = answer_window(style or r.settings.answer_style, r.multiwindow, bool(notes)) if wim else "text"
        lookup, recall = reads in FRESH_WINDOWS, reads == "recall"
        try:
            if lookup:
                yield from self._lookup_window(query, notes, template, stop, fill=reads == "filled")
            else:
                yield from r.last_window_in_cache(stop)
                r.cache.truncate(r.doc_end)
                self.window = AnswerWindow()
                if recall:
                    yield from self._recall(query, notes, template, stop)
        except Stopped:
            if recall:
                r.cache.truncate(r.doc_end)  # the document is whole: only the passages half re-read go
            else:
                r.cache_window = None  # half built: the next answer builds it again
            yield r._stats("answer", stopped=True)
            return
        if wim:
            in_cache = set(self.window.passages) if lookup else set(r.windows[-1].segments) if r.windows else set()
            try:
                ids, used, dropped = yield from self._fitted(query, notes, template, r.limit - r.cache.length,
                                                             in_cache, stop)
            except Stopped:
                yield r._stats("answer", stopped=True)
                return
            if dropped:
                yield Notice(f"{len(dropped)} margin(s) did not fit in the context window and were left out "
                             f"of the answer: {', '.join(str(i + 1) for i in dropped)}.")
        else:
            ids, used = r.layout.suffix("answer_plain", query=query), []
        # Settings.reasoning_tokens asks the notes' prompt for a sentence or two before "Answer:" (plain reading's,
        # and the one without notes, answer at once: reasoning without notes scored below answering at once).
        reasons = wim and (template is not None or bool(used)) and self._reasons(template)
        end = r.cache.length
        try:
            with r.engine.lock:
                logits = r.runner.prefill(ids, r.cache, stop)
                result = yield from self._decode(logits, end + len(ids), stop, reasons)
        except Stopped:
            yield r._stats("answer", stopped=True)
            return
        finally:
            # ready for a follow-up question: the document's end (or the look-up's; recall's passages go too)
            r.cache.truncate(r.doc_end if recall else end)
        self.window.ids = self.window.ids + list(ids)
        yield from r.runner.drain()
        reasoning, text = split_answer(result.text) if reasons else ("", result.text)
        text = complete_sentences(text, result.reason, result.retried)
        if wim:  # cited by the notes that hold its words (engine/attribution.py), not by asking the model
            sure = not says_not_stated(text)
            held = in_cache or (set() if r.multiwindow else set(r.read_segments))  # the text the answer saw
            text = attributed(text, {i: t for i, t in notes.items() if i in used or i in in_cache}, query,
                              lambda i: note_label(r.segments[i]), fallback=sure,
                              passages={i: r.doc.segment_text(r.segments[i]) for i in sorted(held)} if sure else None)
        yield Answer(text, used, query, result.reason, cited(text, len(r.segments)) if wim else [],
                     list(self.window.passages), result.retried, reasoning)
        yield r._stats("answer")

    def _decode(self, logits, question_end: int, stop, reasons: bool = False) -> Iterator[Event]:
        """Stream the answer after the question; return its DecodeResult. An answer that reaches its token cap
        without ending a single sentence has not answered: it was copying a passage on and on (past the window,
        one copied a chapter heading and the paragraph after it). It is taken back once (where
        Settings.answer_retries lets an answer be taken back at all) and begun with its next-likeliest first
        token; if that one runs away too, the first stands. `reasons`: the prompt asked for reasoning before
        "Answer:" (room for both, and the stops wait for the answer)."""
        r = self.reading
        room = r.limit - question_end
        cap = self.answer_room(reasons)
        barred: set[int] = set()
        while True:
            result = DecodeResult()
            for _, piece in r.runner.decode(r.cache, logits, min(cap, room), stop,
                                            r.settings.temperature, r.generator, result=result, paragraph=True,
                                            retries=r.settings.answer_retries, barred_first=barred,
                                            answer_after=ANSWER_AFTER if reasons else None):
                if isinstance(piece, Rewound):
                    yield AnswerToken(piece.text, restart=True)
                elif piece:
                    yield AnswerToken(piece)
            runaway = result.reason == "limit" and not _SENTENCE_END.search(result.text)
            if barred or not runaway or not result.ids or not (r.runner.takes_back and r.settings.answer_retries):
                if barred and runaway:
                    result = first
                    yield AnswerToken(result.text, restart=True)
                return result
            first, barred = result, {result.ids[0]}
            r.cache.truncate(question_end)
            yield AnswerToken("", restart=True)

    def _chosen(self, margins) -> dict[int, str]:
        r = self.reading
        if isinstance(margins, dict):
            return {i: t for i, t in sorted(margins.items()) if t}
        selection = r.default_selection() if margins is None else sorted(margins)
        return {i: r.margins[i].text for i in selection if i in r.margins and r.margins[i].text}

    def notes_prompt(self, query: str, notes: dict[int, str], template: str | None = None):
        """(ids, used, dropped): the answer prompt after the text of the last window (inside one window, the
        document) with as many of `notes` as fit; the notes on segments in that window give way first."""
        r = self.reading
        return self._fit(query, notes, template, r.limit - r.doc_end,
                         set(r.windows[-1].segments) if r.windows else set())

    def _fitted(self, query: str, notes: dict[int, str], template: str | None, room: int, in_cache: set[int],
                stop) -> Iterator[Event]:
        """(ids, used, dropped) as _fit; with Settings.overflow `group`, the notes that overflow are grouped
        first (Reading.fitted_notes), those on segments whose text is in the cache left out of the groups (they
        give way first). `used` and `dropped` name segments, a group note's members included."""
        r = self.reading
        if r.settings.overflow != "group":
            return self._fit(query, notes, template, room, in_cache)
        room -= self._room_for(template)
        inside = {i: t for i, t in notes.items() if i in in_cache}
        outside = {i: t for i, t in notes.items() if i not in in_cache}
        items = yield from r.fitted_notes(outside, lambda lines: self._prompt(query, lines, template), room,
                                          r.cache.length, stop, "the answer")
        items.notes.update(inside)  # plain notes again: their label and score are their own
        ids, used, dropped = fit_notes(items.lines(), r.item_scores(items),
                                       lambda lines: self._prompt(query, lines, template), room,
                                       in_cache=set(inside), label=r.group_writing.label(items))
        return ids, items.members(used), items.members(dropped)

    def answer_room(self, reasons: bool) -> int:
        """Tokens an answer may take: the answer, and before it, where its prompt asks for reasoning,
        Settings.reasoning_tokens of it, at most a 16th of the window (in a small one the notes and passages need
        the room more)."""
        s = self.reading.settings
        return s.answer_tokens + (min(s.reasoning_tokens, self.reading.limit // 16) if reasons else 0)

    def _room_for(self, template: str | None) -> int:
        """answer_room for the answer prompt with notes (`template`, else the default)."""
        return self.answer_room(self._reasons(template))

    def _reasons(self, template: str | None) -> bool:
        """Whether the answer prompt with notes (`template`, else the default) asks for reasoning first."""
        return reasons_first(template if template is not None else self._template(True))

    def _template(self, with_notes: bool) -> str:
        """The answer prompt's text: with notes, reasoning first where Settings.reasoning_tokens asks for it."""
        if not with_notes:
            return prompt("answer_no_notes")
        return prompt("answer_reasoned" if self.reading.settings.reasoning_tokens else "answer")

    def _prompt(self, query: str, lines: str, template: str | None) -> list[int]:
        r = self.reading
        if template is None:
            # No note kept: the margins found nothing on the question, which is evidence the document may not
            # answer it, so this prompt (and only this one) lets the answer say so. Asked of every answer, the
            # 1.5B said "does not say" to 4-5 of 8-12 answerable questions (seed 1, 16k: docs/quality.md).
            template = self._template(bool(lines))
        return r.layout.encode(r.layout.closing + template.format(query=query, margins=lines or "(none)")
                               + r.layout.turn_end)

    def _fit(self, query: str, notes: dict[int, str], template: str | None, room: int, in_cache: set[int]):
        """The answer prompt with as many of the chosen notes as fit in `room` less the answer's own tokens."""
        r = self.reading
        return fit_notes(notes, r._note_scores(), lambda lines: self._prompt(query, lines, template),
                         room - self._room_for(template), in_cache=in_cache,
                         label=lambda i: note_label(r.segments[i]))

    def _passages_that_fit(self, query: str, notes: dict[int, str], template: str | None, room: int,
                           fill: bool = False) -> list[int]:
        """The chosen notes whose passages fit in `room` beside all the notes and the question, in document order
        (the highest-scored notes' passages first when not all fit). With no note chosen, or with `fill` in the
        room the notes' passages leave, the passages of the segments the margins scored highest (the classifier's
        score: by default the note's own first-step relevance, which a segment that said "nothing" has too)."""
        r = self.reading
        every_note = self._prompt(query, note_lines(notes, list(notes), lambda i: note_label(r.segments[i])), template)
        room -= len(every_note) + self._room_for(template)
        scores = r._note_scores()

        def ranked(segments) -> list[int]:
            return sorted(segments, key=lambda i: (-scores.get(i, 1.0), i))

        others = [i for i in r.margins if r.margins[i].score is not None and i not in notes]
        candidates = ranked(notes) + (ranked(others) if fill or not notes else [])
        chosen, used = [], 0
        for i in candidates:
            if used + r.segments[i].tokens <= room:
                chosen.append(i)
                used += r.segments[i].tokens
        return sorted(chosen)

    def _feed_passages(self, chosen: list[int], stop) -> list[int]:
        r = self.reading
        ids: list[int] = []
        with r.engine.lock:
            for i in chosen:
                piece = r.doc.segment_ids(r.segments[i])
                r.runner.prefill(piece, r.cache, stop)
                ids += piece
        return ids

    def _recall(self, query: str, notes: dict[int, str], template: str | None, stop) -> Iterator[Event]:
        """Inside one window, the document in the cache: the chosen notes' passages re-read after it."""
        r = self.reading
        chosen = self._passages_that_fit(query, notes, template, r.limit - r.doc_end)
        self.window = AnswerWindow(chosen, self._feed_passages(chosen, stop))
        if len(chosen) < len(notes):
            yield Notice(f"The answer re-reads the passages of {len(chosen)} of the {len(notes)} kept notes "
                         "(as many as fit in the window) after the document.")

    def _lookup_window(self, query: str, notes: dict[int, str], template: str | None, stop,
                       fill: bool = False) -> Iterator[Event]:
        """Fill the cache with the prefix and the passages of the chosen notes, in document order, as many as fit
        beside all the notes and the question (the highest-scored notes' passages first when not all fit); `fill`:
        then the likeliest other passages in the room left."""
        r = self.reading
        last = r.windows[-1] if r.windows else None  # none: notes taken up without their cache (restore_notes)
        if last is not None and r.cache_window is last and not last.kept:
            notice = r._keep_window(last)  # remargin, saving and plain follow-ups need it back afterwards
            if notice:
                yield notice
        chosen = self._passages_that_fit(query, notes, template, r.limit - len(r.layout.prefix), fill)
        r.cache.truncate(0)
        r.cache_window = None  # the cache holds no reading window now
        with r.engine.lock:
            r.runner.prefill(r.layout.prefix, r.cache, stop)
        self.window = AnswerWindow(chosen, self._feed_passages(chosen, stop))
        noted = set(chosen) & set(notes)  # the chosen passages that have a kept note
        if not notes:
            yield Notice(f"No note was kept: the answer re-reads the {len(chosen)} passages the margins scored "
                         "likeliest to help (as many as fit in the window).")
        elif fill and len(chosen) > len(noted):
            yield Notice(f"The answer re-reads the passages of {len(noted)} of the {len(notes)} "
                         f"kept notes and {len(set(chosen) - noted)} more the margins scored likeliest "
                         "(as many as fit in the window) beside all the notes.")
        elif len(chosen) < len(notes):
            yield Notice(f"The answer re-reads the passages of {len(chosen)} of the {len(notes)} kept notes "
                         "(as many as fit in the window) beside all the notes.")
