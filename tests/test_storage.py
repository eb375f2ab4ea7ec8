"""app/storage.py against a real SQLite file (no mocks)."""
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import threading
import time

import pytest
import sqlite_utils

from app import storage
from app.storage import Store

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
                                settings or {"classifier": "minilm"}, total)


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
        store.export_json(sid, owner="bob")
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
    settings = {"classifier": "minilm", "threshold": 0.35, "window": [4096, None], "ü": "ß"}
    sid = new_session(store, settings=settings)
    assert store.get_session(sid)["settings"] == settings
    before = store.get_session(sid)["updated"]
    store.update_session(sid, status="reading", settings={**settings, "threshold": 0.5})
    s = Store(path).get_session(sid)
    assert s["status"] == "reading" and s["updated"] > before
    assert s["settings"] == {**settings, "threshold": 0.5}
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


def test_exports(store):
    sid = new_session(store, settings={"classifier": "minilm", "threshold": 0.35})
    store.save_margin(sid, 0, "Ishmael goes to sea.", False, 0.12, 0, 17, 1, 1)
    store.save_margin(sid, 1, "Ahab's leg.", True, 0.91, 17, 40, 2, 3)
    store.set_mark(sid, 0, True)
    store.save_answer(sid, "Who is Ahab?", "The one-legged captain.", [0, 1], 3.2)

    data = store.export_json(sid)
    assert json.loads(json.dumps(data)) == data  # serialisable as is
    assert data["document"]["title"] == "Moby-Dick"
    assert data["question"] == "Who is Ahab?"
    assert data["settings"] == {"classifier": "minilm", "threshold": 0.35}
    m0, m1 = data["margins"]
    assert (m0["verdict"], m0["mark"], m0["effective"], m0["page_start"]) == (False, True, True, 1)
    assert (m1["verdict"], m1["mark"], m1["page_start"], m1["page_end"]) == (True, None, 2, 3)
    assert data["answers"] == [{"question": "Who is Ahab?", "text": "The one-legged captain.",
                                "margins_used": [0, 1], "seconds": 3.2,
                                "created": data["answers"][0]["created"]}]

    md = store.export_markdown(sid)
    assert md.startswith("# Moby-Dick\n")
    for piece in ("**Question:** Who is Ahab?", "## Answers", "The one-legged captain.",
                  "Margins used: segments 1, 2", "## Margin notes",
                  "### Segment 1 · p. 1 · relevant (reader)", "Ishmael goes to sea.",
                  "### Segment 2 · p. 2–3 · relevant (0.91)", "Ahab's leg.", '"threshold": 0.35'):
        assert piece in md, piece
    with pytest.raises(KeyError):
        store.export_markdown("no-such-session")


# /proc/self/mounts as on a Space with a storage bucket at /data (hf-mount: NFS, or FUSE), and a few neighbours.
MOUNTS = """overlay / overlay rw,relatime,lowerdir=/l,upperdir=/u,workdir=/w 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
hf-mount /data {data} rw,relatime 0 0
/dev/vdb /mnt/disk ext4 rw,relatime 0 0
server:/export /mnt/my\\040share nfs4 rw,relatime,vers=4.2 0 0
"""


@pytest.mark.parametrize("fstype", ["nfs", "nfs4", "fuse", "fuse.hf-mount", "fuse.gcsfuse", "cifs"])
def test_the_database_leaves_a_network_or_fuse_mount_for_local_disk(fstype):
    where, why = storage.database_path("/data", "/app/data", MOUNTS.format(data=fstype))
    assert where == "/app/data/marginalia.db"
    assert fstype in why and "/data" in why and "/app/data/marginalia.db" in why  # what the log says
    # Below the mount point too, and a mount point written with an escaped space.
    assert storage.database_path("/data/marginalia", "/app/data", MOUNTS.format(data=fstype))[0] == \
        "/app/data/marginalia.db"
    assert storage.database_path("/mnt/my share/m", "/app/data", MOUNTS.format(data=fstype))[0] == \
        "/app/data/marginalia.db"


