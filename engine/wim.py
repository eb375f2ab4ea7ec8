"""Writing in the Margins: read a document chunk by chunk into one KV cache, write a margin note after each
chunk, cut the note off again, and answer from the same cache.

Cache layout while reading (one window):

    [prefix][segment 0][segment 1]...[segment i]   <- kept
                                              [margin instruction][margin tokens]   <- scratch, cut off (O(1))

and while answering (engine/answering.py, which also lays out the answer window past the context window):

    [prefix][segment 0]...[segment n-1][answer instruction with margins + question][answer tokens]

After an answer the cache is cut back to the end of the document, so follow-up questions reuse it. A finished
reading is saved and taken up again by engine/saved.py.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator

from . import saved
from .answering import Answering
from .cache import key_rotation
from .classify import Classifier
from .events import Event, Notice, SegmentRead, WindowStart
from .generate import Stopped
from .margin_writing import MarginNote, MarginWriting
from .model import LoadedModel, load_model
from .plan import document_note, plan_windows, rag_choice
from .prompts import PromptLayout, fit_notes, note_label
from .reading_state import ReadingState
from .segment import Segment, SegmentedText, segment
from .settings import Settings
from .windows import Window

class Engine:
    """One loaded model; opens readings of documents."""

    def __init__(self, loaded: LoadedModel):
        self.lm = loaded
        self.layout = PromptLayout(loaded.tokenizer)
        # One forward pass at a time per local model; a server backend batches concurrent readings itself.
        self.lock = threading.Lock() if loaded.serial else contextlib.nullcontext()

    @classmethod
    def load(cls, spec: str = "embedded", device: str | None = None, dtype: str | None = None,
             backend: str = "local", base_url: str | None = None, decode_weights: str | None = None,
             prefill_weights: str | None = None) -> "Engine":
        """backend `local`: the model in this process. `openai`: a completions server at `base_url` serving
        `spec` (its tokenizer is loaded here; see engine/remote.py). decode_weights: engine/model.py's
        pick_decode_weights; prefill_weights: engine/prefill_int8.py's pick_prefill_weights."""
        if backend == "openai":
            if not base_url:
                raise ValueError("the openai backend needs the server's URL (--base-url)")
            from .remote import load_remote
            return cls(load_remote(spec, base_url))
        if backend != "local":
            raise ValueError(f"backend must be local or openai, not {backend!r}")
        return cls(load_model(spec, device, dtype, decode_weights, prefill_weights))

    def open(self, text: str, settings: Settings = Settings(), page_starts: list[int] | None = None,
             segmented: SegmentedText | None = None) -> "Reading":
        """`segmented`: the text already segmented for this model and settings (segment()), so it is not again."""
        return Reading(self, text, settings.validate(), page_starts, segmented)

    def run(self, text: str, query: str, settings: Settings = Settings(), page_starts=None,
            stop: threading.Event | None = None) -> Iterator[Event]:
        """Read, then answer with the classifier's selection: the whole pipeline as one event stream."""
        reading = self.open(text, settings, page_starts)
        yield from reading.read(query, stop)
        if not (stop and stop.is_set()):
            yield from reading.answer(query, stop=stop)


