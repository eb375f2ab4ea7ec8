"""app/web.py's bookkeeping of what each tab shows (no server needed: requests are stand-ins with a hash)."""
from __future__ import annotations

from types import SimpleNamespace

from app.web import Viewing


def tab(name: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=name)


def test_a_pick_and_its_echo_open_the_session_once():
    viewing = Viewing()
    one, two = tab("one"), tab("two")
    assert viewing.first_pick(one, "A")
    viewing.show(one, "A")
    assert not viewing.first_pick(one, "A")  # Gradio's Dropdown fires `input` again on the blur after a pick
    assert viewing.first_pick(two, "A")      # another tab's pick of the same session is its own
    assert viewing.first_pick(one, "B")      # another session: a pick
    viewing.show(one, "B")
    assert viewing.first_pick(one, "A")      # back to A at once: a pick, not an echo of the first


def test_shown_by_other_means_then_picked_is_a_pick():
    viewing = Viewing()
    one = tab("one")
    assert viewing.first_pick(one, "A")
    viewing.show(one, "A")
    viewing.show(one, "new")                 # Read (or the library) shows another session
    assert viewing.first_pick(one, "A")      # picking A again within the echo window opens it


def test_echo_window_passes(monkeypatch):
    viewing = Viewing()
    one = tab("one")
    assert viewing.first_pick(one, "A")
    viewing.show(one, "A")
    monkeypatch.setattr(Viewing, "ECHO_S", 0.0)
    assert viewing.first_pick(one, "A")      # later: the reader opens it again on purpose


def test_showing_and_close():
    viewing = Viewing()
    one = tab("one")
    assert viewing.showing(one, "A") == "A"   # a tab not seen yet: whatever is asked
    assert viewing.showing(None, "A") == "A"  # the API
    viewing.show(one, "B")
    assert viewing.showing(one, "A") == "B"
    viewing.show(one, None)                   # a blank screen (its last session deleted)
    assert viewing.showing(one, "A") is None
    viewing.close(one)
    assert viewing.showing(one, "A") == "A"
