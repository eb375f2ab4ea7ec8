"""Segmentation: lossless, sentence-aware, within budget."""
from __future__ import annotations

import pytest

from engine.segment import segment
from tests.conftest import shared


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    from engine.model import convert_embedded
    return AutoTokenizer.from_pretrained(convert_embedded())


def _check(text, doc, budget):
    assert "".join(doc.segment_text(s) for s in doc.segments) == text
    assert [t for s in doc.segments for t in doc.segment_ids(s)] == doc.token_ids
    for a, b in zip(doc.segments, doc.segments[1:]):
        assert a.char_end == b.char_start and a.token_end == b.token_start
    assert all(0 < s.tokens <= budget for s in doc.segments)


@pytest.mark.parametrize("name", ["pg11.txt", "pg84.txt", "pg1342.txt", "pg1661.txt",
                                  "pg1952_yellow_wallpaper_with_pg_header.txt"])
def test_lossless_on_books(tokenizer, name):
    text = shared("books", name).read_text(encoding="utf-8")
    doc = segment(text, tokenizer, 1024)
    _check(text, doc, 1024)
    # Sentence-aware: every cut but the last follows a sentence end or a paragraph break.
    ends = 0
    for s in doc.segments[:-1]:
        tail = text[:s.char_end].rstrip(" \t\"'”’)]")
        ends += tail.endswith((".", "!", "?", "…")) or text[s.char_end - 1:s.char_end + 1].count("\n") >= 1
    assert ends >= len(doc.segments[:-1]) * 0.95


def test_no_sentence_breaks(tokenizer):
    text = "word " * 3000 + "x" * 4000
    doc = segment(text, tokenizer, 200)
    _check(text, doc, 200)
    assert len(doc.segments) > 10


def test_sentences_are_not_split_when_they_fit(tokenizer):
    text = " ".join(f"Sentence number {i} is short." for i in range(300))
    doc = segment(text, tokenizer, 64)
    _check(text, doc, 64)
    for s in doc.segments[:-1]:
        assert doc.segment_text(s).endswith("short.")


def test_multibyte_text_is_lossless(tokenizer):
    text = "日本語のテキスト。" * 300 + " Ünïcödé ✓ 🙂 " * 200
    doc = segment(text, tokenizer, 50)
    _check(text, doc, 50)


def test_pages_follow_page_starts(tokenizer):
    text = "".join(f"Page {p} text. " * 40 + "\n\n" for p in range(1, 6))
    page_starts = [i for i in range(len(text)) if text.startswith("Page", i) and (i == 0 or text[i - 2:i] == "\n\n")]
    doc = segment(text, tokenizer, 100, page_starts)
    assert doc.segments[0].pages[0] == 1 and doc.segments[-1].pages[1] == 5
    for s in doc.segments:
        first, last = s.pages
        assert first <= last
        assert f"Page {first} " in doc.segment_text(s)
