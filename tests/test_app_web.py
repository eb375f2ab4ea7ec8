"""app/web.py's bookkeeping of what each tab shows (no server needed: requests are stand-ins with a hash)."""
from __future__ import annotations

from types import SimpleNamespace

from app.web import Viewing


def tab(name: str) -> SimpleNamespace:
    return SimpleNamespace(session_hash=name)


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
