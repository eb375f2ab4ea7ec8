"""The WiM loop end to end on the real model: events, accounting, stop, follow-ups, baselines."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from engine import Answer, DocumentTooLong, Margin, MarginToken, SegmentRead, Settings, Stats
from tests.conftest import ROOT, shared


def _chapter(n_chars: int = 6000) -> str:
    text = shared("books", "pg11.txt").read_text(encoding="utf-8")
    start = text.index("CHAPTER I.\nDown the Rabbit-Hole")
    return text[start:start + n_chars]


SMALL = Settings(segment_tokens=300, margin_tokens=16, answer_tokens=16, classifier="embedding")


@pytest.mark.slow
def test_babilong_8k_end_to_end(engine):
    data = json.loads(shared("babilong", "babilong_8k.json").read_text())
    # Free-form margins and the YES/NO classifier (the paper's design; extractive notes: tests/test_margins.py).
    reading = engine.open(data["context"], Settings(segment_tokens=1024, margin_tokens=48, answer_tokens=24,
                                                    margins="abstractive", classifier="llm"))
    events = list(reading.read(data["query"])) + list(reading.answer(data["query"]))
    segments = [e for e in events if isinstance(e, SegmentRead)]
    margins = [e for e in events if isinstance(e, Margin)]
    answers = [e for e in events if isinstance(e, Answer)]
    stats = [e for e in events if isinstance(e, Stats)]
    n = len(reading.segments)
    assert n >= 7
    assert [s.index for s in segments] == [m.index for m in margins] == list(range(n))
    assert len(answers) == 1 and answers[0].text
    # Every margin event follows its segment event and its streamed tokens add up to its text.
    order = [(type(e).__name__, getattr(e, "index", None)) for e in events
             if isinstance(e, (SegmentRead, Margin))]
    assert order == [x for i in range(n) for x in (("SegmentRead", i), ("Margin", i))]
    for m in margins:
        streamed = "".join(e.text for e in events if isinstance(e, MarginToken) and e.index == m.index)
        # A note cut at a loop streamed the start of the repetition; the finished note leaves it out.
        assert streamed.strip().startswith(m.text) and 0 < m.tokens <= 48
        assert isinstance(m.relevant, bool) and 0.0 <= m.score <= 1.0
    # Token accounting: the document is prefilled once; each margin adds its instruction; the llm classifier
    # reads (query, margin) in its own scratch cache.
    read, answer = stats
    layout = engine.layout
    margin_suffix = len(layout.suffix("margin", query=data["query"].strip()))
    classify = sum(len(layout.standalone("classify", query=data["query"].strip(), margin=m.text)) for m in margins)
    assert read.prefill_tokens == len(layout.prefix) + len(reading.doc.token_ids) + n * margin_suffix + classify
    assert read.decode_tokens == sum(m.tokens for m in margins)
    assert read.phase == "read" and answer.phase == "answer" and read.cache == "preallocated"
    assert read.seconds > 0 and read.tokens_per_s > 0 and read.peak_memory > 0
    # The answer step prefills only the instruction (margins + question): never the document again.
    assert answer.prefill_tokens < 600
    assert reading.cache.length == reading.doc_end


def test_the_instruction_rides_in_its_segments_last_pass(engine):
    """The margin instruction is fed with the segment's last prefill pass rather than in a pass of its own:
    one forward pass fewer per margin, the same tokens metered, and the same notes (fp32) as feeding it
    separately; the cache ends at the document, and each segment event reports the document's end."""
    text = _chapter()
    query = "What does the White Rabbit take out of its pocket?"
    settings = Settings(segment_tokens=300, margin_tokens=16, answer_tokens=16)  # the defaults' copied notes
    runs = {}
    for folded in (True, False):
        reading = engine.open(text, settings)
        if not folded:
            reading.notes.folds_instruction = lambda: False
        passes = []
        forward = reading.runner.forward
        reading.runner.forward = lambda ids, *a, **k: passes.append(len(ids)) or forward(ids, *a, **k)
        events = list(reading.read(query))
        margins = [(e.index, e.text, e.spans, e.relevant) for e in events if isinstance(e, Margin)]
        scores = [e.score for e in events if isinstance(e, Margin)]
        stats = [e for e in events if isinstance(e, Stats)][0]
        segments = [e for e in events if isinstance(e, SegmentRead)]
        assert reading.cache.length == reading.doc_end
        assert [e.cache_tokens for e in segments] == [reading.windows[0].boundaries[e.index] for e in segments]
        runs[folded] = margins, scores, stats.prefill_tokens, passes, len(segments)
    (margins, scores, prefill, passes, n), (margins2, scores2, prefill2, passes2, n2) = runs[True], runs[False]
    assert n == n2 >= 4 and any(m[1] for m in margins)
    assert margins == margins2 and max(abs(a - b) for a, b in zip(scores, scores2)) < 1e-3
    assert prefill == prefill2
    assert len(passes) == len(passes2) - n


def test_stop_mid_margin_ends_within_one_forward(engine):
    # Free-form notes, decoded token by token (a stop inside an extractive note: tests/test_margins.py).
    reading = engine.open(_chapter(), replace(SMALL, margins="abstractive"))
    stop = threading.Event()
    events, after_stop = [], []
    for ev in reading.read("Where does Alice fall?", stop):
        (after_stop if stop.is_set() else events).append(ev)
        if isinstance(ev, MarginToken) and ev.index == 1 and sum(isinstance(e, MarginToken) and e.index == 1
                                                                  for e in events) == 2:
            stop.set()
            forwards_at_stop = reading.meter.prefill_tokens + reading.meter.decode_tokens
    # Nothing more is computed after the flag: the very next event is the closing, stopped Stats.
    assert len(after_stop) == 1 and isinstance(after_stop[0], Stats) and after_stop[0].stopped
    assert reading.meter.prefill_tokens + reading.meter.decode_tokens == forwards_at_stop
    assert [e.index for e in events if isinstance(e, Margin)] == [0]       # margin 0 intact, 1 not finished
    assert [e.index for e in events if isinstance(e, SegmentRead)] == [0, 1]
    assert reading.cache.length == reading.doc_end                        # the half margin is cut off
    # The reader may still answer from what was read.
    answer = [e for e in reading.answer("Where does Alice fall?") if isinstance(e, Answer)]
    assert answer and answer[0].margins_used in ([], [0])


