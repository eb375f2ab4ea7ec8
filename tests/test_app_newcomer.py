"""What a newcomer sees with the app's defaults: "Try a sample" writes its first margin within seconds of the click.

`python app.py` with the embedded model and SQLite, driven in real Chromium.
"""
from __future__ import annotations

import time

SERVER_ARGS: list[str] = []  # the app's defaults (the model is the embedded one in tests: see conftest)
# "Try a sample": the first margin card is on screen within this long of the click (the README states it).
SAMPLE_FIRST_MARGIN_S = 30
SLOW = 600_000  # ms: a whole reading on a CPU shared with other work


def panel(page) -> dict:
    return page.evaluate("""() => { const p = document.querySelector('#margin-panel .mg-panel');
        return {status: p.dataset.status, session: p.dataset.session,
                meta: (p.querySelector('.mg-progress-meta') || {}).innerText || '',
                done: document.querySelectorAll('#margin-panel .mg-card[data-state="done"]').length}; }""")


def wait_cards(page, n: int, timeout: int = SLOW) -> None:
    page.wait_for_function(
        f"() => document.querySelectorAll('#margin-panel .mg-card[data-state=\"done\"]').length >= {n}",
        timeout=timeout)


def wait_done(page, timeout: int = SLOW) -> None:
    page.wait_for_function("() => document.querySelector('#margin-panel .mg-panel').dataset.status === 'done'",
                           timeout=timeout)


def test_try_a_sample_shows_a_margin_within_seconds(page, server, capsys):
    clicked = time.monotonic()
    page.click("#sample-btn")
    wait_cards(page, 1, timeout=SAMPLE_FIRST_MARGIN_S * 1000)
    first = time.monotonic() - clicked
    with capsys.disabled():
        print(f"\n[marginalia] Try a sample: first margin card {first:.1f} s after the click")
    assert "Alice" in page.inner_text("#doc-info")
    assert "White Rabbit" in page.input_value("#question textarea")
    wait_done(page)
    assert panel(page)["done"] >= 1
