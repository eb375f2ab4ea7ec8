"""Marginalia's inference engine: Writing in the Margins over one preallocated KV cache.

Knows nothing of Gradio or SQLite: it turns (document, query, settings) into a stream of typed events.
"""
from .events import (Answer, AnswerToken, Event, GroupMargin, Margin, MarginToken, Notice, SegmentRead, Stats,
                     WindowStart)
from .wim import MODES, DocumentTooLong, Engine, Reading, Settings

__all__ = ["Answer", "AnswerToken", "DocumentTooLong", "Engine", "Event", "GroupMargin", "MODES", "Margin",
           "MarginToken", "Notice", "Reading", "SegmentRead", "Settings", "Stats", "WindowStart"]
