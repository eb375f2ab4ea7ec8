"""app/storage.py against a real SQLite file (no mocks)."""
import hashlib
import json
import sqlite3
import threading

import pytest
import sqlite_utils

from app import exports, storage
from app.storage import Store
from engine import Settings

TEXT = "Call me Ishmael. " * 20


@pytest.fixture
def path(tmp_path):
    return tmp_path / "marginalia.db"


@pytest.fixture
def store(path):
    return Store(path)


def add_doc(store, text=TEXT, **kw):
    args = dict(name="moby.txt", kind="txt", title="Moby-Dick", text=text,
                sha256=hashlib.sha256(text.encode()).hexdigest())
    return store.add_document(**{**args, **kw})


def new_session(store, owner="alice", settings=None, total=4):
    return store.create_session(owner, add_doc(store), "Who is Ahab?", "qwen3-0.6b",
                                settings or Settings(classifier="embedding"), total)


def applied(path):
    return [r["name"] for r in sqlite_utils.Database(path)["_migrations"].rows]


def test_migrations_run_once_and_are_recorded(path):
    Store(path)
    assert applied(path) == [fn.__name__ for fn in storage.MIGRATIONS]
    Store(path)  # reopening must not re-run m001 (it would fail: tables exist)
    db = sqlite_utils.Database(path)
    assert db.execute("SELECT count(*) FROM _migrations").fetchone()[0] == len(storage.MIGRATIONS)
    assert {"documents", "sessions", "margins", "answers"} <= set(db.table_names())
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_new_migration_runs_alone_and_once(path):
    Store(path)
    ran = []

    def m999_add_note(db):
        ran.append(1)
        db["sessions"].add_column("note", str)

    with sqlite_utils.Database(path) as db:
        assert storage.migrate(db, storage.MIGRATIONS + [m999_add_note]) == ["m999_add_note"]
        assert storage.migrate(db, storage.MIGRATIONS + [m999_add_note]) == []
        assert "note" in db["sessions"].columns_dict
    assert ran == [1]
    assert applied(path)[-1] == "m999_add_note"


def test_failed_migration_is_rolled_back_and_not_recorded(path):
    Store(path)

    def m998_broken(db):
        db["scratch"].create({"id": int}, pk="id")
        raise RuntimeError("boom")

    with sqlite_utils.Database(path) as db:
        with pytest.raises(RuntimeError):
            storage.migrate(db, storage.MIGRATIONS + [m998_broken])
        assert "scratch" not in db.table_names()
    assert "m998_broken" not in applied(path)


def test_document_dedupe_on_sha256(store):
    first = add_doc(store, page_starts=[0, 100, 200])
    assert add_doc(store, name="other-name.txt") == first
    assert add_doc(store, text="A different book.") != first
    doc = store.get_document(first)
    assert (doc["name"], doc["pages"], doc["chars"]) == ("moby.txt", 3, len(TEXT))
    assert doc["page_starts"] == [0, 100, 200] and doc["text"] == TEXT
    assert store.get_document(12345) is None
    with pytest.raises(ValueError):
        add_doc(store, kind="docx", text="x")


def test_session_ownership_isolation(store):
    sid = new_session(store, owner="alice")
    assert store.get_session(sid, owner="alice")["id"] == sid
    assert store.get_session(sid)["owner"] == "alice"  # no owner: internal use
    assert store.get_session(sid, owner="bob") is None
    assert store.list_sessions("bob") == []
    assert store.delete_session(sid, "bob") is False
    with pytest.raises(KeyError):
        exports.as_json(store, sid, owner="bob")
    assert store.get_session(sid, owner="alice") is not None
    assert store.delete_session(sid, "alice") is True
    assert store.get_session(sid) is None


def test_list_sessions_newest_first_with_counts(store):
    old, new = new_session(store), new_session(store)
    store.save_margin(new, 0, "Ahab appears.", True, 0.9, 0, 10)
    store.save_answer(new, "Who is Ahab?", "The captain.", [0], 1.5)
    rows = store.list_sessions("alice")
    assert [r["id"] for r in rows] == [new, old]
    assert rows[0]["title"] == "Moby-Dick"
    assert (rows[0]["margins_count"], rows[0]["answers_count"]) == (1, 1)
    assert (rows[1]["margins_count"], rows[1]["answers_count"]) == (0, 0)


