"""A document's segmentation for the loaded model, made once and shared by everything that needs it: the document
card, the new reading's checks, the panel's map, a passage, and the engine job itself (handed the segments, it
does not segment again)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from engine import Engine, Settings
from engine.segment import SegmentedText, segment


@dataclass(frozen=True)
class Layout:
    """How a document would be read under some settings: its tokens and segments, or why it cannot be."""
    tokens: int | None
    segments: int | None
    note: str = ""     # e.g. "read in 3 windows"
    problem: str = ""  # e.g. DocumentTooLong's message


class Layouts:
    """Segmentations (a novel's takes seconds: 3.2 s for pg1342 here) and layouts, the most recently used kept."""

    def __init__(self, engine: Engine, most: int = 32):
        self.engine = engine
        self.most = most
        self._segmented: OrderedDict[tuple, SegmentedText] = OrderedDict()
        self._layouts: OrderedDict[tuple, Layout] = OrderedDict()
        self._lock = threading.Lock()

    def use(self, engine: Engine) -> None:
        """Another model is loaded: its tokens are not the old one's."""
        with self._lock:
            self.engine = engine
            self._segmented.clear()
            self._layouts.clear()

    def segmented(self, doc: dict, settings: Settings) -> SegmentedText:
        """The stored document `doc` (Store.get_document) in segments of settings.segment_tokens."""
        key = (doc["sha256"], settings.segment_tokens)  # a stored document never changes
        found = self._get(self._segmented, key)
        if found is None:
            found = segment(doc["text"], self.engine.lm.tokenizer, settings.segment_tokens, doc["page_starts"])
            self._put(self._segmented, key, found)
        return found

    def open(self, doc: dict, settings: Settings):
        """A Reading of `doc` over its shared segmentation (raises DocumentTooLong / ValueError)."""
        return self.engine.open(doc["text"], settings, doc["page_starts"], segmented=self.segmented(doc, settings))

    def layout(self, doc: dict, settings: Settings) -> Layout:
        key = (doc["sha256"], settings)
        found = self._get(self._layouts, key)
        if found is None:
            try:
                reading = self.open(doc, settings)
                found = Layout(len(reading.doc.token_ids), len(reading.segments), reading.document_note() or "")
            except ValueError as e:  # DocumentTooLong included
                found = Layout(None, None, problem=str(e))
            self._put(self._layouts, key, found)
        return found

    def _get(self, cache: OrderedDict, key):
        with self._lock:
            found = cache.get(key)
            if found is not None:
                cache.move_to_end(key)
            return found

    def _put(self, cache: OrderedDict, key, value) -> None:
        with self._lock:
            cache[key] = value
            while len(cache) > self.most:
                cache.popitem(last=False)
