"""Marginalia's inference engine: Writing in the Margins over one preallocated KV cache.

Knows nothing of Gradio or SQLite: it turns (document, query, settings) into a stream of typed events.
"""
from .events import Answer, AnswerToken, Event, Margin, MarginToken, Notice, SegmentRead, Stats, WindowStart
from .plan import DocumentTooLong
from .settings import MODES, Settings
from .wim import Engine, Reading

__all__ = ["Answer", "AnswerToken", "DocumentTooLong", "Engine", "Event", "MODES", "Margin", "MarginToken", "Notice",
           "Reading", "SegmentRead", "Settings", "Stats", "WindowStart"]