def test_update_session_bumps_updated_and_roundtrips_settings(store, path):
    settings = Settings(classifier="embedding", embedding_threshold=0.35, context_limit=4096, window="sliding")
    sid = new_session(store, settings=settings)
    assert store.get_session(sid)["settings"] == settings  # the engine's Settings, as they were given
    before = store.get_session(sid)["updated"]
    store.update_session(sid, status="reading", settings=Settings(embedding_threshold=0.5))
    s = Store(path).get_session(sid)
    assert s["status"] == "reading" and s["updated"] > before
    assert s["settings"] == Settings(embedding_threshold=0.5)
    with pytest.raises(ValueError):
        store.update_session(sid, owner="mallory")
    with pytest.raises(ValueError):
        store.update_session(sid, status="done")


def test_margin_upsert_keeps_reader_mark_and_effective(store):
    sid = new_session(store)
    store.save_margin(sid, 0, "Ishmael introduces himself.", False, 0.1, 0, 17, 1, 1)
    store.save_margin(sid, 1, "The Pequod.", True, 0.8, 17, 40, 1, 2)
    store.save_margin(sid, 2, "No classifier here.", None, None, 40, 60)
    assert [m["effective"] for m in store.margins(sid)] == [False, True, None]

    assert store.set_mark(sid, 0, True)
    assert store.set_mark(sid, 2, False)
    assert not store.set_mark(sid, 7, True)  # no such margin
    # The segment is read again: text and verdict change, the reader's mark does not.
    store.save_margin(sid, 0, "Ishmael, revised.", False, 0.2, 0, 17, 1, 1, tokens=12, seconds=0.5)
    m0, m1, m2 = store.margins(sid)
    assert (m0["text"], m0["verdict"], m0["mark"], m0["effective"]) == \
        ("Ishmael, revised.", False, True, True)
    assert (m0["score"], m0["tokens"], m0["seconds"]) == (0.2, 12, 0.5)
    assert (m1["mark"], m1["effective"]) == (None, True)
    assert (m2["verdict"], m2["mark"], m2["effective"]) == (None, False, False)
    store.set_mark(sid, 0, None)  # clearing the mark falls back to the verdict
    assert store.margins(sid)[0]["effective"] is False
    assert store.get_session(sid)["segments_read"] == 3  # re-reading does not double-count


def test_durable_across_restart(path):
    store = Store(path)
    sid = new_session(store)
    store.save_margin(sid, 0, "Saved before the crash.", True, 0.7, 0, 10)
    store.set_mark(sid, 0, False)
    store.save_answer(sid, "Q?", "A.", [0], 2.0)
    del store  # no close, no shutdown hook: nothing may be pending

    fresh = Store(path)
    assert fresh.get_session(sid, owner="alice")["segments_read"] == 1
    (m,) = fresh.margins(sid)
    assert (m["text"], m["verdict"], m["mark"]) == ("Saved before the crash.", True, False)
    assert fresh.answers(sid)[0]["margins_used"] == [0]
    # A separate raw connection (another process, in effect) sees it too.
    assert sqlite3.connect(path).execute("SELECT count(*) FROM margins").fetchone()[0] == 1


def test_concurrent_save_margin_from_threads(path):
    store = Store(path)
    sid = new_session(store, total=200)
    errors, start = [], threading.Barrier(4)

    def worker(n):
        # Each thread gets its own Store for half the workers, sharing one for the rest:
        # both ways of using the module must work.
        s = store if n % 2 else Store(path)
        start.wait()
        try:
            for i in range(n, 200, 4):
                s.save_margin(sid, i, f"margin {i}", i % 3 == 0, i / 200, i * 10, i * 10 + 10)
                s.margins(sid)  # readers interleaved with writers
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    margins = store.margins(sid)
    assert [m["segment_index"] for m in margins] == list(range(200))
    assert store.get_session(sid)["segments_read"] == 200


