"""Reading past the context window: every segment read once, every segment gets a margin, memory bounded."""
from __future__ import annotations

import copy
import threading
from dataclasses import replace

import pytest
import torch

from engine import Answer, Margin, Notice, SegmentRead, Settings, Stats, WindowStart
from tests.conftest import TOLERANCE, shared


def _read_past_three_windows(engine, text: str, settings: Settings, query: str):
    """Read and answer a text of at least 3 windows; check that every character was read exactly once, every
    segment has its margin, the windows follow each other and the cache never held more than one window."""
    limit = settings.context_limit
    reading = engine.open(text, settings)
    assert len(reading.doc.token_ids) >= 3 * limit and reading.multiwindow
    events = list(reading.read(query)) + list(reading.answer(query))
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
    assert max(s.cache_tokens for s in segments) <= limit
    assert reading.cache.capacity == limit
    assert [e for e in events if isinstance(e, Answer)][0].text
    return reading, events


def test_text_of_three_windows_is_read_completely(engine):
    text = shared("books", "pg84.txt").read_text(encoding="utf-8")[30000:44000]
    settings = Settings(segment_tokens=150, margin_tokens=8, answer_tokens=8, classifier="embedding",
                        context_limit=1024)
    _read_past_three_windows(engine, text, settings, "Who is Elizabeth?")


def test_sliding_cache_reads_three_windows_in_bounded_memory(engine):
    settings = Settings(segment_tokens=100, margin_tokens=6, answer_tokens=6, classifier="none",
                        context_limit=512, window="sliding")
    reading, events = _read_past_three_windows(engine, _alice(7000), settings, "Where does Alice fall?")
    slides = [e for e in events if isinstance(e, WindowStart)]
    assert all(e.reason.startswith("sliding") and e.carried_margins == 0 for e in slides)
    # One cache, nothing kept beside it; the instruction prefix (the attention sink) stayed at its place.
    assert len(reading.windows) == 1 and reading.window_store.kept_bytes == 0 and not reading.windows[0].kept
    # The cache ends with the most recent segments, each boundary where its tokens end.
    kept, n = reading.windows[0].segments, len(reading.segments)
    assert 0 < len(kept) < n and kept == list(range(n - len(kept), n))
    ends = [len(engine.layout.prefix) + sum(reading.segments[i].tokens for i in kept[:j + 1]) for j in range(len(kept))]
    assert list(reading.windows[0].boundaries.values()) == ends and reading.doc_end == ends[-1]


def test_re_positioned_keys_equal_keys_computed_at_the_new_positions(engine):
    """Tokens K cached at positions 100..299 (masked so they do not see the 100 tokens before them), then
    moved down by 100 slots and re-rotated, must equal K prefilled afresh at positions 0..199."""
    from engine.cache import PreallocatedCache, key_rotation
    from engine.generate import Runner
    lm = engine.lm
    runner = Runner(lm.model, lm.tokenizer, lm.device)
    ids = lm.tokenizer(_alice(3000), add_special_tokens=False)["input_ids"][:300]
    layers = lm.model.config.num_hidden_layers
    moved, fresh = PreallocatedCache(layers, 512), PreallocatedCache(layers, 512)
    runner.prefill(ids[:100], moved)
    mask = torch.full((200, 300), torch.finfo(torch.float32).min)
    mask[:, 100:] = torch.triu(mask[:, 100:], diagonal=1)  # causal among K, blind to the first 100
    runner.forward(ids[100:], moved, attention_mask=mask[None, None])
    moved.evict(0, 100, key_rotation(lm.model))
    runner.prefill(ids[100:], fresh)
    assert moved.length == fresh.length == 200
    worst = max((a.keys[:, :, :200] - b.keys[:, :, :200]).abs().max().item()
                for a, b in zip(moved.layers, fresh.layers))
    values = max((a.values[:, :, :200] - b.values[:, :, :200]).abs().max().item()
                 for a, b in zip(moved.layers, fresh.layers))
    assert worst < 1e-4 and values < 1e-4, (worst, values)
    # Without the re-rotation the keys would be far off: the check can fail.
    unrotated = PreallocatedCache(layers, 512)
    runner.prefill(ids[:100], unrotated)
    runner.forward(ids[100:], unrotated, attention_mask=mask[None, None])
    unrotated.evict(0, 100, lambda keys, delta: keys)
    assert (unrotated.layers[0].keys[:, :, :200] - fresh.layers[0].keys[:, :, :200]).abs().max() > 1e-2


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
    # Free-form notes, so the prefill accounting below is the instructions alone (an extractive note feeds the
    # sentences it copies as prefill: tests/test_margins.py checks its remargin).
    settings = Settings(segment_tokens=300, margin_tokens=20, classifier="none", margins="abstractive")
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
                    window_cache_budget_bytes=20 * 2**20, margins="abstractive")
OLD, NEW = "Where does Alice fall?", "What is the name of Alice's cat?"


