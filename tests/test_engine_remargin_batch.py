"""remargin() writes a window's margins together (engine/batch_scratch.py): the same notes as writing them one
after another, in far fewer forward passes."""
from __future__ import annotations

import pytest

from engine import Settings
from engine.classify import Classifier
from engine.events import Margin, MarginToken
from tests.conftest import shared

NEW = "What does Alice find in the hall?"


def _text() -> str:
    text = shared("books", "pg11.txt").read_text(encoding="utf-8")
    start = text.index("CHAPTER I.\nDown the Rabbit-Hole")
    return text[start:start + 4000]


def _count_passes(model):
    passes = []
    handle = model.register_forward_hook(lambda *_: passes.append(1))
    return passes, handle


@pytest.mark.parametrize("margins", ["extractive", "abstractive"])
def test_margins_together_equal_one_after_another(engine, margins):
    settings = Settings(segment_tokens=300, margin_tokens=24, classifier="none", margins=margins)
    reading = engine.open(_text(), settings)
    list(reading.read("Why does Alice follow the White Rabbit?"))
    window = reading.windows[-1]
    assert len(window.segments) >= 4 and reading.notes.together_possible(reading.cache)
    classifier = Classifier("none", reading.runner, reading.layout)
    passes, handle = _count_passes(engine.lm.model)
    try:
        one_by_one = [e for i in window.segments
                      for e in reading._write_margin(reading.segments[i], NEW, classifier, None,
                                                     window.boundaries[i])]
        sequential_passes = len(passes)
        passes.clear()
        together = list(reading.notes.write_together([reading.segments[i] for i in window.segments],
                                                     window.boundaries, NEW, classifier, reading.cache,
                                                     reading.doc_end, reading.limit, None,
                                                     reading.keep_margin))
    finally:
        handle.remove()
    assert reading.cache.length == reading.doc_end  # every row cut off again

    def notes(events):
        return [(e.index, e.text, e.spans, e.tokens, e.ending) for e in events if isinstance(e, Margin)]

    def streamed(events):
        return [(e.index, e.text) for e in events if isinstance(e, MarginToken)]

    assert notes(together) == notes(one_by_one) and len(notes(together)) == len(window.segments)
    assert streamed(together) == streamed(one_by_one)
    assert [e.score for e in together if isinstance(e, Margin)] == pytest.approx(
        [e.score for e in one_by_one if isinstance(e, Margin)], abs=1e-3)
    # One pass per step for every row: the longest note's steps, not the sum of all notes' steps.
    assert len(passes) * 2 <= sequential_passes, (len(passes), sequential_passes)
