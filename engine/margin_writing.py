"""How a reading writes its margins from the KV cache: after a segment, the instruction, the note (one of the
writers in engine/margins.py), the cut back to the end of the document, and the note's relevance; for a new
question, the same at every boundary of a window, one after another or in one batch (engine/batch_scratch.py).

It holds no document state of its own: the reading hands it the cache, where the document ends, and a `keep`
callback that files each finished note (engine/wim.py's Reading keeps them by segment index).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from .batch_scratch import BatchScratch
from .classify import Classifier
from .events import Event, Margin, MarginToken
from .evidence import proposed
from .margins import OPENING_TOKENS, Abstractive, Extractive, Note, Scored, Scratch, pieces_of
from .segment import Segment


SCORING_ROOM = 8 * OPENING_TOKENS


@dataclass
class MarginNote:
    index: int
    text: str
    relevant: bool | None
    score: float | None
    spans: list[tuple[int, int]] = field(default_factory=list)


class MarginWriting:
    """The margins of one reading (engine, settings, segmented text, runner and sampling generator)."""

    def __init__(self, engine, settings, doc, runner, generator):
        self.engine, self.settings, self.doc, self.runner, self.generator = engine, settings, doc, runner, generator
        self.layout = engine.layout

    def instruction(self, query: str, index: int | None = None) -> list[int]:
        """The margin instruction after a segment (engine/prompts/): the same after every segment."""
        return self.layout.suffix(self.settings.margin_prompt, query=query)

    def instruction_reserve(self) -> int:
        """Room a margin's instruction may take past the document, the question's words aside."""
        return len(self.layout.suffix(self.settings.margin_prompt, query=""))

    def folds_instruction(self) -> bool:
        """Whether the margin instruction rides in its segment's last prefill pass: with the model in this
        process (a server backend lays tokens down without passes). One pass fewer per margin; in one profiled 4k
        read with SmolLM2 the eight instruction passes were ~1.3 s of the 6.7 s WiM added to plain reading."""
        return not hasattr(self.runner, "scratch")

    def writer_for(self, seg: Segment):
        """(writer, pieces): the settings' margin writer, and the sentences of `seg` it may copy."""
        s = self.settings
        lm = self.engine.lm
        pieces = pieces_of(self.doc.text, seg.char_start, seg.char_end, lm.tokenizer, s.margin_tokens,
                           self.doc.running)
        if s.margins == "extractive":
            writer = Extractive(lm.tokenizer, self.runner.stop_ids, s.margin_tokens, s.temperature, self.generator,
                                s.copy_threshold, s.copy_choice)
        elif s.margins == "scored":
            writer = Scored(lm.tokenizer, s.margin_tokens, s.copy_threshold)
        else:
            writer = Abstractive(self.runner, s.margin_tokens, s.temperature, self.generator)
        return writer, pieces

    def write(self, seg: Segment, query: str, classifier: Classifier, cache, doc_end: int, stop,
              keep: Callable[[MarginNote], None], visible: int | None = None,
              fed: tuple[list[int], object] | None = None) -> Iterator[Event]:
        """Instruction, note, cut. `visible=None`: the instruction follows the end of the cache (reading). An
        int: it sits in scratch room past the document, positioned after boundary `visible` and masked to see
        only the cache up to there (new-question margins). `fed`: the instruction is already in the cache (fed
        with the segment), with the logits after it."""
        t = time.perf_counter()
        instruction = fed[0] if fed else self.instruction(query, seg.index)
        writer, pieces = self.writer_for(seg)
        with self.engine.lock:
            scratch = (self.runner.scratch(cache, doc_end, stop) if hasattr(self.runner, "scratch")
                       else Scratch(self.runner, cache, doc_end, visible, stop, fed))
            try:
                note: Note = yield from _relay(seg.index, writer.write(scratch, instruction, pieces))
            finally:
                # Cut the instruction and the note off: the cache is back at the end of the document.
                cache.truncate(doc_end)
        note = yield from self.complete(seg, note, pieces, query)
        yield from self.file(seg, note, query, classifier, stop, time.perf_counter() - t, keep)

    def complete(self, seg: Segment, note: Note, pieces, query: str) -> Iterator[Event]:
        """The note with the sentences of its segment that the evidence proposes and the model did not copy
        (engine/evidence.py), after the model's own copy, in text order, as many as the note's token cap holds.
        Streams the added text (what streamed is the note); returns the completed Note. Free-form notes are left
        as they are."""
        if self.settings.margins == "abstractive" or not pieces:
            return note
        device = "cuda" if self.engine.lm.device.type == "cuda" else "cpu"
        have = set(note.spans)
        extra = [i for i in proposed(query, [p.text for p in pieces], device) if pieces[i].span not in have]
        room = self.settings.margin_tokens - note.tokens
        added = []
        for i in extra:
            if len(pieces[i].ids_after) <= room:
                added.append(i)
                room -= len(pieces[i].ids_after)
        if not added:
            return note
        more = " ".join(pieces[i].text for i in added)
        yield MarginToken(seg.index, (" " if note.text else "") + more)
        return replace(note, text=f"{note.text} {more}" if note.text else more,
                       spans=(*note.spans, *(pieces[i].span for i in added)),
                       tokens=note.tokens + sum(len(pieces[i].ids_after) for i in added), proposed=len(added),
                       ending=note.ending if note.text else "proposed")

    def file(self, seg: Segment, note: Note, query: str, classifier: Classifier, stop, seconds: float,
             keep: Callable[[MarginNote], None]) -> Iterator[Event]:
        """Decide a written note's relevance, keep it, and announce it."""
        s = self.settings
        with self.engine.lock:
            if s.classifier == "none":
                relevant, score = None, note.relevance
            elif not note.text:
                relevant, score = False, note.relevance
            elif note.proposed or s.classifier == "margin":
                relevant, score = True, note.relevance
            else:
                relevant, score = classifier(query, note.text, stop, relevance=note.relevance)
        score = None if score is None else round(score, 4)
        keep(MarginNote(seg.index, note.text, relevant, score, list(note.spans)))
        yield Margin(seg.index, note.text, relevant, score, note.tokens, round(seconds, 4), seg.pages,
                     note.spans, note.ending)

    def together_possible(self, cache) -> bool:
        """Whether a window's new-question margins may be written in one batch: the local runner over the
        preallocated cache, a writer that decodes token by token (scored notes score rows of their own), and
        greedy choice (sampling would draw from the shared generator in another order than one margin after
        another, and the notes would differ from a fresh read's)."""
        s = self.settings
        return (not hasattr(self.runner, "scratch") and hasattr(cache, "evict") and s.margins != "scored"
                and s.temperature <= 0)

    def write_together(self, segments: list[Segment], boundaries: dict[int, int], query: str,
                       classifier: Classifier, cache, doc_end: int, limit: int, stop,
                       keep: Callable[[MarginNote], None]) -> Iterator[Event]:
        """The new question's margins at the boundaries of `segments` (in the cache), decoded together: as many
        rows at once as the room after the document holds, one forward pass per step for all of them."""
        s = self.settings
        instruction = self.instruction(query)
        # A row holds its instruction and at most its note (an extractive step may feed a few forced tokens
        # past the budget's last choice: the slack).
        per_row = len(instruction) + s.margin_tokens + 16
        # Room left after the rows for a writer's scoring passes (a copy chosen by its opening), at least a few rows.
        size = max(1, (limit - doc_end - SCORING_ROOM) // per_row)
        for k in range(0, len(segments), size):
            group = segments[k:k + size]
            t = time.perf_counter()
            jobs = [(boundaries[seg.index], *self.writer_for(seg)) for seg in group]
            jobs = [(visible, writer, instruction, pieces) for visible, writer, pieces in jobs]
            with self.engine.lock:
                rows = BatchScratch(self.runner, cache, doc_end, stop).write(jobs)
            seconds = (time.perf_counter() - t) / len(group)  # written together: each gets its share
            for seg, row, (_, _, _, pieces) in zip(group, rows, jobs):
                for piece in row.pieces:
                    yield MarginToken(seg.index, piece)
                note = yield from self.complete(seg, row.note, pieces, query)
                yield from self.file(seg, note, query, classifier, stop, seconds, keep)


def _relay(index: int, pieces) -> Iterator[Event]:
    """Stream a margin writer's text pieces as MarginToken events; return the writer's Note."""
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            return done.value
        yield MarginToken(index, piece)