def _margin_by_plain_decoding(engine, cache, query: str, margin_tokens: int) -> str:
    """A margin written the plain way: instruction after the cache's end, greedy decoding (stopped at a loop),
    cut off; a note that says there is nothing relevant is kept as no note."""
    from engine.classify import says_nothing
    from engine.generate import DecodeResult, Runner
    runner = Runner(engine.lm.model, engine.lm.tokenizer, engine.lm.device)
    end = cache.length
    logits = runner.prefill(engine.layout.suffix("margin", query=query), cache)
    result = DecodeResult()
    list(runner.decode(cache, logits, margin_tokens, result=result))
    cache.truncate(end)
    text = result.text.strip()
    return "" if says_nothing(text) else text


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


def test_the_last_window_is_read_again_after_a_stopped_follow_up(engine, windowed):
    """Stopping a follow-up whose windows were not kept leaves an earlier window in the cache: the next answer
    (past the window, from its notes' passages read again) answers as before, and the last window is built again
    (with a notice) where the reading needs it back (saving it, say)."""
    reading = engine.open(windowed[0], replace(WINDOWED, window_cache_budget_bytes=0, window_cache_disk=False))
    list(reading.read(OLD))
    last_window = {k: v.clone() for k, v in reading.cache.state().items()}
    first = next(e for e in reading.answer(OLD) if isinstance(e, Answer))
    notes = {i: reading.margins[i].text for i in first.margins_used}
    stop = threading.Event()
    for ev in reading.remargin(NEW, stop):
        if isinstance(ev, Margin):
            stop.set()  # in window 0, which remargin had to read again
    assert ev.stopped and reading.cache_window is reading.windows[0]
    assert next(e for e in reading.answer(OLD, margins=notes) if isinstance(e, Answer)).text == first.text
    events = list(reading.last_window_in_cache())
    assert any(isinstance(e, Notice) and "is read again" in e.text for e in events)
    # The last window again: the same keys and values, up to fp32 rounding (the first read fed each margin
    # instruction in its segment's last pass, a pass a few dozen rows longer than the re-read's).
    state = reading.cache.state()
    assert state.keys() == last_window.keys() and all(state[k].shape == last_window[k].shape for k in state)
    assert max((state[k] - last_window[k]).abs().max().item() for k in state) <= TOLERANCE["engine"]


def test_margins_that_do_not_fit_the_answer_give_way_in_cache_then_low_score_then_oldest(windowed):
    """A novel keeps ~130 margins and the answer has room for ~25. Those given up first: margins on segments
    still in the cache (the answer reads their text), then the lowest scores, then the earliest."""
    from engine.margin_writing import MarginNote
    from engine.answering import Answering
    reading = copy.copy(windowed[1])  # the margins below are this test's own
    reading.answering = Answering(reading, reading.last_window_in_cache)
    n = len(reading.segments)
    reading.margins = {i: MarginNote(i, "", True, 0.9 if i % 2 else 0.6) for i in range(n)}
    notes = {i: "Alice saw the White Rabbit run past her. " * 3 for i in range(n)}  # ~30 tokens: not all fit
    ids, used, dropped = reading.answering.notes_prompt(NEW, notes)
    assert used and dropped and sorted(used + dropped) == list(range(n)) and used == sorted(used)
    last = reading.windows[-1].segments
    order = last + [i for i in range(n) if i not in last and i % 2 == 0] + [i for i in range(n) if i not in last and i % 2]
    assert set(dropped) == set(order[:len(dropped)])
    assert len(ids) <= reading.limit - reading.doc_end - WINDOWED.answer_tokens


def test_saved_cache_under_a_byte_cap_keeps_the_newest_windows(engine, windowed, tmp_path):
    text, reading, _, _, _, expected = windowed
    reading.save(tmp_path / "all")
    files = {p.name: p.stat().st_size for p in (tmp_path / "all").glob("window-*.safetensors")}
    assert len(files) == len(reading.windows)
    last, before = (f"window-{w.index}.safetensors" for w in (reading.windows[-1], reading.windows[-2]))
    reading.save(tmp_path / "capped", max_bytes=files[last] + files[before] + 1)
    assert sorted(p.name for p in (tmp_path / "capped").glob("window-*.safetensors")) == sorted([last, before])
    # Reopened elsewhere: the windows left out are read again (with a notice each), the others are not.
    reopened = engine.open(text, WINDOWED)
    assert reopened.restore(tmp_path / "capped")
    # A setting that shapes only answers does not make the saved read another one; one that shapes the read does.
    assert engine.open(text, replace(WINDOWED, answer_retries=0)).restore(tmp_path / "capped")
    assert not engine.open(text, replace(WINDOWED, margin_tokens=WINDOWED.margin_tokens + 1)).restore(
        tmp_path / "capped")
    events = list(reopened.remargin(NEW))
    assert {e.index: e.text for e in events if isinstance(e, Margin)} == expected
    re_read = [e.text for e in events if isinstance(e, Notice) and "read again" in e.text]
    assert len(re_read) == len(reading.windows) - 2


