"""Reliability of the running app (`python app.py`, the real model and SQLite, loopback only): hostile uploads
through the API, the upload limit, several readers at once (a small run of bench/load.py), and kill -9 during
margins and answers. One server for the module; the crash test comes last and restarts it."""
from __future__ import annotations

import json
import random
import sqlite3
import sys
import time
import urllib.request

import pytest

import hostile
from conftest import ROOT, AppServer, reopen_page, shared

sys.path.insert(0, str(ROOT))
from bench import load  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.server]  # left out of `make quick`

# Read through the live app: a subset of the battery, one or more of each kind of threat.
LIVE_CASES = ["deflate-bomb.epub", "laughs-opf.epub", "xxe-content.epub", "path-traversal.epub", "drm.epub",
              "random.pdf", "png-named.pdf", "many-pages.pdf", "one-bad-byte.txt", "nul-heavy.txt",
              "markup.md", "zero-bytes.txt"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    shared("books", "pg11.txt")
    app = AppServer(tmp_path_factory.mktemp("marginalia-reliability"), *load.SERVER_ARGS).start()
    yield app
    app.stop()


def db_rows(server: AppServer, sql: str, args=()) -> list[dict]:
    with sqlite3.connect(f"file:{server.data_dir / 'marginalia.db'}?mode=ro", uri=True, timeout=10) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(sql, args)]


def serving(server: AppServer) -> bool:
    with urllib.request.urlopen(server.url + "/config", timeout=30) as r:
        return r.status == 200


def test_hostile_uploads_through_the_app(server, tmp_path):
    from gradio_client import Client, handle_file

    from engine.documents import load_document

    cases = {c.name: c for c in hostile.available() if c.name in LIVE_CASES}
    paths = hostile.write(tmp_path, list(cases.values()))
    client = Client(server.url, verbose=False)
    before = db_rows(server, "SELECT count(*) AS n FROM documents")[0]["n"]
    accepted = []
    for name, case in cases.items():
        # An empty question: an accepted file is stored, then the reading is refused before it starts.
        with pytest.raises(Exception) as info:
            client.predict(handle_file(str(paths[name])), "", 64, 8, 16, "none", "hostile", api_name="/read")
        message = str(info.value)
        if case.refused:
            assert case.refused in message, (name, message)
        else:
            assert "type a question" in message, (name, message)
            accepted.append(name)
        assert serving(server)
    # Nothing of a refused file was stored; an accepted one was stored whole.
    docs = db_rows(server, "SELECT name, text FROM documents ORDER BY id")
    assert len(docs) == before + len(accepted)
    stored = {d["name"]: d["text"] for d in docs[before:]}
    for name in accepted:
        assert stored[name] == load_document(paths[name]).text


def test_upload_over_the_limit_is_refused(server):
    """Gradio's max_file_size (set from engine.documents.LIMITS in app.py) stops the upload while it streams."""
    import httpx

    from engine.documents import LIMITS

    body = b"x" * (LIMITS.file_bytes + 1)
    response = httpx.post(server.url + "/gradio_api/upload", files={"files": ("big.txt", body, "text/plain")},
                          timeout=120)
    assert response.status_code == 413, (response.status_code, response.text[:300])
    assert "maximum allowed size" in response.text
    assert serving(server)


def test_many_readers_at_once(server, chromium, tmp_path, capsys):
    figures = load.run(server.url, server.data_dir / "marginalia.db", tmp_path, api=3, browsers=1, deadline_s=900,
                       chromium=chromium)
    with capsys.disabled():
        print("\n" + load.summary(figures))
    api = list(figures["api"].values())
    assert not [r["error"] for r in api if r["error"]]
    for r in api:
        assert r["stored_owner_ok"]
        if r["cancelled"]:
            assert r["stored_status"] == "stopped"
        else:
            assert r["status"] == "read" and r["read"] == r["total"]
    assert figures["browser_end"] == [("done", 2)]  # its reading finished; its list shows its 2 sessions only
    assert figures["cross_session_refused"] == figures["cross_session_asks"] >= 2
    assert figures["max_api_rank"] is not None and figures["max_api_rank"] >= 1  # positions were reported
    assert any("ahead of you" in line or "Starting" in line for line in figures["browser_queue_lines"])
    # The 0.5 s target is a speed figure: `make load` prints it. Here, what must hold on any machine: reopening
    # a session and marking never wait for the engine (a reading here takes tens of seconds), so while it is
    # busy they cost about what they cost with it idle.
    assert figures["marks_s"] and figures["idle_marks_s"] and figures["reopen_s"] and figures["idle_reopen_s"]
    assert figures["reopen_p95_s"] <= 3 * figures["idle_reopen_p95_s"] + 1.0
    assert figures["marks_p95_s"] <= 3 * figures["idle_marks_p95_s"] + 1.0
    # A pick made while the previous one is pending is not dropped (Gradio's default trigger_mode would).
    assert figures["quick_picks"] >= 6 and figures["quick_picks_lost"] == 0
    assert figures["integrity_check"] == "ok"


