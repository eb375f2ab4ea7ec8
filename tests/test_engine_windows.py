"""Reading past the context window: every segment read once, every segment gets a margin, memory bounded."""
from __future__ import annotations

from engine import Answer, Margin, Notice, SegmentRead, Settings, WindowStart
from tests.conftest import shared


def test_text_of_three_windows_is_read_completely(engine):
    text = shared("books", "pg84.txt").read_text(encoding="utf-8")[30000:44000]
    settings = Settings(segment_tokens=150, margin_tokens=8, answer_tokens=8, classifier="embedding",
                        context_limit=1024)
    reading = engine.open(text, settings)
    assert len(reading.doc.token_ids) >= 3 * 1024 and reading.multiwindow
    events = list(reading.read("Who is Elizabeth?")) + list(reading.answer("Who is Elizabeth?"))
    segments = [e for e in events if isinstance(e, SegmentRead)]
    windows = [e for e in events if isinstance(e, WindowStart)]
    # Every character exactly once, in order; every segment has its margin.
    assert [s.index for s in segments] == list(range(len(reading.segments)))
    spans = [s.char_span for s in segments]
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert sorted(e.index for e in events if isinstance(e, Margin)) == list(range(len(reading.segments)))
    assert len(windows) >= 3 and [w.window for w in windows] == list(range(1, len(windows) + 1))
    # A window starts exactly where the next segment is; segments carry their window number.
    for w in windows:
        assert next(s for s in segments if s.index == w.first_segment).window == w.window
    assert any(isinstance(e, Notice) for e in events)
    # Bounded memory: the cache never held more than one window.
    assert max(s.cache_tokens for s in segments) <= 1024
    assert reading.cache.capacity == 1024
    assert [e for e in events if isinstance(e, Answer)][0].text


def test_plain_mode_past_the_window_keeps_both_ends(engine):
    text = shared("books", "pg84.txt").read_text(encoding="utf-8")[30000:44000]
    settings = Settings(mode="llm", segment_tokens=150, answer_tokens=8, context_limit=1024)
    reading = engine.open(text, settings)
    events = list(reading.read("Who is Elizabeth?"))
    read = [e.index for e in events if isinstance(e, SegmentRead)]
    n = len(reading.segments)
    assert read[0] == 0 and read[-1] == n - 1 and reading.skipped
    assert sorted(read + reading.skipped) == list(range(n))
    assert "skipped" in [e for e in events if isinstance(e, Notice)][0].text