def test_answers_oldest_first(store):
    sid = new_session(store)
    first = store.save_answer(sid, "First?", "One.", [0, 2], 1.0)
    second = store.save_answer(sid, "Second?", "Two.", [], 0.5)
    rows = store.answers(sid)
    assert [a["id"] for a in rows] == [first, second]
    assert rows[0]["margins_used"] == [0, 2] and rows[1]["margins_used"] == []


def test_delete_session_removes_its_margins_and_answers(store, path):
    sid, other = new_session(store), new_session(store)
    for s in (sid, other):
        store.save_margin(s, 0, "note", True, 0.5, 0, 5)
        store.save_answer(s, "Q?", "A.", [0], 1.0)
    assert store.delete_session(sid, "alice")
    db = sqlite_utils.Database(path)
    assert db["margins"].count == 1 and db["answers"].count == 1
    assert store.margins(other) and store.answers(other)
    assert db["documents"].count == 1  # documents are shared, they stay


def test_settings_stored_by_an_older_version_read_as_they_were_read(store, path):
    """Settings saved before margins had a style were free-form notes; fields the engine no longer has are left out."""
    sid = new_session(store)
    sqlite_utils.Database(path)["sessions"].update(sid, {"settings": json.dumps(
        {"segment_tokens": 256, "classifier": "llm", "no_longer_a_setting": 1})})
    assert store.get_session(sid)["settings"] == Settings(segment_tokens=256, classifier="llm", margins="abstractive")


def test_exports(store):
    sid = new_session(store, settings=Settings(classifier="embedding", embedding_threshold=0.35))
    store.save_margin(sid, 0, "Ishmael goes to sea.", False, 0.12, 0, 17, 1, 1)
    store.save_margin(sid, 1, "Ahab's leg.", True, 0.91, 17, 40, 2, 3)
    store.set_mark(sid, 0, True)
    store.save_answer(sid, "Who is Ahab?", "The one-legged captain.", [0, 1], 3.2)

    data = exports.as_json(store, sid)
    assert json.loads(json.dumps(data)) == data  # serialisable as is
    assert data["document"]["title"] == "Moby-Dick"
    assert data["question"] == "Who is Ahab?"
    assert data["settings"] == Settings(classifier="embedding", embedding_threshold=0.35).to_dict()
    m0, m1 = data["margins"]
    assert (m0["verdict"], m0["mark"], m0["effective"], m0["page_start"]) == (False, True, True, 1)
    assert (m1["verdict"], m1["mark"], m1["page_start"], m1["page_end"]) == (True, None, 2, 3)
    assert data["answers"] == [{"question": "Who is Ahab?", "text": "The one-legged captain.", "reasoning": "",
                                "margins_used": [0, 1], "seconds": 3.2,
                                "created": data["answers"][0]["created"]}]

    md = exports.markdown(store, sid)
    assert md.startswith("# Moby-Dick\n")
    for piece in ("**Question:** Who is Ahab?", "## Answers", "The one-legged captain.",
                  "Margins used: segments 1, 2", "## Margin notes",
                  "### Segment 1 · p. 1 · relevant (reader)", "Ishmael goes to sea.",
                  "### Segment 2 · p. 2–3 · relevant (0.91)", "Ahab's leg.", '"embedding_threshold": 0.35'):
        assert piece in md, piece
    with pytest.raises(KeyError):
        exports.markdown(store, "no-such-session")


def test_an_answer_keeps_its_reasoning_and_older_answers_read_without_one(path):
    """What an answer said before "Answer:" is stored beside it and exported; an answer saved without one
    (plain reading, or saved before the column existed) reads as ''."""
    store = Store(path)
    sid = new_session(store)
    store.save_answer(sid, "Where is John?", "The kitchen [segment 15].", [5, 14], 2.0,
                      "The notes say John went to the office [segment 6], then to the kitchen [segment 15].")
    store.save_answer(sid, "Who is Ahab?", "The captain.", [], 1.0)
    first, second = store.answers(sid)
    assert first["reasoning"].startswith("The notes say John went") and second["reasoning"] == ""
    assert [a["reasoning"] for a in exports.as_json(store, sid)["answers"]] == [first["reasoning"], ""]
    assert "*How it was found: The notes say John went" in exports.markdown(store, sid)
    assert "m006_answer_reasoning" in applied(path)
