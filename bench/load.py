"""Many readers at once against one real `python app.py` on 127.0.0.1: `python -m bench.load` (`make load`).

API clients (gradio_client) and real browsers (Debian's Chromium through Playwright) each read a different
short document at the same time. Measured and checked:

- every reading completes, or is stopped by its owner (one API client cancels its job after its first margin);
- each sees only its own sessions: an API client asking /answer about another client's session id is refused,
  and each browser's library holds only its own readings;
- queue positions: the rank gradio_client reports while a job waits, the panel's "jobs ahead" line in browsers;
- while the engine is busy, a browser's library (reopening a reading: its Open button pressed -> the panel
  showing it, timed in the page) and a mark (click -> the mark committed in SQLite) answer within 0.5 s at the
  95th percentile; the same with the engine idle, as the baseline;
- two Opens in the library in quick succession (the first still pending) leave the panel on the last;
- `PRAGMA integrity_check` is ok afterwards.

    python -m bench.load                      # 8 API clients + 2 browsers (the full run)
    python -m bench.load --api 3 --browsers 1 # what tests/test_app_reliability.py runs
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import CHROMIUM, CHROMIUM_ARGS, SHARED, AppServer  # noqa: E402  (the tests' server helper)

# The 135M, named: the figures are the app's latency under many readers, comparable across sessions, and a
# reading must take seconds, not minutes, for the run to see many of them.
SERVER_ARGS = ["--model", "embedded", "--segment-tokens", "64", "--margin-tokens", "8", "--answer-tokens", "16",
               "--classifier", "none", "--no-warm-up"]
BOOKS = ["pg11.txt", "pg84.txt", "pg1342.txt", "pg1661.txt", "pg1952_yellow_wallpaper_with_pg_header.txt"]
LATENCY_TARGET_S = 0.5
IDLE_ROUNDS = 5  # reopen/mark rounds per browser once the engine is idle: the baseline for the busy figures
QUESTION = "Who is speaking, and where?"
FIRST_QUESTION = "What is the first thing said?"  # each browser's first reading, stopped at once


def documents(folder: Path, n: int, chars: int = 700) -> list[Path]:
    """n different short texts: slices of the shared books (never the same slice twice)."""
    out = []
    for i in range(n):
        text = (SHARED / "books" / BOOKS[i % len(BOOKS)]).read_text(encoding="utf-8")
        start = len(text) // 3 + (i // len(BOOKS)) * chars * 2
        path = folder / f"reader-{i:02d}.txt"
        path.write_text(f"Reader {i}. " + text[start:start + chars], encoding="utf-8")
        out.append(path)
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


# ---------------------------------------------------------------- API clients (threads)

def api_reader(url: str, index: int, path: Path, cancel: bool, out: dict) -> None:
    from gradio_client import Client, handle_file
    from gradio_client.utils import Status

    record = out[index] = {"owner": f"load-api-{index}", "ranks": [], "cancelled": cancel, "error": None}
    try:
        client = Client(url, verbose=False)
        job = client.submit(handle_file(str(path)), QUESTION, 64, 8, 16, "none", record["owner"], api_name="/read")
        started = time.monotonic()
        while not job.done():
            status = job.status()
            if status.code == Status.IN_QUEUE and status.rank is not None:
                record["ranks"].append(status.rank)
            outputs = job.outputs()
            if outputs:
                record["session_id"] = outputs[-1]["session_id"]
                if cancel and outputs[-1]["margins"]:
                    job.cancel()  # the owner stops its reading
                    break
            time.sleep(0.2)
        if not cancel:
            result = job.result(timeout=900)
            record.update(session_id=result["session_id"], status=result["status"],
                          read=result["segments_read"], total=result["segments_total"])
        record["seconds"] = time.monotonic() - started
        record["client"] = client
    except Exception as e:  # recorded and reported: one failing client must not hide the others' figures
        record["error"] = f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------- browsers (the main thread: Playwright sync)

def panel_state(page) -> dict:
    return page.evaluate("""() => { const p = document.querySelector('#margin-panel .mg-panel');
        return {status: p.dataset.status, session: p.dataset.session,
                text: (p.querySelector('.mg-status-text') || {}).innerText || '',
                done: document.querySelectorAll('#margin-panel .mg-card[data-state="done"], '
                      + '#margin-panel .mg-card[data-state="relevant"], '
                      + '#margin-panel .mg-card[data-state="irrelevant"]').length}; }""")


def browser_start(page, url: str, path: Path, question: str = QUESTION) -> dict:
    page.goto(url)
    page.wait_for_selector('#margin-panel .mg-panel[data-ready="1"]', timeout=120_000)
    page.set_input_files("#doc-file input[type=file]", str(path))
    page.wait_for_selector("#doc-info .mg-doc-meta", timeout=120_000)
    page.fill("#question textarea", question)
    before = panel_state(page)["session"]
    page.click("#read-btn")
    page.wait_for_function(f"() => document.querySelector('#margin-panel .mg-panel').dataset.session !== {before!r}",
                           timeout=120_000)
    return panel_state(page)


def open_button(page, session_id: str):
    """The Open button of a reading's row in the library."""
    return page.locator(f'#library .mg-reading[data-session="{session_id}"] button[data-action="open"]')


