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
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from . import saved
from .answering import ANSWER_STYLES, Answering
from .cache import key_rotation
from .classify import Classifier, embed
from .events import Event, Notice, SegmentRead, Stats, WindowStart
from .generate import Meter, Stopped, peak_memory_bytes
from .group_notes import OVERFLOWS, GroupWriting
from .margin_writing import MarginNote, MarginWriting
from .margins import COPY_CHOICES, MARGIN_STYLES
from .model import LoadedModel, load_model, release_freed_memory
from .prompts import PromptLayout, fit_notes
from .segment import Segment, segment
from .windows import Window, Windows

MODES = ("wim", "llm", "rag")
WINDOWS = ("new", "sliding")


class DocumentTooLong(ValueError):
    """The text does not fit in the model's context window (or the configured budget)."""


@dataclass(frozen=True)
class Settings:
    mode: str = "wim"                  # wim | llm (plain long-context) | rag (top-k segments)
    segment_tokens: int = 1024         # target segment size, in the model's tokens
    margins: str = "extractive"        # extractive (copied sentences, constrained) | scored | abstractive
    margin_tokens: int = 96            # longest margin note
    answer_tokens: int = 128           # longest answer
    # Above 0, a WiM answer with notes first says in a sentence or two what the notes and the document say on the
    # question, then "Answer:" and the answer (engine/prompts/answer_reasoned.txt), with this much room for that
    # (at most a 16th of the window) beyond answer_tokens. Not the default: on the tuning seed at 16k it scored
    # 0.599 against 0.418, but four of its seven gains named the right answer beside wrong ones (docs/quality.md).
    reasoning_tokens: int = 0
    # An answer that begins to loop (a list come round to its first item again) is taken back to where the loop
    # began and goes on with the next-best token there, at most this many times; then it ends before the loop.
    answer_retries: int = 3
    # Which notes are kept: combined (MiniLM, or a note sure of itself) | margin (relevance from the note itself) |
    # llm | embedding | none. combined by measurement: on the tuning seed it answered better than margin at 16k
    # (0.646 against 0.468, 12 cases) and as well in three 8k windows; docs/quality.md.
    classifier: str = "combined"
    # An extractive note copies only where P(start a copy) / (P(copy) + P(NONE)) at its first step reaches this.
    copy_threshold: float = 0.5
    # Which sentence an extractive note copies: opening (every candidate's first tokens scored, the likeliest
    # copied) | token (token by token through the sentences' trie: drawn to common first words). docs/margins.md.
    copy_choice: str = "opening"
    # The notes kept so far ride in each margin's instruction (the latest that fit 192 tokens, or a 16th of a
    # smaller window), so that a sentence that matters only through an earlier note can be copied; margins are then
    # written one by one. Not the default: 0.402 against 0.436 at 16k on the reported seed (docs/margins.md).
    notes_so_far: bool = False
    embedding_threshold: float = 0.3
    rag_top_k: int = 3
    temperature: float = 0.0           # 0: greedy
    seed: int = 0
    context_limit: int | None = None   # tokens the cache may hold; default: the model's context window
    window: str = "new"                # past the window: new (fresh cache + margins) | sliding (evict, re-rotate)
    # A multi-window reading keeps each window's cache for follow-up questions: in memory up to this many
    # bytes, then on disk (safetensors, in a temporary folder removed with the reading) unless told not to.
    window_cache_budget_bytes: int = 512 * 2**20
    window_cache_disk: bool = True
    keep_windows: bool = True          # keep each window's cache for follow-ups (remargin); off: none kept
    # Past the window: lookup (the kept notes' passages re-read into the answer window, then the notes: up to a
    # window's worth of prefill for every answer) | notes (the last window, then the notes). lookup by measurement
    # on the tuning seed (24k tokens in 8k windows, 12 cases: 0.487 against 0.416); docs/quality.md. passages: the
    # look-up inside one window too (the document's other segments left out of the answer window); recall: inside
    # one window, the passages read again after the whole document. Neither above the default at 16k on the tuning
    # seed (docs/quality.md). filled: past the window, the look-up's passages and, in the room they leave, the
    # likeliest others (being measured: docs/quality.md).
    answer_style: str = "lookup"
    # Kept notes that no longer fit their room (carried into a new window, or beside an answer): drop (the
    # lowest-scored give way) | group (notes written over groups of them, engine/group_notes.py; not yet measured
    # better)
    overflow: str = "drop"

    def validate(self) -> "Settings":
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if self.window not in WINDOWS:
            raise ValueError(f"window must be one of {', '.join(WINDOWS)}")
        if self.answer_style not in ANSWER_STYLES:
            raise ValueError(f"answer_style must be one of {', '.join(ANSWER_STYLES)}")
        if self.overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOWS)}")
        if self.margins not in MARGIN_STYLES:
            raise ValueError(f"margins must be one of {', '.join(MARGIN_STYLES)}")
        if self.copy_choice not in COPY_CHOICES:
            raise ValueError(f"copy_choice must be one of {', '.join(COPY_CHOICES)}")
        if self.window_cache_budget_bytes < 0:
            raise ValueError("window_cache_budget_bytes must be ≥ 0")
        if self.segment_tokens < 32 or self.margin_tokens < 1 or self.answer_tokens < 1 or self.reasoning_tokens < 0:
            raise ValueError("segment_tokens must be ≥ 32, margin_tokens and answer_tokens ≥ 1, reasoning_tokens ≥ 0")
        if self.answer_retries < 0:
            raise ValueError("answer_retries must be ≥ 0")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def margin_prompt(self) -> str:
        """The instruction after each segment (engine/prompts/): copying asks for sentences or NONE."""
        return "margin" if self.margins == "abstractive" else "margin_extractive"


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

    def open(self, text: str, settings: Settings = Settings(), page_starts: list[int] | None = None) -> "Reading":
        return Reading(self, text, settings.validate(), page_starts)

    def run(self, text: str, query: str, settings: Settings = Settings(), page_starts=None,
            stop: threading.Event | None = None) -> Iterator[Event]:
        """Read, then answer with the classifier's selection: the whole pipeline as one event stream."""
        reading = self.open(text, settings, page_starts)
        yield from reading.read(query, stop)
        if not (stop and stop.is_set()):
            yield from reading.answer(query, stop=stop)


