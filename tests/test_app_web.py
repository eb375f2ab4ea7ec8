"""app/web.py's bookkeeping of what each tab shows (no server needed: requests are stand-ins with a hash)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

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


def test_the_owner_is_the_account_when_logged_in_else_the_browser():
    from gradio import OAuthProfile

    from app.web import api_owner, owner_of
    from app.errors import UserError
    alice = OAuthProfile({"name": "Alice", "preferred_username": "alice", "profile": "", "picture": ""})
    assert owner_of("b1", alice) == "hf:alice"
    assert owner_of("b1", None) == "b1"
    # The API has no login: an account's library is not reachable through it, whatever the client says.
    assert api_owner(" api-client ") == "api-client" and api_owner(None) == ""
    with pytest.raises(UserError):
        api_owner("hf:alice")


def test_the_login_is_shown_only_on_a_space_with_oauth(monkeypatch):
    from app.web import fake_login, login_available
    for name in ("SYSTEM", "SPACE_ID", "OAUTH_CLIENT_ID"):
        monkeypatch.delenv(name, raising=False)
    assert not login_available()  # off a Space: nothing changes
    monkeypatch.setenv("SYSTEM", "spaces")
    monkeypatch.setenv("SPACE_ID", "someone/marginalia")
    assert not login_available()  # a Space without hf_oauth: true
    monkeypatch.setenv("OAUTH_CLIENT_ID", "client")
    assert login_available()
    with pytest.raises(RuntimeError):  # the test mode's fixed login never runs on a Space
        fake_login("alice")