def showing(page, session_id: str, timeout_ms: int = 30_000) -> None:
    page.wait_for_function(
        f"() => document.querySelector('#margin-panel .mg-panel').dataset.session === {session_id!r}",
        timeout=timeout_ms)


# Timestamps taken in the page: when a reading's Open button in the library is pressed, and when the panel's
# session changes after it (a MutationObserver, so neither Playwright's polling nor its click are in the figure).
PICK_TIMING = """() => {
  if (window.mgPick) return;
  const t = window.mgPick = {at: null, shown: {}};
  document.addEventListener('pointerdown', (e) => {
    if (e.target.closest && e.target.closest('#library .mg-reading button[data-action=open]')) {
      t.at = performance.now(); t.shown = {}; }
  }, true);
  new MutationObserver(() => {
    const p = document.querySelector('#margin-panel .mg-panel');
    if (p && t.at !== null && !(p.dataset.session in t.shown)) t.shown[p.dataset.session] = performance.now();
  }).observe(document.body, {subtree: true, childList: true, attributes: true, attributeFilter: ['data-session']});
}"""


# Opens that did not reach the panel within 10 s and were pressed again. A press whose button the library
# re-renders between mouse-down and mouse-up (a reading's end refreshes it) makes no click at all.
REPEATED_OPENS: list[str] = []


def reopen(page, session_id: str, other: str) -> tuple[float, float]:
    """Open a reading from the library. Returns (press -> panel, click -> panel) in seconds: from pressing the
    reading's Open button to the panel showing it, timed in the page; and the reader's whole gesture, timed
    here (it adds Playwright's own waits for the button, and a second press if the first was lost: see
    REPEATED_OPENS). If the panel already shows the reading (nothing would change to time), `other` is opened
    first, untimed."""
    page.evaluate(PICK_TIMING)
    if panel_state(page)["session"] == session_id:
        open_button(page, other).click()
        page.wait_for_function("() => document.querySelector('#margin-panel .mg-panel').dataset.session "
                               f"!== {session_id!r}", timeout=30_000)
        time.sleep(0.3)
    started = time.monotonic()
    open_button(page, session_id).click()
    try:
        showing(page, session_id, timeout_ms=10_000)
    except Exception:  # Playwright's TimeoutError: the press was lost (counted and reported), so press again
        REPEATED_OPENS.append(session_id)
        open_button(page, session_id).click()
        showing(page, session_id)
    whole = time.monotonic() - started
    picked = page.evaluate(f"() => (window.mgPick.shown[{session_id!r}] - window.mgPick.at) / 1000")
    return picked, whole


def quick_picks(page, first: str, second: str, pairs: int = 3) -> tuple[int, list[dict]]:
    """Open one reading and at once the other (about 0.1 s apart, so the first is still pending), `pairs` times
    each way: the panel must end on the last one opened. Returns (pairs made, what the lost ones showed)."""
    lost = []
    for _ in range(pairs):
        for session_a, session_b in ((first, second), (second, first)):
            started = time.time()
            open_button(page, session_a).click()
            open_button(page, session_b).click()
            try:
                showing(page, session_b, timeout_ms=10_000)
                time.sleep(0.5)  # and it stays there
            except Exception:  # Playwright's TimeoutError: the last pick never reached the panel
                pass
            shown = panel_state(page)["session"]
            if shown != session_b:
                current = page.locator('#library .mg-reading[data-current="1"]')
                lost.append({"at": started, "picked": session_b, "panel": shown,
                             "library": current.first.get_attribute("data-session") if current.count() else None})
    return 2 * pairs, lost