class Reading(ReadingState):
    """A document segmented for one model, read into the KV cache that its state (engine/reading_state.py) holds."""

    def __init__(self, engine: Engine, text: str, settings: Settings, page_starts: list[int] | None,
                 segmented: SegmentedText | None = None):
        lm = engine.lm
        limit = min(settings.context_limit or lm.context_length, lm.context_length)
        doc = segmented or segment(text, lm.tokenizer, settings.segment_tokens, page_starts)
        if not doc.segments:
            raise ValueError("The document has no text to read.")
        super().__init__(engine, settings, doc, limit)
        self.notes = MarginWriting(engine, settings, self.doc, self.runner, self.generator)
        self.answering = Answering(self, self.last_window_in_cache)
        self.plan = plan_windows(settings, doc, limit, len(self.layout.prefix), self.notes.instruction_reserve())
        self.multiwindow, self.skipped, self.window_reserve = \
            self.plan.multiwindow, self.plan.skipped, self.plan.window_reserve
        if settings.window == "sliding":
            if not hasattr(self.cache, "evict"):
                raise ValueError("The sliding cache needs the preallocated cache; this model uses another.")
            self.rotate = key_rotation(lm.model)

    def document_note(self) -> str | None:
        """What the user should know about how this text will be read, if anything."""
        return document_note(self.settings, self.plan, self.doc, self.limit)

    # ---- reading -------------------------------------------------------------------------------------
    def read(self, query: str, stop: threading.Event | None = None, skip: dict[int, str] | None = None
             ) -> Iterator[Event]:
        """Prefill every segment; in `wim` mode write a margin after each. `skip` maps segment indexes to margins
        already written (a resumed reading): those segments are re-read into the cache, their margins kept."""
        query = self.query = query.strip()
        skip = skip or {}
        self.reset()
        mode = self.settings.mode
        classifier = Classifier(self.settings.classifier, self.runner, self.layout,
                                self.settings.embedding_threshold) if mode == "wim" else None
        # RAG's chosen segments, as many of the best as fit in the window beside the question and the answer
        chosen = rag_choice(self.settings, self.doc, query, self.limit - len(self.layout.prefix) - 256
                            - self.settings.answer_tokens, self.engine.lm.device) if mode == "rag" else None
        note = self.document_note()
        if note:
            yield Notice(note)
        try:
            self.runner.prefill(self.layout.prefix, self.cache, stop)
            self.doc_end = self.cache.length
            self.cache_window = self.window_store.start(0, self.layout.prefix, self.doc_end)
            for seg in self.segments:
                if (chosen is not None and seg.index not in chosen) or seg.index in self.skipped:
                    continue
                if self.cache.length + seg.tokens + self.window_reserve > self.limit:
                    if self.settings.window == "sliding":
                        yield self._slide(seg)
                    else:
                        yield from self._new_window(seg.index, stop)
                t = time.perf_counter()
                instruction = self.notes.instruction(query, seg.index) if mode == "wim" and seg.index not in skip \
                    and self.notes.folds_instruction() else []
                logits = self._prefill_segment(seg, self.windows[-1], stop, then=instruction)
                yield SegmentRead(seg.index, len(self.segments), seg.tokens, (seg.char_start, seg.char_end),
                                  seg.pages, self.window, self.doc_end, round(time.perf_counter() - t, 4))
                if mode != "wim":
                    continue
                if seg.index in skip:
                    self.margins[seg.index] = MarginNote(seg.index, skip[seg.index], None, None)
                    continue
                yield from self._write_margin(seg, query, classifier, stop,
                                              fed=(instruction, logits) if instruction else None)
                yield from self.runner.drain()  # a server backend's requests (prefix reuse) for this margin
        except Stopped:
            self.cache.truncate(self.doc_end)
            yield self.stats("read", stopped=True)
            return
        yield self.stats("read")

    def _prefill_segment(self, seg: Segment, window: Window, stop, then: list[int] = ()):
        """Feed one segment into the cache, which holds `window`, and note where it ends. `then`: the margin
        instruction, fed in the segment's last pass (it is cut off with the note); returns the logits after it."""
        with self.engine.lock:
            logits = self.runner.prefill(self.doc.segment_ids(seg), self.cache, stop, then=then)
        self.document_tokens_prefilled += seg.tokens
        if seg.index not in self.read_segments:
            self.read_segments.append(seg.index)
        self.doc_end = window.boundaries[seg.index] = window.doc_end = self.cache.length - len(then)
        return logits

    # ---- margins for a new question, from the cache ---------------------------------------------------
    def remargin(self, query: str, stop: threading.Event | None = None) -> Iterator[Event]:
        """Margins for a *new* question at every segment boundary, without re-reading the document.

        Causal attention makes the cache after segments 0..i the first part of the cache after all of them.
        So the new instruction and note for boundary i are written in spare room after the document, with
        positions that continue from boundary i, and an explicit mask that lets them see the cache up to
        boundary i and themselves only. They are cut off afterwards, as usual.

        A multi-window reading does this in each window's kept cache in turn (the last window last, so the
        cache ends as it was). What "equal to a fresh read" means there: window 0 starts with the plain
        instructions, so its margins equal a fresh read with the new question. A later window starts with the
        margins *the first question* found relevant, and those stay: its new margins equal a fresh read
        whose window prefixes are the same (a fresh read with the new question would carry the new
        question's margins there, and to get those the later windows would have to be read again). A window
        whose cache could not be kept is read again, with a Notice."""
        if self.settings.mode != "wim":
            raise RuntimeError("New-question margins need a wim reading; re-read.")
        if self.multiwindow and self.settings.window == "sliding":
            # Evicted segments are gone from the cache and were never kept: only a new read can see them.
            yield Notice("A sliding-cache reading keeps no earlier windows: the text is read again for the new "
                         "question.")
            yield from self.read(query, stop)
            return
        query = self.query = query.strip()
        self.new_phase()
        classifier = Classifier(self.settings.classifier, self.runner, self.layout, self.settings.embedding_threshold)
        windows = [w for w in self.windows if w.boundaries]
        try:
            if len(windows) > 1 and not windows[-1].kept and self.cache_window is windows[-1]:
                notice = self.keep_window(windows[-1])  # the last window's cache is about to be overwritten
                if notice:
                    yield notice
            for window in windows:
                if len(windows) > 1 and window.kept:
                    self.load_window(window)
                elif len(windows) > 1:
                    yield from self._reread_window(window, stop, query, classifier)
                    continue
                if self.notes.together_possible(self.cache):
                    yield from self.notes.write_together([self.segments[i] for i in window.segments],
                                                         window.boundaries, query, classifier, self.cache,
                                                         self.doc_end, self.limit, stop, self.keep_margin)
                    continue
                for index in window.segments:
                    visible = window.boundaries[index]
                    if hasattr(self.cache, "hide"):  # server backend: the prompt leaves out the later text
                        self.cache.hide(visible, self.doc_end)
                        visible = None
                    yield from self._write_margin(self.segments[index], query, classifier, stop, visible)
                    yield from self.runner.drain()
        except Stopped:
            if len(windows) > 1 and windows[-1].kept:
                self.load_window(windows[-1])  # answers read the last window (else answer() reads it again)
            yield self.stats("remargin", stopped=True)
            return
        yield self.stats("remargin")

    def _reread_window(self, window: Window, stop, query: str | None = None,
                       classifier: Classifier | None = None) -> Iterator[Event]:
        """Build a window's cache again from its prefix and segments, as they were read the first time: for
        remargin(), a window whose cache was not kept (writing `query`'s margins on the way, then trying to
        keep it); for last_window_in_cache(), the last window after a stopped remargin or a look-up answer."""
        span = f"segments {window.segments[0] + 1}-{window.segments[-1] + 1}"
        yield Notice(f"The cache of window {window.index + 1} was not kept: {span} are read again for the new "
                     "question." if query is not None else
                     f"The cache holds another part of the text (after a stopped follow-up or an answer's "
                     f"look-up): window {window.index + 1} ({span}) is read again.")
        self.cache.truncate(0)
        self.cache_window = window
        with self.engine.lock:
            self.runner.prefill(window.prefix_ids, self.cache, stop)
        self.doc_end = self.cache.length
        for index in window.segments:
            self._prefill_segment(self.segments[index], window, stop)
            if query is not None:
                yield from self._write_margin(self.segments[index], query, classifier, stop)
        if query is not None and window is not self.windows[-1]:
            self.keep_window(window)  # quietly: the notice above has said what happens

    def _new_window(self, first_segment: int, stop) -> Iterator[Event]:
        """Start a fresh window: instructions, the relevant margins so far (the only trace of the text that
        leaves the cache), then reading resumes at `first_segment`. The window left behind keeps its cache
        for follow-up questions where the budget allows."""
        notice = self.keep_window(self.windows[-1])
        if notice:
            yield notice
        notes = {i: self.margins[i].text for i in self.default_selection()}
        prefix, notes, _ = fit_notes(notes, self.note_scores(), lambda lines: self.layout.window_prefix(
            lines or "(none so far)"), len(self.layout.prefix) + self.limit // 4, in_cache=set(),
                                     label=lambda i: note_label(self.segments[i]))
        self.window += 1
        self.cache.truncate(0)
        with self.engine.lock:
            self.runner.prefill(prefix, self.cache, stop)
        self.doc_end = self.cache.length
        self.cache_window = self.window_store.start(self.window, prefix, self.doc_end)
        yield WindowStart(self.window, first_segment, len(notes), "the next segment does not fit in the window")

    def _slide(self, seg: Segment) -> WindowStart:
        """The sliding cache: evict the oldest segments after the instruction prefix (the attention sink)
        until `seg` fits, and re-rotate the keys that stay so their positions follow on from the prefix:
        positions never pass the window, and no segment is read twice."""
        window = self.windows[-1]
        sink = len(window.prefix_ids)
        gone, count = [], 0
        for index, end in window.boundaries.items():
            if gone and self.cache.length - count + seg.tokens + self.window_reserve <= self.limit:
                break
            gone.append(index)
            count = end - sink
        self.cache.evict(sink, count, self.rotate)
        window.boundaries = {i: end - count for i, end in window.boundaries.items() if i not in gone}
        self.doc_end = window.doc_end = self.cache.length
        self.window += 1
        return WindowStart(self.window, seg.index, 0, f"sliding: segment(s) {gone[0] + 1}-{gone[-1] + 1} "
                                                      f"({count:,} tokens) left the cache")

    # ---- saving a finished reading for another process (engine/saved.py) --------------------------------
    def fingerprint(self) -> str:
        return saved.fingerprint(self)

    def save(self, folder: str | os.PathLike, max_bytes: int | None = None) -> None:
        saved.save(self, folder, self.last_window_in_cache, max_bytes)

    def restore(self, folder: str | os.PathLike) -> bool:
        return saved.restore(self, folder)

    def restore_notes(self, notes: list[MarginNote]) -> None:
        saved.restore_notes(self, notes)

    def _write_margin(self, seg: Segment, query: str, classifier: Classifier, stop, visible: int | None = None,
                      fed: tuple[list[int], object] | None = None) -> Iterator[Event]:
        """The margin after `seg` (engine/margin_writing.py), from this reading's cache, kept in `margins`."""
        yield from self.notes.write(seg, query, classifier, self.cache, self.doc_end, stop, self.keep_margin,
                                    visible, fed)

    # ---- answering -----------------------------------------------------------------------------------
    def answer(self, query: str, margins: list[int] | dict[int, str] | None = None,
               stop: threading.Event | None = None, plain: bool = False, template: str | None = None
               ) -> Iterator[Event]:
        """Answer from the cache (engine/answering.py): what it holds of the text, then the chosen margins,
        then the question.

        `margins`: the human-in-the-loop override, a list of segment indexes (texts from this reading) or a
        dict index -> text (margins restored from storage). None: the classifier's selection.
        `plain`: answer as plain reading does (the question straight after the document, no margins). Inside
        one window a wim reading's cache at the document's end is plain reading's cache (the notes were cut
        off), so one read can answer both ways. `template`: see Answering.answer."""
        yield from self.answering.answer(query, margins, stop, plain, template)

    def last_window_in_cache(self, stop: threading.Event | None = None) -> Iterator[Event]:
        """Make the cache hold the last window again (after a look-up answer or a remargin left another there)."""
        if not self.windows:
            raise RuntimeError("This reading holds its notes but not its text (restore_notes): only an answer "
                               "that re-reads its notes' passages can be given without reading it again.")
        last = self.windows[-1]
        if self.cache_window is last:
            return
        if last.kept:
            self.load_window(last)
        else:
            yield from self._reread_window(last, stop)
