"""What one reading holds, which its reading (engine/wim.py), its answers (engine/answering.py) and its saving
(engine/saved.py) share: the KV cache and where the document ends in it, the windows read so far, the margins
kept, and the meter of the phase under way."""
from __future__ import annotations

import torch

from .events import Notice, Stats
from .generate import Meter, peak_memory_bytes
from .margin_writing import MarginNote
from .model_files import release_freed_memory
from .windows import Window, Windows


class ReadingState:
    """One reading's cache and what it holds (engine/wim.py's Reading reads into it)."""

    def __init__(self, engine, settings, doc, limit: int):
        self.engine, self.settings, self.doc, self.limit = engine, settings, doc, limit
        self.layout = engine.layout
        self.meter = Meter()
        self.runner = engine.lm.runner(self.meter)
        self.cache = self.runner.new_cache(limit)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.margins: dict[int, MarginNote] = {}
        self.read_segments: list[int] = []   # segments in the cache, in order
        self.doc_end = 0                     # cache length at the end of the last segment read
        self.window = 0                      # index of the window being read (sliding: evictions so far)
        self.window_store = Windows(settings.window_cache_budget_bytes, settings.window_cache_disk,
                                    settings.keep_windows)
        self.cache_window: Window | None = None  # the window the cache holds (another one mid-remargin)
        self.document_tokens_prefilled = 0   # document tokens fed to the model over this reading's life
        self.multiwindow = False             # the text is read in several windows (engine/plan.py decides)
        self.query = ""

    @property
    def segments(self) -> list:
        return self.doc.segments

    @property
    def windows(self) -> list[Window]:
        """Every window so far; the last one is in `self.cache`."""
        return self.window_store.all

    def new_phase(self) -> None:
        """A phase (read, remargin, answer) begins: its own meter."""
        self.meter = self.runner.meter = Meter()

    def reset(self) -> None:
        """Empty: nothing read, no margin, no window (before a read, or before taking a saved one up)."""
        self.new_phase()
        self.cache.truncate(0)
        self.margins.clear()
        self.read_segments.clear()
        self.doc_end = 0
        self.window = 0
        self.cache_window = None
        self.window_store.forget()

    def keep_window(self, window: Window) -> Notice | None:
        """Keep the cache's window for follow-up questions (in memory or on disk, as the budget allows)."""
        return self.window_store.keep(window, self.cache, sliding=self.settings.window != "new")

    def load_window(self, window: Window) -> None:
        """Put a kept window back into the cache."""
        Windows.load(window, self.cache, self.engine.lm.device)
        self.doc_end = window.doc_end
        self.cache_window = window

    def keep_margin(self, note: MarginNote) -> None:
        self.margins[note.index] = note

    def default_selection(self) -> list[int]:
        """Margins the classifier kept (all of them when there is no classifier)."""
        return [i for i, m in sorted(self.margins.items())
                if m.text and (m.relevant if m.relevant is not None else True)]

    def note_scores(self) -> dict[int, float]:
        """The classifier's score of each margin written (1.0 where it gave none)."""
        return {i: 1.0 if m.score is None else m.score for i, m in self.margins.items()}

    def stats(self, phase: str, stopped: bool = False) -> Stats:
        """The phase's figures, at its end; what the phase freed goes back to the system first."""
        release_freed_memory()
        m = self.meter
        seconds = m.seconds
        tokens = m.prefill_tokens + m.decode_tokens
        return Stats(m.prefill_tokens, m.decode_tokens, round(seconds, 4),
                     round(tokens / seconds, 2) if seconds else 0.0, peak_memory_bytes(self.engine.lm.device),
                     round(m.prefill_seconds, 4), round(m.decode_seconds, 4), phase, self.cache.kind, stopped,
                     **m.server_fields())
