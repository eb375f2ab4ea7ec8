"""Margins of margins: when a long text's kept notes no longer fit the room they are given (the notes carried
into a new window, or the notes beside an answer), consecutive notes are grouped and one note is written over
each group, from the cache, the way a margin is: the group's notes and the question are appended after the
text in the cache, the note is decoded, and both are cut off again. The group notes stand in for their
members; a group note can itself be grouped again (a whole book under a small window: tiers of notes).

    [prefix][window's segments][group instruction: notes a..b + question][group note]   <- cut off (O(1))

`overflow` "drop" (the default until measured better) keeps today's handling: the lowest-scored notes give
way (engine/prompts.py:fit_notes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .events import Event, GroupMargin, Notice
from .generate import DecodeResult
from .margins import Extractive, Scratch, pieces_of
from .prompts import note_lines
from .answering import span_label
from .classify import says_nothing

OVERFLOWS = ("drop", "group")
LINE_TOKENS = 12  # what a note's line costs beyond its text: "- [segments 12-19, pages 3-5] "


@dataclass
class GroupNote:
    """One note written over consecutive notes (`members`, segment indexes in reading order; a member group
    note's members are listed, not the group). `first`..`last`: the segments it covers."""
    first: int
    last: int
    text: str
    members: list[int]
    tier: int = 1
    spans: list[tuple[int, int]] = field(default_factory=list)  # copied: the document's characters it copies


@dataclass
class Carried:
    """The notes as they stand in for the text: raw notes by segment index, group notes by their first segment
    (a group's members are never among the raw notes)."""
    notes: dict[int, str] = field(default_factory=dict)
    groups: dict[int, GroupNote] = field(default_factory=dict)
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # each item's copied characters

    def lines(self) -> dict[int, str]:
        """Every item's text, keyed by its first segment, in reading order."""
        items = {**self.notes, **{k: g.text for k, g in self.groups.items()}}
        return dict(sorted(items.items()))

    def last(self, key: int) -> int:
        """The last segment the item `key` covers."""
        return self.groups[key].last if key in self.groups else key

    def members(self, keys: list[int]) -> list[int]:
        """The segments whose notes the items `keys` carry."""
        out: list[int] = []
        for k in keys:
            out += self.groups[k].members if k in self.groups else [k]
        return sorted(out)


def carried(notes: dict[int, str], groups, spans: dict[int, list[tuple[int, int]]] | None = None) -> Carried:
    """`notes` (segment -> text; `spans`: the characters each copied) with the group notes already written
    (`groups`: a dict or list of GroupNote) standing in for their members, the widest first, where every member
    is among `notes` (a reader who set one of them aside gets the others as notes of their own)."""
    out = Carried(dict(notes), spans={i: [tuple(x) for x in v] for i, v in (spans or {}).items() if i in notes})
    values = groups.values() if isinstance(groups, dict) else groups
    for group in sorted(values, key=lambda g: (-len(g.members), g.first)):
        if all(m in out.notes for m in group.members):
            for m in group.members:
                del out.notes[m]
                out.spans.pop(m, None)
            out.groups[group.first] = group
            out.spans[group.first] = list(group.spans)
    return out


class GroupWriting:
    """The group notes of one reading, written from its cache (the reading hands it the cache and where its
    text ends), and kept by the (first, last) segments each covers for the windows and answers after."""

    def __init__(self, engine, settings, doc, runner, generator):
        self.engine, self.settings, self.doc, self.runner, self.generator = engine, settings, doc, runner, generator
        self.layout = engine.layout
        self.groups: dict[tuple[int, int], GroupNote] = {}

    def span(self, first: int, last: int) -> str:
        """How a note over segments `first`..`last` names where it came from."""
        return span_label(self.doc.segments, first, last)

    def label(self, items: Carried) -> Callable[[int], str]:
        """How each of `items` names the segments it covers."""
        return lambda k: self.span(k, items.last(k))

    def fitted(self, notes: dict[int, str], spans: dict[int, list], query: str, build: Callable[[str], list[int]],
               room: int, cache, doc_end: int, stop, where: str) -> Iterator[Event]:
        """`notes` (and the characters each copied) as items for fit_notes. With `overflow` group, when they do
        not fit the prompt `build(lines)` in `room` tokens: the group notes written earlier stand in for their
        members, then new ones are written from the cache (which ends at `doc_end`) until they fit; a Notice says
        so, naming `where` the room is. Otherwise each note is an item of its own."""
        items = carried(notes, {})
        if self.settings.overflow != "group" or len(build(lines_of(items, self.span))) <= room:
            return items
        items = carried(notes, self.groups, spans)
        yield from self.fit(items, query, cache, doc_end, room, self.span, build, stop)
        for group in items.groups.values():
            self.groups[group.first, group.last] = group
        yield Notice(f"The {len(notes)} kept notes do not fit in the room {where} gives them: "
                     f"{len(items.groups)} notes written over groups of them stand in for "
                     f"{len(notes) - len(items.notes)}, beside {len(items.notes)} of their own.")
        return items

    def fit(self, items: Carried, query: str, cache, doc_end: int, room: int, label: Callable[[int, int], str],
            build: Callable[[str], list[int]], stop) -> Iterator[Event]:
        """Group `items` (in place) until the prompt `build(lines)` holds them all in `room` tokens, or one item is
        left. Each round groups runs of consecutive items, oldest first, into as many group notes as the room
        holds at a margin's full length each. `label(first, last)`: how a note names the segments it covers.
        Yields a GroupMargin per note written."""
        per_note = self.settings.margin_tokens + LINE_TOKENS
        while len(items.lines()) > 1 and len(build(lines_of(items, label))) > room:
            keys = list(items.lines())
            target = max(1, (room - len(build(""))) // per_note)
            size = max(2, math.ceil(len(keys) / target))
            for start in range(0, len(keys), size):
                run = keys[start:start + size]
                if len(run) < 2:
                    continue  # a lone item left at the end stays as it is
                group = yield from self._write(items, run, query, cache, doc_end, label, stop)
                for k in run:
                    items.notes.pop(k, None)
                    items.groups.pop(k, None)
                    items.spans.pop(k, None)
                if group is not None:
                    items.groups[group.first] = group
                    items.spans[group.first] = list(group.spans)

    def _write(self, items: Carried, run: list[int], query: str, cache, doc_end: int, label, stop
               ) -> Iterator[Event]:
        """One note over the items `run`, written after the cache's text (which ends at `doc_end`) and cut off
        again; None when the model finds nothing in them that helps (the group is dropped, as a margin saying
        NONE is). Copied margins get a copied group note: sentences chosen from the members' copied sentences
        (engine/margins.py's Extractive, over those sentences), so it too is the document's own words; free-form
        margins a free-form one."""
        lines = items.lines()
        last = items.last(run[-1])
        notes = "\n".join(f"- [{label(k, items.last(k))}] {lines[k]}" for k in run)
        spans = sorted({span for k in run for span in items.spans.get(k, ())})
        copying = self.settings.margins != "abstractive" and bool(spans)
        ids = self.layout.suffix("group_note_extractive" if copying else "group_note", query=query, notes=notes,
                                 span=label(run[0], last))
        with self.engine.lock:
            try:
                text, spans, ending = (self._copied(ids, spans, cache, doc_end, stop) if copying
                                       else self._free(ids, cache, stop))
            finally:
                cache.truncate(doc_end)  # the instruction and the note leave the cache: O(1)
        if not text or says_nothing(text):
            return None
        tier = 1 + max((items.groups[k].tier for k in run if k in items.groups), default=0)
        group = GroupNote(run[0], last, text, items.members(run), tier, list(spans))
        yield GroupMargin(group.first, group.last, text, group.members, tier, ending)
        return group

    def _free(self, ids: list[int], cache, stop) -> tuple[str, tuple, str]:
        s = self.settings
        result = DecodeResult()
        logits = self.runner.prefill(ids, cache, stop)
        for _ in self.runner.decode(cache, logits, s.margin_tokens, stop, s.temperature, self.generator,
                                    result=result, paragraph=True):
            pass
        return result.text.strip(), (), result.reason

    def _copied(self, ids: list[int], spans: list[tuple[int, int]], cache, doc_end: int, stop
                ) -> tuple[str, tuple, str]:
        s, lm = self.settings, self.engine.lm
        pieces = [p for a, b in spans
                  for p in pieces_of(self.doc.text, a, b, lm.tokenizer, s.margin_tokens, self.doc.running)]
        writer = Extractive(lm.tokenizer, self.runner.stop_ids, s.margin_tokens, s.temperature, self.generator,
                            s.copy_threshold, s.copy_choice)
        scratch = (self.runner.scratch(cache, doc_end, stop) if hasattr(self.runner, "scratch")
                   else Scratch(self.runner, cache, doc_end, None, stop))
        pieces_out = writer.write(scratch, ids, pieces)
        while True:
            try:
                next(pieces_out)
            except StopIteration as done:
                note = done.value
                return note.text, note.spans, note.ending


def lines_of(items: Carried, label: Callable[[int, int], str]) -> str:
    """The items as the prompts list notes: one line each, tagged with the segments it covers."""
    lines = items.lines()
    return note_lines(lines, list(lines), lambda k: label(k, items.last(k)))
