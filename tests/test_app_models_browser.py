"""The model picker in real Chromium: read with the embedded 135M, pick Qwen2.5 1.5B, see the old session refuse
a follow-up (it was read by another model), read the same text with the 1.5B and answer.

Needs the Qwen parts (make installs them). The 1.5B reads slowly on a CPU, so the text is short (~4 segments of
120 tokens) and margins and answer are a few tokens; MARGINALIA_SCREENSHOT=1 saves static/models.png.
"""
from __future__ import annotations

import os
import sqlite3

import pytest

from conftest import ROOT, AppServer, wait_ready
from engine import model as models
from test_app_browser import panel, start_reading, wait_status
from test_models import QUESTION, STORY

pytestmark = [pytest.mark.browser, pytest.mark.server, pytest.mark.qwen,
              pytest.mark.skipif(not models.qwen_installed(), reason="Qwen2.5 1.5B parts not installed")]
SLOW = 900_000  # ms: a 1.5B model on a shared 2-core CPU


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("marginalia-models")
    app = AppServer(data, "--segment-tokens", "120", "--margin-tokens", "8", "--answer-tokens", "16",
                    "--classifier", "embedding", "--no-warm-up").start()
    yield app
    app.stop()


def pick_model(page, label_part: str) -> None:
    page.click("#model-picker input")
    page.locator("ul[role=listbox] li", has_text=label_part).first.click()


def test_pick_the_1_5b_model_read_and_answer(chromium, server, tmp_path):
    story = tmp_path / "lighthouse.txt"
    story.write_text(STORY, encoding="utf-8")
    page = chromium.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.goto(server.url)
    wait_ready(page)
    assert "SmolLM2" in page.input_value("#model-picker input")
    page.click("#model-picker input")
    listed = page.locator("ul[role=listbox]").inner_text()
    assert "SmolLM2" in listed and "Qwen2.5-Coder-1.5B" in listed and "32,768-token window" in listed, listed
    page.keyboard.press("Escape")

    start_reading(page, story, QUESTION)  # with the embedded model
    wait_status(page, "done", timeout=SLOW)
    first = panel(page)["session"]

    pick_model(page, "Qwen2.5-Coder-1.5B")
    page.wait_for_function("() => document.querySelector('#mg-header').innerText.includes('Qwen2.5-Coder-1.5B')",
                           timeout=SLOW)
    assert "Qwen2.5-Coder-1.5B" in page.input_value("#model-picker input")
    # The 135M's session: a follow-up now says which model read it instead of mixing caches.
    page.click("#answer-btn")
    page.wait_for_function("() => document.querySelector('#notice').innerText.includes('was made with SmolLM2')",
                           timeout=60_000)

    start_reading(page, story, QUESTION)  # the same text, read by the 1.5B model
    wait_status(page, "done", timeout=SLOW)
    second = panel(page)
    assert second["session"] != first and second["done"] == second["total"] >= 3
    page.click("#answer-btn")
    page.wait_for_selector('#answers .mg-answer[data-state="done"]', timeout=SLOW)
    answer = page.locator("#answers .mg-answer").first.inner_text()
    assert "bakery" in answer.lower(), answer
    if os.environ.get("MARGINALIA_SCREENSHOT"):
        page.screenshot(path=str(ROOT / "static" / "models.png"), full_page=True)
    page.screenshot(path=str(server.data_dir.parent / "models.png"), full_page=True)
    with sqlite3.connect(server.data_dir / "marginalia.db") as conn:
        rows = dict(conn.execute("SELECT id, model FROM sessions").fetchall())
    assert rows[first] == models.EMBEDDED_NAME and rows[second["session"]] == models.QWEN_NAME
    page.context.close()
