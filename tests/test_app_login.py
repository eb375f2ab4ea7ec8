"""The Space's login, in real Chromium: `python app.py --test-login alice` shows Hugging Face's login button, and
logging in (Gradio's own login routes and session cookie; only the profile is fixed, no Hub involved) makes the
library the account's: readings made while logged in as alice follow her to another browser, readings made
anonymously stay with their browser, and neither shows in the other's library. Off a Space, without the test
flag, there is no login button (tests/test_app_browser.py and the rest run that way).
"""
from __future__ import annotations

import pytest

from conftest import wait_ready
from test_app_browser import start_reading, wait_status

pytestmark = [pytest.mark.browser, pytest.mark.server]  # left out of `make quick`

SERVER_ARGS = ["--segment-tokens", "64", "--margin-tokens", "8", "--answer-tokens", "16", "--classifier", "none",
               "--test-login", "alice", "--no-warm-up"]
TEXT = "The meeting is on Tuesday in the library. Bring the signed forms and a pen. " * 4
ANON_Q, ALICE_Q = "Who reads this anonymously?", "Which day did alice ask about?"


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    path = tmp_path_factory.mktemp("uploads") / "meeting.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def open_app(browser, server):
    """A fresh browser profile (its own localStorage and cookies) on the app."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    page.goto(server.url)
    wait_ready(page)
    return ctx, page


def library(page, owner: str) -> str:
    """The library's text once the server has filled it in for this tab (the page's placeholder says no owner);
    `owner`: whose it must say it is, `account` or `browser`."""
    page.wait_for_selector("#library .mg-library[data-owner]", timeout=60_000)
    assert page.locator("#library .mg-library").get_attribute("data-owner") == owner
    return page.locator("#library .mg-library").inner_text()


def login_button(page):
    return page.locator("#login-btn")


def log_in_or_out(page) -> None:
    """Press the login button: Gradio sends the tab to /login/huggingface (or /logout) and back to the app."""
    before = login_button(page).inner_text()
    login_button(page).click()
    page.wait_for_function(f"() => document.querySelector('#login-btn') && "
                           f"document.querySelector('#login-btn').innerText.trim() !== {before.strip()!r}",
                           timeout=60_000)
    wait_ready(page)


def read_to_the_end(page, path, question: str) -> str:
    start_reading(page, path, question)
    wait_status(page, "done")
    page.wait_for_function(f"() => document.querySelector('#library').innerText.includes({question!r})",
                           timeout=60_000)
    return page.evaluate("() => document.querySelector('#margin-panel .mg-panel').dataset.session")


def test_a_logged_in_library_follows_the_account(chromium, server, doc):
    anon_ctx, anon = open_app(chromium, server)
    alice_ctx, alice = open_app(chromium, server)
    other_ctx, other = open_app(chromium, server)
    try:
        # Anonymous: the button offers a login; a reading is this browser's.
        assert "Sign in with Hugging Face" in login_button(anon).inner_text()
        read_to_the_end(anon, doc, ANON_Q)

        # Another browser logs in as alice: her library, empty, without the anonymous reading.
        assert ANON_Q not in library(alice, "browser")
        log_in_or_out(alice)
        assert "alice" in login_button(alice).inner_text()  # "Logout (alice)"
        assert "Signed in as alice" in library(alice, "account") and ANON_Q not in library(alice, "account")
        alice_session = read_to_the_end(alice, doc, ALICE_Q)
        assert ANON_Q not in library(alice, "account")

        # The anonymous browser, reloaded, still lists only its own reading.
        anon.reload()
        wait_ready(anon)
        shown = library(anon, "browser")
        assert ANON_Q in shown and ALICE_Q not in shown

        # A third browser: anonymous, it sees neither; logged in as alice, it sees hers (and opens on it).
        shown = library(other, "browser")
        assert ANON_Q not in shown and ALICE_Q not in shown
        log_in_or_out(other)
        shown = library(other, "account")
        assert ALICE_Q in shown and ANON_Q not in shown
        assert other.evaluate("() => document.querySelector('#margin-panel .mg-panel').dataset.session") \
            == alice_session
        # Logged out again: back to that browser's own (empty) library.
        log_in_or_out(other)
        assert "Sign in with Hugging Face" in login_button(other).inner_text()
        shown = library(other, "browser")
        assert ALICE_Q not in shown and ANON_Q not in shown
    finally:
        for ctx in (anon_ctx, alice_ctx, other_ctx):
            ctx.close()


def test_the_api_cannot_act_as_an_account(server, doc):
    from gradio_client import Client, handle_file
    client = Client(server.url, verbose=False)
    with pytest.raises(Exception, match="only open to its login"):
        client.predict(handle_file(str(doc)), ALICE_Q, 64, 8, 8, "none", "hf:alice", api_name="/read")