def test_the_database_stays_with_the_data_on_a_local_file_system():
    mounts = MOUNTS.format(data="ext4")
    for data in ("/data", "/data/sub", "/mnt/disk", "/home/me/marginalia", "/database"):
        assert storage.database_path(data, "/app/data", mounts) == (f"{data}/marginalia.db", None)
    # No /proc/self/mounts line for it (or none at all): kept where it was asked for.
    assert storage.database_path("/x", "/app/data", "") == ("/x/marginalia.db", None)
    # Where the local folder is on such a mount too, nothing is gained by moving: it stays, and the log says so.
    where, why = storage.database_path("/data", "/data/app", MOUNTS.format(data="nfs"))
    assert where == "/data/marginalia.db" and "stays" in why


def test_this_machines_mounts_are_read(tmp_path):
    """The real /proc/self/mounts: pytest's temporary folder is on local disk here, so the database stays."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            point, fstype = storage.mount_of(os.path.realpath(tmp_path), f.read())
    except OSError:
        pytest.skip("no /proc/self/mounts (not Linux)")
    if storage.unsafe_for_sqlite(fstype):
        pytest.skip(f"the temporary folder is itself on {fstype}")
    assert storage.database_path(tmp_path, tmp_path / "local") == (str(tmp_path / "marginalia.db"), None)


# ---------------------------------------------------------------- the moved database's copy on the mount


def bucket_mounts(bucket, fstype="nfs4"):
    """MOUNTS with `bucket` (a pytest folder standing for /data) mounted as `fstype`."""
    point = os.path.realpath(bucket).replace("\\", "\\134").replace(" ", "\\040")
    return MOUNTS.format(data="ext4") + f"server:/bucket {point} {fstype} rw,relatime 0 0\n"


def count(path, table="documents"):
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()


def test_a_moved_database_is_restored_from_its_copy_on_the_mount(tmp_path, caplog):
    """The Space's restart: the database on local disk is gone, its copy on the bucket comes back before the
    Store opens, and the log says so; then the copy is kept up to date again."""
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    bucket.mkdir()
    store, backup = storage.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    assert store.path == str(local / "marginalia.db") and backup.target == str(bucket / "marginalia.db.backup")
    sid = new_session(store)
    store.save_answer(sid, "Who is Ahab?", "The captain.", [0], 1.0)
    backup.stop()  # the last changes, copied at shutdown (or by the thread, had it run after them)
    assert not backup.pending and backup.taken >= 1
    shutil.rmtree(local)  # the restart wipes local disk

    with caplog.at_level(logging.INFO, logger="app.storage"):
        store, backup = storage.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    assert "restored from" in caplog.text and str(bucket / "marginalia.db.backup") in caplog.text
    assert [a["text"] for a in store.answers(sid)] == ["The captain."]
    assert not backup.stop()  # nothing changed since the copy it came from: no copy taken
    store.set_mark(sid, 0, True)  # no margin 0: nothing changed
    assert not backup.pending
    store.delete_session(sid, "alice")
    assert backup.backup() and count(backup.target, "sessions") == 0
    # Where the local database is still there (the process restarted, the disk kept), it is the newer: kept.
    assert storage.restore_database(store.path, backup.target) == (False, None)


def test_a_copy_taken_while_another_connection_writes_holds_what_was_committed(tmp_path):
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    bucket.mkdir()
    store, backup = storage.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    backup.stop()
    assert backup.taken == 1  # the new database's first copy, at start
    committed, done = [0], threading.Event()

    def write():
        writer = Store(store.path)  # its own connections, as another handler's
        while not done.is_set():
            add_doc(writer, text=f"page {committed[0]} " * 200)
            committed[0] += 1

    thread = threading.Thread(target=write)
    thread.start()
    try:
        for _ in range(5):
            before = committed[0]
            backup.changed()
            assert backup.backup()
            after = committed[0]
            n = count(backup.target)  # PRAGMA integrity_check: ok
            assert before <= n <= after + 1, (before, n, after)
    finally:
        done.set()
        thread.join()
    assert backup.taken == 6 and not os.path.exists(backup.target + ".partial")
    assert not [name for name in os.listdir(local) if "snapshot" in name]  # the local snapshots are gone


def test_a_crash_midway_never_replaces_a_good_copy(tmp_path, monkeypatch):
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    bucket.mkdir()
    store, backup = storage.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    sid = new_session(store)
    backup.stop()
    good = (bucket / "marginalia.db.backup").read_bytes()

    # The copy to the mount fails halfway: half a file under the temporary name, and then an error.
    def half(src, dst):
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read()[:4096])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "_copy", half)
    store.save_answer(sid, "Who is Ahab?", "The captain.", [], 1.0)
    assert not backup.backup() and backup.pending  # tried again later
    assert (bucket / "marginalia.db.backup").read_bytes() == good
    monkeypatch.undo()
    # A crash at that point leaves the temporary file behind: the copy stays the good one.
    (bucket / "marginalia.db.backup.partial").write_bytes(good[:4096])
    shutil.rmtree(local)
    restored, what = storage.restore_database(local / "marginalia.db", bucket / "marginalia.db.backup")
    assert restored and count(local / "marginalia.db", "sessions") == 1
    # The next copy writes over the leftover and replaces the copy whole.
    store = Store(local / "marginalia.db")
    backup = storage.Backup(store, bucket / "marginalia.db.backup", changed=False)
    store.save_answer(sid, "Who is Ahab?", "The captain.", [], 1.0)
    assert backup.backup() and count(backup.target, "answers") == 1
    assert not (bucket / "marginalia.db.backup.partial").exists()


def test_an_unreadable_copy_is_set_aside_and_the_library_starts_empty(tmp_path):
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    bucket.mkdir()
    (bucket / "marginalia.db.backup").write_bytes(b"not a database " * 1000)
    store, backup = storage.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    assert store.list_sessions("alice") == [] and (bucket / "marginalia.db.backup.unreadable").exists()
    backup.stop()
    assert backup.taken == 1 and count(backup.target) == 0  # a fresh copy of the new, empty database


def test_copies_are_taken_at_most_once_an_interval_and_only_after_a_change(tmp_path):
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    bucket.mkdir()
    store, backup = storage.open_database(bucket, local, bucket_mounts(bucket), interval=0.5)
    t = time.monotonic()

    def wait_for(taken):
        deadline = time.monotonic() + 20
        while backup.taken < taken and time.monotonic() < deadline:
            time.sleep(0.02)
        return backup.taken

    assert wait_for(1) == 1  # at start: the database may differ from any copy already there
    sid = new_session(store)
    for i in range(20):
        store.save_margin(sid, i, "a note", True, 0.9, 0, 10)
    assert wait_for(2) >= 2
    deadline = time.monotonic() + 20
    while backup.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    taken = backup.taken
    time.sleep(1.2)  # idle: nothing more to copy
    assert backup.taken == taken <= 1 + (time.monotonic() - t) / 0.5
    assert not backup.stop() and backup.taken == taken and count(backup.target, "margins") == 20


@pytest.mark.parametrize("mounts", ["ext4", "both"])
def test_no_copy_where_the_database_stays_in_the_data_folder(tmp_path, mounts):
    """On a local file system, or where the local folder is no safer, the database is where MARGINALIA_DATA
    says: no copy, no thread, nothing new in the folder."""
    data = tmp_path / "data"
    data.mkdir()
    text = bucket_mounts(data, "ext4") if mounts == "ext4" else \
        MOUNTS.format(data="ext4") + f"server:/b {os.path.realpath(tmp_path)} nfs rw 0 0\n"
    store, backup = storage.open_database(data, data / "local", text, interval=0)
    assert backup is None and store.path == str(data / "marginalia.db")
    new_session(store)
    assert set(os.listdir(data)) <= {"marginalia.db", "marginalia.db-shm", "marginalia.db-wal"}
    assert not any("database-backup" == t.name for t in threading.enumerate())
