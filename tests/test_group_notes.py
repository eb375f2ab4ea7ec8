"""Margins of margins (Settings.overflow "group"): kept notes that no longer fit their room are grouped, and a
note written over each group from the cache stands in for its members."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine import Answer, GroupMargin, Margin, Notice, Settings, WindowStart
from engine.answering import note_label
from engine.group_notes import GroupNote, carried
from engine.margins import Extractive, Scratch, pieces_of
from engine.windows import Windows
from tests.test_engine_windows import _alice

# A 512-token window gives the carried notes ~128 tokens and the answer ~60: a few 16-token notes, far fewer
# than the ~1,500-token text's 20 segments write (copy_threshold 0: every segment gets a copied note).
GROUPED = Settings(segment_tokens=100, margin_tokens=16, answer_tokens=16, classifier="none", context_limit=512,
                   copy_threshold=0.0, answer_style="notes", overflow="group")
QUERY = "Where does Alice fall?"


def test_group_notes_stand_in_for_their_members_widest_first_and_only_whole():
    notes = {i: f"note {i}" for i in range(8)}
    small, wide = GroupNote(0, 2, "over 0-2", [0, 1, 2]), GroupNote(0, 5, "over 0-5", [0, 1, 2, 3, 4, 5])
    items = carried(notes, {(0, 2): small, (0, 5): wide})
    assert items.groups == {0: wide} and sorted(items.notes) == [6, 7]
    assert items.lines() == {0: "over 0-5", 6: "note 6", 7: "note 7"} and items.members([0, 7]) == [0, 1, 2, 3, 4, 5, 7]
    # A reader set note 4 aside: the group over it no longer speaks for the notes kept, the smaller one does.
    del notes[4]
    items = carried(notes, {(0, 2): small, (0, 5): wide})
    assert items.groups == {0: small} and sorted(items.notes) == [3, 5, 6, 7] and items.last(0) == 2


@pytest.fixture(scope="module")
def grouped(engine):
    reading = engine.open(_alice(6000), GROUPED)
    return reading, list(reading.read(QUERY))


def test_overflowing_notes_are_grouped_into_notes_written_from_the_cache(engine, grouped):
    reading, events = grouped
    windows = [e for e in events if isinstance(e, WindowStart)]
    groups = [e for e in events if isinstance(e, GroupMargin)]
    assert len(windows) >= 3 and groups
    assert any(isinstance(e, Notice) and "notes written over groups" in e.text for e in events)
    # A group covers kept notes, in reading order.
    margins = {e.index: e.text for e in events if isinstance(e, Margin)}
    for g in groups:
        assert g.members == sorted(g.members) and g.first == g.members[0] and g.last == g.members[-1]
        assert all(margins[m] for m in g.members)
    # Every carried prefix fits the room a window gives its notes, and names the group notes by their span.
    room = len(engine.layout.prefix) + reading.limit // 4
    assert all(len(w.prefix_ids) <= room for w in reading.windows)
    first = groups[0]
    after = events.index(first)
    window = next(w for w in windows if events.index(w) > after)
    prefix = engine.lm.tokenizer.decode(reading.windows[window.window].prefix_ids)
    standing = [g for g in groups if events.index(g) < events.index(window)
                and not any(h is not g and set(g.members) < set(h.members) for h in groups
                            if events.index(h) < events.index(window))]
    assert any(f"[segments {g.first + 1}-{g.last + 1}] {g.text}" in prefix for g in standing)
    # Copied from the members' copied sentences, from the cache: the old window's cache (kept), the group
    # instruction after it, the same constrained copying over those sentences gives the same note.
    assert first.tier == 1
    spans = sorted({tuple(x) for m in first.members for x in reading.margins[m].spans})
    group = reading.group_writing.groups[first.first, first.last]
    assert group.spans and set(map(tuple, group.spans)) <= set(spans)
    assert first.text == " ".join(reading.doc.text[a:b] for a, b in group.spans)
    old = reading.windows[window.window - 1]
    cache = reading.runner.new_cache(reading.limit)
    Windows.load(old, cache, engine.lm.device)
    assert cache.length == old.doc_end
    lines = "\n".join(f"- [{note_label(reading.segments[m])}] {margins[m]}" for m in first.members)
    ids = engine.layout.suffix("group_note_extractive", query=QUERY, notes=lines,
                               span=f"segments {first.first + 1}-{first.last + 1}")
    pieces = [p for a, b in spans for p in pieces_of(reading.doc.text, a, b, engine.lm.tokenizer, 16)]
    writer = Extractive(engine.lm.tokenizer, reading.runner.stop_ids, 16, threshold=0.0)
    copied = writer.write(Scratch(reading.runner, cache, old.doc_end, None, None), ids, pieces)
    while True:
        try:
            next(copied)
        except StopIteration as done:
            assert done.value.text == first.text
            break
    # The instruction and note were cut off: the new window holds its prefix and segments only.
    new = reading.windows[window.window]
    assert new.doc_end == len(new.prefix_ids) + sum(reading.segments[i].tokens for i in new.segments)


def test_the_answer_takes_the_group_notes_and_names_their_members(engine, grouped):
    """With 20 notes kept and room for a few beside the answer, the answer's notes are the group notes; the
    segments it reports using include every member of a group note it was given, and only notes on segments
    whose text is in the cache give way."""
    reading, _ = grouped
    kept = reading.default_selection()
    events = list(reading.answer(QUERY))
    answer = next(e for e in events if isinstance(e, Answer))
    assert any(isinstance(e, Notice) and "notes written over groups" in e.text for e in events)
    in_last = set(reading.windows[-1].segments)
    assert set(kept) - in_last <= set(answer.margins_used)
    prompt = engine.lm.tokenizer.decode(reading.answering.window.ids)
    groups = reading.group_writing.groups.values()
    assert any(f"[segments {g.first + 1}-{g.last + 1}] {g.text}" in prompt for g in groups)
    assert len(reading.answering.window.ids) <= reading.limit - reading.doc_end - GROUPED.answer_tokens
    # Dropping, as before, when grouping is off: notes beyond those in the cache are left out, and said so.
    reading.settings = replace(GROUPED, overflow="drop")
    dropped = list(reading.answer(QUERY))
    reading.settings = GROUPED
    assert any(isinstance(e, Notice) and "did not fit" in e.text for e in dropped)
    assert not set(kept) - in_last <= set(next(e for e in dropped if isinstance(e, Answer)).margins_used)


def test_a_saved_reading_keeps_its_group_notes(engine, grouped, tmp_path):
    reading, _ = grouped
    reading.save(tmp_path / "saved")
    again = engine.open(reading.doc.text, GROUPED)
    assert again.restore(tmp_path / "saved")
    assert again.group_writing.groups == reading.group_writing.groups and again.group_writing.groups