def mark_latency(page, db: Path, session_id: str) -> float | None:
    """Flip the first finished card; seconds until SQLite holds the new mark."""
    card = page.locator("#margin-panel .mg-card[data-index]").filter(has=page.locator("button.mg-flip")).first
    if card.count() == 0:
        return None
    index = int(card.get_attribute("data-index"))
    flipped = "0" if card.get_attribute("data-effective") != "0" else "1"
    started = time.monotonic()
    card.locator(f'button.mg-flip[data-mark="{flipped}"]').click()
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        while time.monotonic() - started < 30:
            row = conn.execute("SELECT mark FROM margins WHERE session_id = ? AND segment_index = ?",
                               [session_id, index]).fetchone()
            if row and row[0] is not None and row[0] == int(flipped):
                return time.monotonic() - started
            time.sleep(0.01)
    return float("inf")


# ---------------------------------------------------------------- the run

def run(url: str, db: Path, folder: Path, api: int, browsers: int, deadline_s: float = 900,
        chromium=None) -> dict:
    """The load run against the app at `url`; `chromium`: a Playwright browser to use (else one is launched)."""
    if chromium is None:
        from playwright.sync_api import sync_playwright
        with sync_playwright() as p:
            launched = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                return run(url, db, folder, api, browsers, deadline_s, launched)
            finally:
                launched.close()

    docs = documents(folder, api + browsers)
    results: dict[int, dict] = {}
    threads = [threading.Thread(target=api_reader, args=(url, i, docs[i], i == api - 1 and api > 1, results),
                                daemon=True) for i in range(api)]
    started = time.monotonic()
    for t in threads:
        t.start()
    reopen_s, reopen_list_s, marks_s, queue_lines, browser_sessions = [], [], [], [], []
    contexts = [chromium.new_context(viewport={"width": 1300, "height": 900}) for _ in range(browsers)]
    pages = [c.new_page() for c in contexts]
    # Each browser: a first reading it stops at once (a second session to switch to), then its reading.
    for b, page in enumerate(pages):
        first = browser_start(page, url, docs[api + b], FIRST_QUESTION)
        page.click("#stop-btn")
        second = browser_start(page, url, docs[api + b])
        queue_lines.append(second["text"])
        browser_sessions.append((first["session"], second["session"]))
    # While the engine works through the queue: switch sessions and flip marks, over and over.
    busy = lambda: any(t.is_alive() for t in threads) or any(
        panel_state(pg)["status"] in ("queued", "reading") for pg in pages)
    while busy() and time.monotonic() - started < deadline_s:
        for page, (first, second) in zip(pages, browser_sessions):
            for session, other in ((first, second), (second, first)):
                picked, whole = reopen(page, session, other)
                reopen_s.append(picked)
                reopen_list_s.append(whole)
            latency = mark_latency(page, db, second)
            if latency is not None:
                marks_s.append(latency)
        time.sleep(0.2)
    browser_done = []
    for page, (first, second) in zip(pages, browser_sessions):
        page.wait_for_function("() => ['done', 'stopped'].includes("
                               "document.querySelector('#margin-panel .mg-panel').dataset.status)",
                               timeout=max(1, int((deadline_s - (time.monotonic() - started)) * 1000)))
        browser_done.append(panel_state(page)["status"])
    for t in threads:
        t.join(timeout=max(1, deadline_s - (time.monotonic() - started)))
    wall = time.monotonic() - started  # the readings' part; the idle rounds below are not in it
    # The same, with the engine idle: what the machine and the browser cost on their own.
    idle_reopen_s, idle_reopen_list_s, idle_marks_s = [], [], []
    for _ in range(IDLE_ROUNDS):
        for page, (first, second) in zip(pages, browser_sessions):
            for session, other in ((first, second), (second, first)):
                picked, whole = reopen(page, session, other)
                idle_reopen_s.append(picked)
                idle_reopen_list_s.append(whole)
            latency = mark_latency(page, db, second)
            if latency is not None:
                idle_marks_s.append(latency)
    quick = [quick_picks(page, first, second) for page, (first, second) in zip(pages, browser_sessions)]
    for i, page in enumerate(pages):
        # Each browser's library holds exactly its own two readings.
        browser_done[i] = (browser_done[i], page.locator("#library .mg-reading").count())
    for c in contexts:
        c.close()

    # Isolation through the API: client i asks about client i+1's session with its own owner id.
    refused = 0
    asked = 0
    api_ok = [r for r in results.values() if not r["error"] and r.get("session_id")]
    for a, b in zip(api_ok, api_ok[1:] + api_ok[:1]):
        if a is b:
            continue
        asked += 1
        try:
            a["client"].predict(a["owner"], b["session_id"], "Who?", api_name="/answer")
        except Exception as e:
            refused += "No reading is open" in str(e)
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        stored = {sid: status for sid, status in conn.execute("SELECT id, status FROM sessions")}
        owners = {sid: owner for sid, owner in conn.execute("SELECT id, owner FROM sessions")}
    for r in results.values():
        r.pop("client", None)
        if r.get("session_id"):
            r["stored_status"] = stored.get(r["session_id"])
            r["stored_owner_ok"] = owners.get(r["session_id"]) == r["owner"]
    return {
        "api_clients": api, "browsers": browsers, "wall_s": round(wall, 1),
        "api": results, "browser_end": browser_done, "browser_queue_lines": queue_lines,
        "max_api_rank": max((max(r["ranks"]) for r in results.values() if r["ranks"]), default=None),
        "reopen_s": [round(x, 3) for x in reopen_s], "marks_s": [round(x, 3) for x in marks_s],
        "reopen_p95_s": p95(reopen_s), "marks_p95_s": p95(marks_s),
        "idle_reopen_s": [round(x, 3) for x in idle_reopen_s], "idle_marks_s": [round(x, 3) for x in idle_marks_s],
        "idle_reopen_p95_s": p95(idle_reopen_s), "idle_marks_p95_s": p95(idle_marks_s),
        "reopen_list_s": [round(x, 3) for x in reopen_list_s], "reopen_list_p95_s": p95(reopen_list_s),
        "idle_reopen_list_s": [round(x, 3) for x in idle_reopen_list_s],
        "idle_reopen_list_p95_s": p95(idle_reopen_list_s), "load_average": os.getloadavg(),
        "repeated_opens": len(REPEATED_OPENS),
        "quick_picks": sum(n for n, _ in quick), "quick_picks_lost": sum(len(lost) for _, lost in quick),
        "quick_picks_lost_detail": [x for _, lost in quick for x in lost],
        "cross_session_asks": asked, "cross_session_refused": refused, "integrity_check": integrity,
    }


