"""Answers a question from a reading's cache: what the cache holds of the text (past the window, the passages of
the kept notes read again), then the chosen notes in reading order, each tagged with its segment and page, then
the question; the answer ends at a sentence end and cites the notes that hold its words.

Cache layout of an answer inside one window (the document was prefilled once, while reading):

    [prefix][segment 0]...[segment n-1][notes + question][answer tokens]      <- cut back to the document's end

and past the window, where the cache holds only the last window (ReadAgent's look-up, in WiM's terms: context
plus margins, which the paper's ablation found better than either alone):

    [prefix][passage of kept note a][passage of kept note b]...[notes + question][answer tokens]

With no note kept past the window, the passages the margins scored likeliest to help are read again instead. The
look-up window replaces the last window in the cache (kept first, for remargin and follow-ups). It answers from
what it is handed: the reading's state (engine/reading_state.py) and a way to put the last window back in the
cache.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .attribution import PIECE_END, attributed, cited, without_citations
from .events import Answer, AnswerToken, Event, Notice
from .evidence import declines
from .generate import DecodeResult, Rewound, Stopped
from .prompts import fit_notes, note_label, note_lines, prompt
from .reading_state import ReadingState

NOT_STATED = re.compile(r"\b(?:does not|doesn't|do not|did not) (?:say|state|mention|tell)|\bnot (?:stated|mentioned|"
                        r"given|specified)\b", re.IGNORECASE)
# A sentence ends at . ! ? (after a quote or bracket too, or a citation right after it).
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*(?:\s*\[[^\]]*\])*(?=\s|$)")


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


DECLINE = "The document does not say."


class Answering:
    """The answers of one reading, from its cache. `state`: the reading's (engine/reading_state.py);
    `last_window_in_cache(stop)`: events while the reading puts its last window back into the cache."""

    def __init__(self, state: ReadingState, last_window_in_cache: Callable[[threading.Event | None], Iterator[Event]]):
        self.state = state
        self.last_window_in_cache = last_window_in_cache
        self.window = AnswerWindow()

    def answer(self, query: str, margins: list[int] | dict[int, str] | None = None,
               stop: threading.Event | None = None, plain: bool = False, template: str | None = None
               ) -> Iterator[Event]:
        """See Reading.answer. `template`: the answer prompt's text (default engine/prompts/answer.txt)."""
        r = self.state
        if not r.read_segments:
            raise RuntimeError("Nothing has been read yet: call read() first.")
        if plain and r.multiwindow:
            raise RuntimeError("A multi-window reading holds only its last window: plain reading answers from "
                               "its own read.")
        query = query.strip()
        r.new_phase()
        notes = self._chosen(margins)
        wim = r.settings.mode == "wim" and not plain
        if wim and declines(query, r.doc.text, len(notes), "cuda" if getattr(r.runner.device, "type", "") == "cuda" else "cpu"):
            # No note kept and no sentence near the question: the evidence says the document does not say, so the
            # answer says so (a prompt that offered the model this way out turned right answers into declines).
            yield Answer(DECLINE, [], query, "declined", [], [], 0)
            yield r.stats("answer")
            return
        lookup = wim and r.multiwindow  # past the window: passages read again into a fresh window
        try:
            if lookup:
                yield from self._lookup_window(query, notes, template, stop)
            else:
                yield from self.last_window_in_cache(stop)
                r.cache.truncate(r.doc_end)
                self.window = AnswerWindow()
        except Stopped:
            r.cache_window = None  # half built: the next answer builds it again
            yield r.stats("answer", stopped=True)
            return
        if wim:
            in_cache = set(self.window.passages) if lookup else set(r.windows[-1].segments) if r.windows else set()
            ids, used, dropped = self._fit(query, notes, template, r.limit - r.cache.length, in_cache)
            if dropped:
                yield Notice(f"{len(dropped)} margin(s) did not fit in the context window and were left out "
                             f"of the answer: {', '.join(str(i + 1) for i in dropped)}.")
        else:
            ids, used = r.layout.suffix("answer_plain", query=query), []
        end = r.cache.length
        try:
            with r.engine.lock:
                logits = r.runner.prefill(ids, r.cache, stop)
                result = yield from self._decode(logits, end + len(ids), stop)
        except Stopped:
            yield r.stats("answer", stopped=True)
            return
        finally:
            r.cache.truncate(end)  # ready for a follow-up question: the document's end (or the look-up's)
        self.window.ids = self.window.ids + list(ids)
        yield from r.runner.drain()
        text = complete_sentences(result.text, result.reason, result.retried)
        if wim:  # cited by the notes that hold its words (engine/attribution.py), not by asking the model
            sure = not says_not_stated(text)
            held = in_cache or (set() if r.multiwindow else set(r.read_segments))  # the text the answer saw
            text = attributed(text, {i: t for i, t in notes.items() if i in used or i in in_cache}, query,
                              lambda i: note_label(r.segments[i]), fallback=sure,
                              passages={i: r.doc.segment_text(r.segments[i]) for i in sorted(held)} if sure else None)
        yield Answer(text, used, query, result.reason, cited(text, len(r.segments)) if wim else [],
                     list(self.window.passages), result.retried)
        yield r.stats("answer")

    def _decode(self, logits, question_end: int, stop) -> Iterator[Event]:
        """Stream the answer after the question; return its DecodeResult. An answer that reaches its token cap
        without ending a single sentence has not answered: it was copying a passage on and on (past the window,
        one copied a chapter heading and the paragraph after it). It is taken back once (where
        Settings.answer_retries lets an answer be taken back at all) and begun with its next-likeliest first
        token; if that one runs away too, the first stands."""
        r = self.state
        room = r.limit - question_end
        barred: set[int] = set()
        while True:
            result = DecodeResult()
            for _, piece in r.runner.decode(r.cache, logits, min(r.settings.answer_tokens, room), stop,
                                            r.settings.temperature, r.generator, result=result, paragraph=True,
                                            retries=r.settings.answer_retries, barred_first=barred):
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
        r = self.state
        if isinstance(margins, dict):
            return {i: t for i, t in sorted(margins.items()) if t}
        selection = r.default_selection() if margins is None else sorted(margins)
        return {i: r.margins[i].text for i in selection if i in r.margins and r.margins[i].text}

    def notes_prompt(self, query: str, notes: dict[int, str], template: str | None = None):
        """(ids, used, dropped): the answer prompt after the text of the last window (inside one window, the
        document) with as many of `notes` as fit; the notes on segments in that window give way first."""
        r = self.state
        return self._fit(query, notes, template, r.limit - r.doc_end,
                         set(r.windows[-1].segments) if r.windows else set())

    def _prompt(self, query: str, lines: str, template: str | None) -> list[int]:
        r = self.state
        if template is None:
            # No note kept: the margins found nothing on the question, which is evidence the document may not
            # answer it, so this prompt (and only this one) lets the answer say so. Asked of every answer, the
            # 1.5B said "does not say" to 4-5 of 8-12 answerable questions (seed 1, 16k: docs/quality.md).
            template = prompt("answer" if lines else "answer_no_notes")
        return r.layout.encode(r.layout.closing + template.format(query=query, margins=lines or "(none)")
                               + r.layout.turn_end)

    def _fit(self, query: str, notes: dict[int, str], template: str | None, room: int, in_cache: set[int]):
        """The answer prompt with as many of the chosen notes as fit in `room` less the answer's own tokens."""
        r = self.state
        return fit_notes(notes, r.note_scores(), lambda lines: self._prompt(query, lines, template),
                         room - r.settings.answer_tokens, in_cache=in_cache,
                         label=lambda i: note_label(r.segments[i]))

    def _passages_that_fit(self, query: str, notes: dict[int, str], template: str | None, room: int) -> list[int]:
        """The chosen notes whose passages fit in `room` beside all the notes and the question, in document order
        (the highest-scored notes' passages first when not all fit). With no note chosen, the passages of the
        segments the margins scored highest (the classifier's score: by default the note's own first-step
        relevance, which a segment that said "nothing" has too)."""
        r = self.state
        every_note = self._prompt(query, note_lines(notes, list(notes), lambda i: note_label(r.segments[i])), template)
        room -= len(every_note) + r.settings.answer_tokens
        scores = r.note_scores()
        candidates = notes if notes else [i for i in r.margins if r.margins[i].score is not None]
        chosen, used = [], 0
        for i in sorted(candidates, key=lambda i: (-scores.get(i, 1.0), i)):
            if used + r.segments[i].tokens <= room:
                chosen.append(i)
                used += r.segments[i].tokens
        return sorted(chosen)

    def _lookup_window(self, query: str, notes: dict[int, str], template: str | None, stop) -> Iterator[Event]:
        """Fill the cache with the prefix and the passages of the chosen notes, in document order, as many as fit
        beside all the notes and the question (the highest-scored notes' passages first when not all fit)."""
        r = self.state
        last = r.windows[-1] if r.windows else None  # none: notes taken up without their cache (restore_notes)
        if last is not None and r.cache_window is last and not last.kept:
            notice = r.keep_window(last)  # remargin, saving and plain follow-ups need it back afterwards
            if notice:
                yield notice
        chosen = self._passages_that_fit(query, notes, template, r.limit - len(r.layout.prefix))
        r.cache.truncate(0)
        r.cache_window = None  # the cache holds no reading window now
        ids: list[int] = []
        with r.engine.lock:
            r.runner.prefill(r.layout.prefix, r.cache, stop)
            for i in chosen:
                piece = r.doc.segment_ids(r.segments[i])
                r.runner.prefill(piece, r.cache, stop)
                ids += piece
        self.window = AnswerWindow(chosen, ids)
        if not notes:
            yield Notice(f"No note was kept: the answer re-reads the {len(chosen)} passages the margins scored "
                         "likeliest to help (as many as fit in the window).")
        elif len(chosen) < len(notes):
            yield Notice(f"The answer re-reads the passages of {len(chosen)} of the {len(notes)} kept notes "
                         "(as many as fit in the window) beside all the notes.")
