"""Reading past the context window: every segment read once, every segment gets a margin, memory bounded."""
from __future__ import annotations

import torch

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


def _alice(n_chars: int) -> str:
    text = shared("books", "pg11.txt").read_text(encoding="utf-8")
    return text[text.index("CHAPTER I.\nDown"):][:n_chars]


def test_new_question_margins_from_the_cache_equal_a_fresh_read(engine):
    settings = Settings(segment_tokens=300, margin_tokens=20, classifier="none")
    old, new = "Where does Alice fall?", "What is the name of Alice's cat?"
    fresh = [e.text for e in engine.open(_alice(3000), settings).read(new) if isinstance(e, Margin)]
    reading = engine.open(_alice(3000), settings)
    list(reading.read(old))
    doc_end, prefill_before = reading.doc_end, len(reading.doc.token_ids)
    events = list(reading.remargin(new))
    again = [e.text for e in events if isinstance(e, Margin)]
    assert again == fresh and len(again) == len(reading.segments)
    stats = events[-1]
    # Only instructions were prefilled: not one document token was read again.
    assert stats.prefill_tokens == len(again) * len(engine.layout.suffix("margin", query=new)) < prefill_before
    assert reading.cache.length == doc_end
    answer = [e for e in reading.answer(new) if isinstance(e, Answer)]
    assert answer and answer[0].query == new


def test_saved_cache_gives_bit_identical_logits(engine, tmp_path):
    from engine.cache import PreallocatedCache
    from engine.generate import Runner
    runner = Runner(engine.lm.model, engine.lm.tokenizer, engine.lm.device)
    ids = engine.lm.tokenizer(_alice(3000), add_special_tokens=False)["input_ids"]
    cache = PreallocatedCache(engine.lm.model.config.num_hidden_layers, 1024)
    runner.prefill(ids[:400], cache)
    cache.save(tmp_path / "window.safetensors")
    loaded = PreallocatedCache.load(tmp_path / "window.safetensors", 1024)
    assert loaded.length == 400
    assert torch.equal(runner.prefill(ids[400:500], cache), runner.prefill(ids[400:500], loaded))