class Reading:
    """A document segmented for one model, with the KV cache that holds it."""

    def __init__(self, engine: Engine, text: str, settings: Settings, page_starts: list[int] | None):
        self.engine, self.settings = engine, settings
        lm = engine.lm
        self.limit = min(settings.context_limit or lm.context_length, lm.context_length)
        self.doc = segment(text, lm.tokenizer, settings.segment_tokens, page_starts)
        if not self.doc.segments:
            raise ValueError("The document has no text to read.")
        self.layout = engine.layout
        self.meter = Meter()
        self.runner = lm.runner(self.meter)
        self.cache = self.runner.new_cache(self.limit)
        self.margins: dict[int, MarginNote] = {}
        self.read_segments: list[int] = []   # segments in the cache, in order
        self.doc_end = 0                     # cache length at the end of the last segment read
        self.window = 0                      # index of the window being read (sliding: evictions so far)
        self.window_store = Windows(settings.window_cache_budget_bytes, settings.window_cache_disk,
                                    settings.keep_windows)
        self.cache_window: Window | None = None  # the window the cache holds (another one mid-remargin)
        self.document_tokens_prefilled = 0   # document tokens fed to the model over this reading's life
        self.query = ""
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.notes = MarginWriting(engine, settings, self.doc, self.runner, self.generator, self.notes_before,
                                   self.limit)
        self.group_writing = GroupWriting(engine, settings, self.doc, self.runner, self.generator)
        self.answering = Answering(self)
        self._plan_windows()

    @property
    def segments(self) -> list[Segment]:
        return self.doc.segments

    @property
    def windows(self) -> list[Window]:
        """Every window so far; the last one is in `self.cache`."""
        return self.window_store.all

    def _plan_windows(self) -> None:
        """Decide whether the text fits one window. If not: `wim` reads it in several windows (earlier text is
        carried by its margins), `llm` keeps the beginning and the end (the middle is skipped, as LongBench
        truncates), `rag` is unaffected (it reads only its top-k segments)."""
        s = self.settings
        self.margin_reserve = self.notes.instruction_reserve() + 64 + s.margin_tokens
        need = len(self.layout.prefix) + len(self.doc.token_ids) + self.margin_reserve
        self.multiwindow = need > self.limit
        # In a multi-window reading the last window must leave room for the answer's notes and the answer.
        self.answer_reserve = s.answer_tokens + self.limit // 8 + 64
        self.window_reserve = max(self.margin_reserve, self.answer_reserve if self.multiwindow else 0)
        if s.window == "sliding":
            if not hasattr(self.cache, "evict"):
                raise ValueError("The sliding cache needs the preallocated cache; this model uses another.")
            self.rotate = key_rotation(self.engine.lm.model)
        largest = max(seg.tokens for seg in self.segments)
        if len(self.layout.prefix) + self.limit // 4 + largest + self.window_reserve > self.limit:
            raise DocumentTooLong(
                f"Segments of {largest:,} tokens do not fit in a {self.limit:,}-token window next to the "
                "instructions and notes: choose a smaller segment size.")
        self.skipped: list[int] = []
        if self.multiwindow and s.mode == "llm":
            budget = self.limit - len(self.layout.prefix) - self.answer_reserve
            n, keep, used = len(self.segments), set(), 0
            for i in dict.fromkeys(j for pair in zip(range(n), reversed(range(n))) for j in pair):
                if used + self.segments[i].tokens > budget:  # 0, n-1, 1, n-2, ...: both ends, inwards
                    break
                keep.add(i)
                used += self.segments[i].tokens
            self.skipped = [i for i in range(len(self.segments)) if i not in keep]

    def document_note(self) -> str | None:
        """What the user should know about how this text will be read, if anything."""
        if self.settings.mode == "llm" and self.skipped:
            return (f"Plain long-context reading: the text is {len(self.doc.token_ids):,} tokens but the window "
                    f"holds {self.limit:,}; segments {self.skipped[0] + 1}-{self.skipped[-1] + 1} in the middle "
                    "are skipped.")
        if self.multiwindow and self.settings.mode == "wim":
            return (f"The text is {len(self.doc.token_ids):,} tokens, more than the {self.limit:,}-token window: it "
                    "is read in several windows, and each new window carries the earlier parts as margin notes.")
        return None

    # ---- reading -------------------------------------------------------------------------------------
    def read(self, query: str, stop: threading.Event | None = None, skip: dict[int, str] | None = None
             ) -> Iterator[Event]:
        """Prefill every segment; in `wim` mode write a margin after each. `skip` maps segment indexes to margins
        already written (a resumed reading): those segments are re-read into the cache, their margins kept."""
        query = self.query = query.strip()
        skip = skip or {}
        self._reset(Meter())
        mode = self.settings.mode
        classifier = Classifier(self.settings.classifier, self.runner, self.layout,
                                self.settings.embedding_threshold) if mode == "wim" else None
        chosen = self._rag_choice(query) if mode == "rag" else None
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
            yield self._stats("read", stopped=True)
            return
        yield self._stats("read")

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
        self.meter = self.runner.meter = Meter()
        classifier = Classifier(self.settings.classifier, self.runner, self.layout, self.settings.embedding_threshold)
        windows = [w for w in self.windows if w.boundaries]
        try:
            if len(windows) > 1 and not windows[-1].kept and self.cache_window is windows[-1]:
                notice = self._keep_window(windows[-1])  # the last window's cache is about to be overwritten
                if notice:
                    yield notice
            for window in windows:
                if len(windows) > 1 and window.kept:
                    self._load_window(window)
                elif len(windows) > 1:
                    yield from self._reread_window(window, stop, query, classifier)
                    continue
                if self.notes.together_possible(self.cache):
                    yield from self.notes.write_together([self.segments[i] for i in window.segments],
                                                         window.boundaries, query, classifier, self.cache,
                                                         self.doc_end, self.limit, stop, self._keep_margin)
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
                self._load_window(windows[-1])  # answers read the last window (else answer() reads it again)
            yield self._stats("remargin", stopped=True)
            return
        yield self._stats("remargin")

    def _reread_window(self, window: Window, stop, query: str | None = None,
                       classifier: Classifier | None = None) -> Iterator[Event]:
        """Build a window's cache again from its prefix and segments, as they were read the first time: for
        remargin(), a window whose cache was not kept (writing `query`'s margins on the way, then trying to
        keep it); for answer(), the last window when a stopped remargin left another one in the cache."""
        span = f"segments {window.segments[0] + 1}-{window.segments[-1] + 1}"
        yield Notice(f"The cache of window {window.index + 1} was not kept: {span} are read again for the new "
                     "question." if query is not None else
                     f"The cache holds another part of the text (after a stopped follow-up or an answer's "
                     f"look-up): window {window.index + 1} ({span}) is read again for the answer.")
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
            self._keep_window(window)  # quietly: the notice above has said what happens

    def _new_window(self, first_segment: int, stop) -> Iterator[Event]:
        """Start a fresh window: instructions, the relevant margins so far (the only trace of the text that
        leaves the cache), then reading resumes at `first_segment`. The window left behind keeps its cache
        for follow-up questions where the budget allows."""
        notice = self._keep_window(self.windows[-1])
        if notice:
            yield notice
        notes = {i: self.margins[i].text for i in self.default_selection()}
        build = lambda lines: self.layout.window_prefix(lines or "(none so far)")  # noqa: E731
        room = len(self.layout.prefix) + self.limit // 4
        items = yield from self.fitted_notes(notes, build, room, self.doc_end, stop, "the next window")
        prefix, notes, _ = fit_notes(items.lines(), self.item_scores(items), build, room, in_cache=set(),
                                     label=self.group_writing.label(items))
        self.window += 1
        self.cache.truncate(0)
        with self.engine.lock:
            self.runner.prefill(prefix, self.cache, stop)
        self.doc_end = self.cache.length
        self.cache_window = self.window_store.start(self.window, prefix, self.doc_end)
        yield WindowStart(self.window, first_segment, len(notes), "the next segment does not fit in the window")

    def fitted_notes(self, notes: dict[int, str], build, room: int, doc_end: int, stop, where: str):
        """`notes` as engine/group_notes.py's Carried items for fit_notes: grouped where they overflow `room`
        and Settings.overflow is `group` (GroupWriting.fitted), else each note an item of its own."""
        spans = {i: self.margins[i].spans for i in notes if i in self.margins}
        return (yield from self.group_writing.fitted(notes, spans, self.query, build, room, self.cache, doc_end,
                                                     stop, where))

    def item_scores(self, items) -> dict[int, float]:
        """The classifier's score of each item (a group note: its best member's), for fit_notes."""
        scores = self._note_scores()
        return {k: max(scores.get(m, 1.0) for m in items.members([k])) for k in items.lines()}

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

    # ---- window caches kept for follow-up questions ------------------------------------------------------
    def _keep_window(self, window: Window) -> Notice | None:
        return self.window_store.keep(window, self.cache, sliding=self.settings.window != "new")

    def _load_window(self, window: Window) -> None:
        Windows.load(window, self.cache, self.engine.lm.device)
        self.doc_end = window.doc_end
        self.cache_window = window

    # ---- saving a finished reading for another process (engine/saved.py) --------------------------------
    def fingerprint(self) -> str:
        return saved.fingerprint(self)

    def save(self, folder: str | os.PathLike, max_bytes: int | None = None) -> None:
        saved.save(self, folder, max_bytes)

    def restore(self, folder: str | os.PathLike) -> bool:
        return saved.restore(self, folder)

    def restore_notes(self, notes: list[MarginNote]) -> None:
        saved.restore_notes(self, notes)

    def _reset(self, meter: Meter) -> None:
        self.meter = self.runner.meter = meter
        self.cache.truncate(0)
        self.margins.clear()
        self.group_writing.groups.clear()
        self.read_segments.clear()
        self.doc_end = 0
        self.window = 0
        self.cache_window = None
        self.window_store.forget()

    def _write_margin(self, seg: Segment, query: str, classifier: Classifier, stop, visible: int | None = None,
                      fed: tuple[list[int], object] | None = None) -> Iterator[Event]:
        """The margin after `seg` (engine/margin_writing.py), from this reading's cache, kept in `margins`."""
        yield from self.notes.write(seg, query, classifier, self.cache, self.doc_end, stop, self._keep_margin,
                                    visible, fed)

    def _keep_margin(self, note: MarginNote) -> None:
        self.margins[note.index] = note

    def notes_before(self, index: int) -> list[str]:
        """The texts of the notes kept on segments before `index`, in text order (a margin's instruction
        carries them with Settings.notes_so_far). Margins are written in text order, so for a new question
        these are already its own."""
        return [m.text for i, m in sorted(self.margins.items()) if i < index and m.text and m.relevant is not False]

    def _rag_choice(self, query: str) -> set[int]:
        """Indexes of the top-k segments by MiniLM similarity to the query (the RAG baseline)."""
        texts = [self.doc.segment_text(s) for s in self.segments]
        vectors = embed([query, *texts], "cuda" if self.engine.lm.device.type == "cuda" else "cpu")
        scores = vectors[1:] @ vectors[0]
        k = min(self.settings.rag_top_k, len(texts))
        # Keep as many of the best as fit in the window.
        budget = self.limit - len(self.layout.prefix) - 256 - self.settings.answer_tokens
        chosen, used = set(), 0
        for i in torch.argsort(scores, descending=True).tolist()[:k]:
            if used + self.segments[i].tokens <= budget:
                chosen.add(i)
                used += self.segments[i].tokens
        return chosen

    # ---- answering -----------------------------------------------------------------------------------
    def default_selection(self) -> list[int]:
        """Margins the classifier kept (all of them when there is no classifier)."""
        return [i for i, m in sorted(self.margins.items())
                if m.text and (m.relevant if m.relevant is not None else True)]

    def answer(self, query: str, margins: list[int] | dict[int, str] | None = None,
               stop: threading.Event | None = None, plain: bool = False, template: str | None = None,
               style: str | None = None) -> Iterator[Event]:
        """Answer from the cache (engine/answering.py): what it holds of the text, then the chosen margins,
        then the question.

        `margins`: the human-in-the-loop override, a list of segment indexes (texts from this reading) or a
        dict index -> text (margins restored from storage). None: the classifier's selection.
        `plain`: answer as plain reading does (the question straight after the document, no margins). Inside
        one window a wim reading's cache at the document's end is plain reading's cache (the notes were cut
        off), so one read can answer both ways. `template`, `style`: see Answering.answer."""
        yield from self.answering.answer(query, margins, stop, plain, template, style)

    def last_window_in_cache(self, stop: threading.Event | None = None) -> Iterator[Event]:
        """Make the cache hold the last window again (after a look-up answer or a remargin left another there)."""
        if not self.windows:
            raise RuntimeError("This reading holds its notes but not its text (restore_notes): only an answer "
                               "that re-reads its notes' passages can be given without reading it again.")
        last = self.windows[-1]
        if self.cache_window is last:
            return
        if last.kept:
            self._load_window(last)
        else:
            yield from self._reread_window(last, stop)

    def _note_scores(self) -> dict[int, float]:
        """The classifier's score of each margin written (1.0 where it gave none)."""
        return {i: 1.0 if m.score is None else m.score for i, m in self.margins.items()}

    def _stats(self, phase: str, stopped: bool = False) -> Stats:
        """The phase's figures, at its end; what the phase freed goes back to the system first."""
        release_freed_memory()
        m = self.meter
        seconds = m.seconds
        tokens = m.prefill_tokens + m.decode_tokens
        return Stats(m.prefill_tokens, m.decode_tokens, round(seconds, 4),
                     round(tokens / seconds, 2) if seconds else 0.0, peak_memory_bytes(self.engine.lm.device),
                     round(m.prefill_seconds, 4), round(m.decode_seconds, 4), phase, self.cache.kind, stopped,
                     **m.server_fields())