def test_notes_taken_up_without_their_cache_give_the_answer_of_the_read_itself(engine):
    """Past the window, a reading's notes taken up without its cache (restore_notes: say, from a record of the
    read) give the same answer, token for token, as the reading that holds its cache (both re-read the notes'
    passages); inside one window, where the answer needs the text in the cache, it says so instead of answering
    from nothing."""
    text = _alice(3200)
    reading = engine.open(text, WINDOWED)
    list(reading.read(OLD))
    chosen = reading.default_selection()
    assert chosen and reading.multiwindow
    read = next(e for e in reading.answer(OLD, margins=chosen) if isinstance(e, Answer))
    notes_only = engine.open(text, WINDOWED)
    notes_only.restore_notes([copy.deepcopy(m) for m in reading.margins.values()])
    assert notes_only.cache.length == 0 and not notes_only.windows
    taken_up = next(e for e in notes_only.answer(OLD, margins=chosen) if isinstance(e, Answer))
    assert notes_only.answering.window.ids == reading.answering.window.ids
    assert (taken_up.text, taken_up.passages, taken_up.citations) == (read.text, read.passages, read.citations)
    one = engine.open(_alice(1600), replace(WINDOWED, context_limit=None))
    one.restore_notes([copy.deepcopy(m) for m in reading.margins.values() if m.index < len(one.segments)])
    with pytest.raises(RuntimeError, match="notes but not its text"):
        list(one.answer(OLD))


def test_past_the_window_the_answer_re_reads_the_kept_notes_passages(engine):
    """A 3-window reading answered with the look-up: the answer window holds the passages of the kept notes,
    re-read in document order (their token ids), then the notes in reading order and the question. The last
    window was kept first, so the reading puts it back as it left it (for saving, or a new question's margins)."""
    text = _alice(3200)
    reading = engine.open(text, WINDOWED)
    list(reading.read(OLD))
    assert len(reading.windows) >= 3 and reading.multiwindow
    kept = reading.default_selection()
    events = list(reading.answer(OLD))
    answer = next(e for e in events if isinstance(e, Answer))
    window = reading.answering.window
    assert window.passages and answer.passages == window.passages == sorted(window.passages)
    assert set(window.passages) <= set(kept)
    passages = [t for i in window.passages for t in reading.doc.segment_ids(reading.segments[i])]
    assert window.ids[:len(passages)] == passages
    assert reading.cache.length == len(engine.layout.prefix) + len(passages)  # prefix, passages; answer cut off
    after = engine.lm.tokenizer.decode(window.ids[len(passages):])
    at = [after.index(f"- [segment {i + 1}] {reading.margins[i].text}") for i in answer.margins_used]
    assert answer.margins_used and at == sorted(at) and after.rindex(OLD) > at[-1]
    if len(window.passages) < len(kept):
        assert any(isinstance(e, Notice) and "re-reads the passages" in e.text for e in events)
    assert list(reading.last_window_in_cache()) == []  # kept: loaded back, nothing read again
    assert reading.cache_window is reading.windows[-1]
    assert reading.cache.length == reading.doc_end == reading.windows[-1].doc_end


def test_past_the_window_with_no_note_kept_the_answer_re_reads_the_likeliest_passages(engine):
    """No note kept (the reader marked them all irrelevant, or every margin said nothing): past the window the
    answer window holds the passages of the segments the margins scored highest, in document order (their token
    ids), as many as fit (greedily, highest first), then the question; not the last window, which is only where
    the text happened to end."""
    text = _alice(3200)
    reading = engine.open(text, WINDOWED)
    list(reading.read(OLD))
    assert reading.multiwindow
    events = list(reading.answer(OLD, margins=[]))
    answer = next(e for e in events if isinstance(e, Answer))
    window = reading.answering.window
    scores = {i: m.score for i, m in reading.margins.items()}
    assert window.passages and answer.passages == window.passages == sorted(window.passages)
    assert max(scores, key=lambda i: (scores[i], -i)) in window.passages
    passages = [t for i in window.passages for t in reading.doc.segment_ids(reading.segments[i])]
    assert window.ids[:len(passages)] == passages
    assert OLD in engine.lm.tokenizer.decode(window.ids[len(passages):])
    # Greedy by score: a segment left out either scored below every passage re-read or did not fit beside them.
    room = reading.limit - len(engine.layout.prefix) - (len(window.ids) - len(passages)) - WINDOWED.answer_tokens
    used = sum(reading.segments[i].tokens for i in window.passages)
    lowest = min(scores[i] for i in window.passages)
    for i in set(scores) - set(window.passages):
        assert scores[i] <= lowest or reading.segments[i].tokens > room - used
    assert any(isinstance(e, Notice) and "No note was kept" in e.text for e in events)
    # Inside one window the document is in the cache: no passage is re-read for an answer without notes.
    one = engine.open(_alice(1600), replace(WINDOWED, context_limit=None))
    list(one.read(OLD))
    assert next(e for e in one.answer(OLD, margins=[]) if isinstance(e, Answer)).passages == []
