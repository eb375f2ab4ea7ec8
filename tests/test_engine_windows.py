"""Reading past the context window: every segment read once, every segment gets a margin, memory bounded."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import Answer, Margin, Notice, SegmentRead, Settings, Stats, WindowStart
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


# ---- follow-up questions on a text read in several windows ---------------------------------------------------
# 46,080 bytes a token (30 layers x keys and values x 3 heads x 64 dims x fp32): a 20 MiB budget keeps window 0
# in memory and sends the later windows to disk, so both ways back are exercised.
WINDOWED = Settings(segment_tokens=100, margin_tokens=8, answer_tokens=8, classifier="none", context_limit=512,
                    window_cache_budget_bytes=20 * 2**20)
OLD, NEW = "Where does Alice fall?", "What is the name of Alice's cat?"


def _margin_by_plain_decoding(engine, cache, query: str, margin_tokens: int) -> str:
    """A margin written the plain way: instruction after the cache's end, greedy decoding, cut off."""
    from engine.generate import Runner
    runner = Runner(engine.lm.model, engine.lm.tokenizer, engine.lm.device)
    end = cache.length
    logits = runner.prefill(engine.layout.suffix("margin", query=query), cache)
    text = "".join(piece for _, piece in runner.decode(cache, logits, margin_tokens)).strip()
    cache.truncate(end)
    return text


@pytest.fixture(scope="module")
def windowed(engine):
    """A 3-window reading with question OLD, then remargin(NEW) from its kept window caches; and the margins
    NEW must get. Window 0 starts with the plain instructions: its margins must equal a fresh read with NEW.
    A later window starts with the margins OLD found relevant (that is what was read there); the follow-up
    keeps those prefixes, so its margins must equal a fresh prefill of that same prefix and those segments
    followed by NEW's instruction (not a fresh read with NEW, whose prefixes would carry NEW's margins)."""
    from engine.cache import PreallocatedCache
    text = _alice(3200)
    reading = engine.open(text, WINDOWED)
    read_events = list(reading.read(OLD))
    assert len(reading.windows) >= 3 and reading.multiwindow
    prefilled = reading.document_tokens_prefilled
    events = list(reading.remargin(NEW))
    # Window 0 from a fresh read with NEW, stopped where window 1 would begin.
    expected = {}
    for ev in engine.open(text, WINDOWED).read(NEW):
        if isinstance(ev, WindowStart):
            break
        if isinstance(ev, Margin):
            expected[ev.index] = ev.text
    assert sorted(expected) == reading.windows[0].segments
    cache = PreallocatedCache(engine.lm.model.config.num_hidden_layers, 512)
    from engine.generate import Runner
    runner = Runner(engine.lm.model, engine.lm.tokenizer, engine.lm.device)
    for window in reading.windows[1:]:
        assert window.prefix_ids != list(engine.layout.prefix)  # it carries OLD's margins
        cache.truncate(0)
        runner.prefill(window.prefix_ids, cache)
        for i in window.segments:
            runner.prefill(reading.doc.segment_ids(reading.segments[i]), cache)
            expected[i] = _margin_by_plain_decoding(engine, cache, NEW, WINDOWED.margin_tokens)
    return text, reading, read_events, prefilled, events, expected


def test_follow_up_on_a_multi_window_reading_reuses_every_window(engine, windowed):
    text, reading, read_events, prefilled, events, expected = windowed
    windows = reading.windows
    assert windows[0].tensors is not None and windows[1].tensors is None and windows[1].path  # memory, disk
    assert not any(isinstance(e, Notice) for e in read_events[1:])  # every window was kept
    again = {e.index: e.text for e in events if isinstance(e, Margin)}
    assert again == expected and sorted(again) == list(range(len(reading.segments)))
    # Not one segment was prefilled again: only NEW's margin instructions.
    stats = events[-1]
    assert isinstance(stats, Stats) and stats.phase == "remargin"
    assert stats.prefill_tokens == len(again) * len(engine.layout.suffix("margin", query=NEW))
    assert reading.document_tokens_prefilled == prefilled
    # The cache is back at the last window, ready for the answer.
    assert reading.doc_end == windows[-1].doc_end == reading.cache.length
    assert [e for e in reading.answer(NEW) if isinstance(e, Answer)][0].query == NEW


def test_follow_up_re_reads_a_window_it_could_not_keep(engine, windowed):
    text, kept, _, _, kept_events, expected = windowed
    reading = engine.open(text, replace(WINDOWED, window_cache_budget_bytes=0, window_cache_disk=False))
    read_events = list(reading.read(OLD))
    refused = [e.text for e in read_events if isinstance(e, Notice) and "not kept" in e.text]
    assert len(refused) == len(reading.windows) - 1 and "saving to disk is off" in refused[0]
    events = list(reading.remargin(NEW))
    notices = [e.text for e in events if isinstance(e, Notice)]
    assert len(notices) == len(reading.windows) + 1 and all("read again" in n for n in notices[1:])
    # The same margins as from kept caches, at the price of reading every window again.
    assert {e.index: e.text for e in events if isinstance(e, Margin)} == expected
    window_tokens = sum(len(w.prefix_ids) for w in reading.windows) + len(reading.doc.token_ids)
    assert events[-1].prefill_tokens == kept_events[-1].prefill_tokens + window_tokens