# ---------------------------------------------------------------- kill -9 during margins and answers

def snapshot(server: AppServer, session_id: str) -> dict:
    return {
        "margins": db_rows(server, "SELECT segment_index, text, verdict, score, mark, tokens, seconds, char_start, "
                                   "char_end FROM margins WHERE session_id = ? ORDER BY segment_index", [session_id]),
        "answers": db_rows(server, "SELECT id, question, text, margins_used, seconds FROM answers "
                                   "WHERE session_id = ? ORDER BY id", [session_id]),
    }


def check_after_restart(server: AppServer, session_id: str, before: dict) -> dict:
    after = snapshot(server, session_id)
    assert db_rows(server, "PRAGMA integrity_check")[0]["integrity_check"] == "ok"
    assert after["margins"][:len(before["margins"])] == before["margins"]  # every margin written is there
    assert after["answers"][:len(before["answers"])] == before["answers"]
    assert [m["segment_index"] for m in after["margins"]] == list(range(len(after["margins"])))
    for m in after["margins"]:  # no row half-written
        assert m["text"] is not None and m["tokens"] is not None and m["char_end"] > m["char_start"]
    for a in after["answers"]:
        assert a["text"] and a["seconds"] is not None and isinstance(json.loads(a["margins_used"]), list)
    return after


def wait_panel(page, server: AppServer, statuses: tuple[str, ...], seconds: float) -> None:
    """Wait for the panel to show one of `statuses`; on a timeout, fail with what the page and the app showed."""
    deadline = time.monotonic() + seconds
    while (state := load.panel_state(page))["status"] not in statuses:
        if time.monotonic() > deadline:
            raise AssertionError(f"panel still {state} after {seconds:.0f} s, waiting for {statuses}; "
                                 f"notice: {page.inner_text('#notice')!r}\napp log:\n{server.tail(15)}")
        time.sleep(0.2)


def test_kill_9_during_margins_and_answers(server, chromium, tmp_path, capsys):
    seed = int(time.time())
    rng = random.Random(seed)
    text = shared("books", "pg84.txt").read_text(encoding="utf-8")
    start = text.index("You will rejoice to hear")
    path = tmp_path / "frankenstein-letter.txt"
    path.write_text(text[start:start + 2000], encoding="utf-8")
    context = chromium.new_context(viewport={"width": 1300, "height": 900})
    page = context.new_page()
    survived = []
    try:
        session_id = load.browser_start(page, server.url, path)["session"]
        total = db_rows(server, "SELECT segments_total FROM sessions WHERE id = ?", [session_id])[0]["segments_total"]
        assert total >= 6
        # Three kills while margins are being written, at a random time after a random number of new margins.
        for _ in range(3):
            have = len(snapshot(server, session_id)["margins"])
            want = min(have + rng.randint(1, 2), total - 1)
            deadline = time.monotonic() + 300
            while len(snapshot(server, session_id)["margins"]) < want and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 1.0))  # mid-prefill, mid-decode, mid-write or between: wherever it lands
            before = snapshot(server, session_id)
            server.kill()
            server.start()
            after = check_after_restart(server, session_id, before)
            survived.append(("margin", len(before["margins"]), len(after["margins"])))
            page = reopen_page(page, server.url)
            assert load.panel_state(page)["session"] == session_id
            if len(after["margins"]) == total and not page.is_visible("#resume-btn"):
                continue  # the kill came after the reading's end (copied notes are fast): nothing to resume
            page.click("#resume-btn")  # Resume continues where the saved margins end
            wait_panel(page, server, ("reading", "queued", "done"), 120)
        wait_panel(page, server, ("done",), 300)
        done = check_after_restart(server, session_id, snapshot(server, session_id))
        assert len(done["margins"]) == total
        # Two kills while an answer is being written: a finished answer is kept whole, an unfinished one not at all.
        for k in range(2):
            page.fill("#question textarea", f"Who writes the letter? ({k})")
            before = snapshot(server, session_id)
            page.click("#answer-btn")
            time.sleep(rng.uniform(0.3, 2.5))
            before = snapshot(server, session_id)
            server.kill()
            server.start()
            after = check_after_restart(server, session_id, before)
            survived.append(("answer", len(before["answers"]), len(after["answers"])))
            page = reopen_page(page, server.url)
        page.fill("#question textarea", "Who writes the letter?")
        page.click("#answer-btn")
        deadline = time.monotonic() + 300
        while (len(snapshot(server, session_id)["answers"]) <= len(after["answers"])
               and time.monotonic() < deadline):
            time.sleep(0.1)
        final = check_after_restart(server, session_id, after)
        assert len(final["answers"]) == len(after["answers"]) + 1
    finally:
        context.close()
    with capsys.disabled():
        print(f"\nkill -9 x{len(survived)} (seed {seed}): (during, rows saved before the kill, rows after restart) "
              f"{survived}")