def test_follow_up_reuses_cache_and_human_selection(engine):
    reading = engine.open(_chapter(), SMALL)
    list(reading.read("What does the White Rabbit take out of its pocket?"))
    doc_end = reading.doc_end
    first = list(reading.answer("What does the White Rabbit take out of its pocket?", margins=[1]))
    assert [e for e in first if isinstance(e, Answer)][0].margins_used == [1]
    follow = list(reading.answer("What is the name of Alice's cat?", margins={0: "Alice's cat is Dinah."}))
    ans = [e for e in follow if isinstance(e, Answer)][0]
    stats = [e for e in follow if isinstance(e, Stats)][0]
    assert ans.margins_used == [0] and ans.query == "What is the name of Alice's cat?"
    expected = len(engine.layout.suffix("answer", query="What is the name of Alice's cat?",
                                        margins="- [segment 1] Alice's cat is Dinah."))
    assert stats.prefill_tokens == expected                                # no document tokens re-read
    assert reading.cache.length == doc_end
    # With no note chosen, the answer prompt says so and lets the answer say the document does not say.
    none = list(reading.answer("What is the name of Alice's cat?", margins=[]))
    stats = [e for e in none if isinstance(e, Stats)][0]
    assert [e for e in none if isinstance(e, Answer)][0].margins_used == []
    assert reading.answering.window.ids == engine.layout.suffix("answer_no_notes", query="What is the name of Alice's cat?")
    assert stats.prefill_tokens == len(reading.answering.window.ids) and reading.cache.length == doc_end


def test_combined_classifier_keeps_what_minilm_or_the_note_itself_keeps(engine):
    """`combined`: a note is kept when MiniLM finds it similar enough to the question, or when its own relevance
    (the first step's P(copy) against P(nothing)) is at least COMBINED_RELEVANCE; scored by that relevance.
    Checked against MiniLM's similarity computed here, note by note."""
    from engine.classify import COMBINED_RELEVANCE, embed, says_nothing
    query = "What does the White Rabbit take out of its pocket?"
    reading = engine.open(_chapter(), replace(SMALL, classifier="combined"))
    margins = [e for e in reading.read(query) if isinstance(e, Margin)]
    written = [m for m in margins if not says_nothing(m.text)]
    assert written, "no note copied anything: nothing to check"
    for m in margins:
        if says_nothing(m.text):
            assert m.relevant is False
            continue
        q, v = embed([query, m.text])
        similar = float(q @ v) >= reading.settings.embedding_threshold
        assert m.relevant == (m.score >= COMBINED_RELEVANCE or similar), (m.text, m.score, float(q @ v))
    assert reading.default_selection() == [m.index for m in margins if m.relevant]


def test_resume_keeps_saved_margins(engine):
    reading = engine.open(_chapter(3000), SMALL)
    events = list(reading.read("Who is late?", skip={0: "saved margin zero"}))
    margins = [e for e in events if isinstance(e, Margin)]
    assert 0 not in [m.index for m in margins] and len(margins) == len(reading.segments) - 1
    assert reading.margins[0].text == "saved margin zero"


@pytest.mark.parametrize("mode", ["llm", "rag"])
def test_baseline_modes(engine, mode):
    settings = Settings(mode=mode, segment_tokens=300, answer_tokens=16, rag_top_k=2)
    events = list(engine.run(_chapter(), "What is the name of Alice's cat?", settings))
    assert not any(isinstance(e, Margin) for e in events)
    read = [e for e in events if isinstance(e, SegmentRead)]
    answer = [e for e in events if isinstance(e, Answer)]
    assert len(answer) == 1 and answer[0].margins_used == []
    n = len(engine.open(_chapter(), settings).segments)
    assert len(read) == (n if mode == "llm" else 2)


def test_segment_too_large_for_the_window_is_a_clear_error(engine):
    """A long text is read in several windows (tests/test_engine_windows.py); what cannot work is a segment
    that does not fit in one window beside the instructions and notes."""
    text = shared("books", "pg1342.txt").read_text(encoding="utf-8")
    with pytest.raises(DocumentTooLong, match=r"do not fit in a 8,192-token window.*smaller segment size"):
        engine.open(text, Settings(segment_tokens=7000))


@pytest.mark.slow
def test_cli_jsonl_and_error(tmp_path):
    path = tmp_path / "alice.txt"
    path.write_text(_chapter(2500), encoding="utf-8")
    cmd = [sys.executable, "-m", "engine", "read", str(path), "--query", "Who is late?", "--jsonl",
           "--segment-tokens", "300", "--margin-tokens", "8", "--answer-tokens", "8", "--classifier", "none"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("segment") == kinds.count("margin") >= 2
    assert kinds[-2:] == ["answer", "stats"] and "stats" in kinds[:-1]
    long = tmp_path / "long.txt"
    long.write_text(shared("books", "pg1342.txt").read_text(encoding="utf-8"), encoding="utf-8")
    bad = subprocess.run(cmd[:4] + [str(long), "--query", "Who?", "--segment-tokens", "7000"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "smaller segment size" in bad.stderr and "Traceback" not in bad.stderr