def summary(figures: dict) -> str:
    api = figures["api"].values()
    done = sum(r.get("status") == "read" for r in api)
    stopped = sum(r["cancelled"] and r.get("stored_status") == "stopped" for r in api)
    fmt = lambda v: "—" if v is None else f"{v:.3f} s"
    return "\n".join([
        f"{figures['api_clients']} API clients + {figures['browsers']} browsers, one app, wall {figures['wall_s']} s",
        f"API readings: {done} read to the end, {stopped} stopped by their owner, "
        f"{sum(bool(r['error']) for r in api)} failed; highest queue rank seen {figures['max_api_rank']}",
        f"browsers: {figures['browser_end']} (end status, readings in the library); queue lines: "
        f"{figures['browser_queue_lines']}",
        f"reopen a session while busy (pick -> panel): p95 {fmt(figures['reopen_p95_s'])} "
        f"(median {fmt(median(figures['reopen_s']))}, n={len(figures['reopen_s'])}, "
        f"max {fmt(max(figures['reopen_s'], default=None))}); mark committed: p95 {fmt(figures['marks_p95_s'])} "
        f"(n={len(figures['marks_s'])}, max {fmt(max(figures['marks_s'], default=None))}); target "
        f"{LATENCY_TARGET_S} s",
        f"the same with the engine idle: reopen p95 {fmt(figures['idle_reopen_p95_s'])} "
        f"(median {fmt(median(figures['idle_reopen_s']))}, n={len(figures['idle_reopen_s'])}), "
        f"mark p95 {fmt(figures['idle_marks_p95_s'])} (n={len(figures['idle_marks_s'])})",
        f"reopen timed from Playwright's click (adds its waits for the button): p95 busy "
        f"{fmt(figures['reopen_list_p95_s'])}, idle {fmt(figures['idle_reopen_list_p95_s'])}",
        f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.1f}' for x in figures['load_average'])}",
        f"another client's session asked through /answer: {figures['cross_session_refused']} of "
        f"{figures['cross_session_asks']} refused; PRAGMA integrity_check: {figures['integrity_check']}",
        f"Opens pressed again (the first press lost): {figures['repeated_opens']}; "
        f"two Opens in the library in quick succession: {figures['quick_picks_lost']} of {figures['quick_picks']} "
        f"left the panel elsewhere than the last one opened",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--api", type=int, default=8)
    ap.add_argument("--browsers", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: never leave the app behind
    with tempfile.TemporaryDirectory(prefix="marginalia-load-") as tmp:
        tmp = Path(tmp)
        server = AppServer(tmp / "data", *SERVER_ARGS).start()
        try:
            figures = run(server.url, tmp / "data" / "marginalia.db", tmp, args.api, args.browsers, args.deadline)
        finally:
            server.stop()
    print(summary(figures))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
