"""app/database_home.py against real SQLite files (no mocks): where the database goes on which file system, and
the copy a moved database keeps on the mount (a /proc/self/mounts text stands in for a Space's bucket)."""
import logging
import os
import shutil
import sqlite3
import threading
import time

import pytest

from app import database_home
from app.storage import Store
from test_storage import add_doc, new_session

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
    where, why = database_home.database_path("/data", "/app/data", MOUNTS.format(data=fstype))
    assert where == "/app/data/marginalia.db"
    assert fstype in why and "/data" in why and "/app/data/marginalia.db" in why  # what the log says
    # Below the mount point too, and a mount point written with an escaped space.
    assert database_home.database_path("/data/marginalia", "/app/data", MOUNTS.format(data=fstype))[0] == \
        "/app/data/marginalia.db"
    assert database_home.database_path("/mnt/my share/m", "/app/data", MOUNTS.format(data=fstype))[0] == \
        "/app/data/marginalia.db"


def test_the_database_stays_with_the_data_on_a_local_file_system():
    mounts = MOUNTS.format(data="ext4")
    for data in ("/data", "/data/sub", "/mnt/disk", "/home/me/marginalia", "/database"):
        assert database_home.database_path(data, "/app/data", mounts) == (f"{data}/marginalia.db", None)
    # No /proc/self/mounts line for it (or none at all): kept where it was asked for.
    assert database_home.database_path("/x", "/app/data", "") == ("/x/marginalia.db", None)
    # Where the local folder is on such a mount too, nothing is gained by moving: it stays, and the log says so.
    where, why = database_home.database_path("/data", "/data/app", MOUNTS.format(data="nfs"))
    assert where == "/data/marginalia.db" and "stays" in why


def test_this_machines_mounts_are_read(tmp_path):
    """The real /proc/self/mounts: pytest's temporary folder is on local disk here, so the database stays."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            point, fstype = database_home.mount_of(os.path.realpath(tmp_path), f.read())
    except OSError:
        pytest.skip("no /proc/self/mounts (not Linux)")
    if database_home.unsafe_for_sqlite(fstype):
        pytest.skip(f"the temporary folder is itself on {fstype}")
    assert database_home.database_path(tmp_path, tmp_path / "local") == (str(tmp_path / "marginalia.db"), None)


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
    store, backup = database_home.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    assert store.path == str(local / "marginalia.db") and backup.target == str(bucket / "marginalia.db.backup")
    sid = new_session(store)
    store.save_answer(sid, "Who is Ahab?", "The captain.", [0], 1.0)
    backup.stop()  # the last changes, copied at shutdown (or by the thread, had it run after them)
    assert not backup.pending and backup.taken >= 1
    shutil.rmtree(local)  # the restart wipes local disk

    with caplog.at_level(logging.INFO, logger="app.storage"):
        store, backup = database_home.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    assert "restored from" in caplog.text and str(bucket / "marginalia.db.backup") in caplog.text
    assert [a["text"] for a in store.answers(sid)] == ["The captain."]
    assert not backup.stop()  # nothing changed since the copy it came from: no copy taken
    store.set_mark(sid, 0, True)  # no margin 0: nothing changed
    assert not backup.pending
    store.delete_session(sid, "alice")
    assert backup.backup() and count(backup.target, "sessions") == 0
    # Where the local database is still there (the process restarted, the disk kept), it is the newer: kept.
    assert database_home.restore_database(store.path, backup.target) == (False, None)


def test_a_copy_taken_while_another_connection_writes_holds_what_was_committed(tmp_path):
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    bucket.mkdir()
    store, backup = database_home.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
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
    store, backup = database_home.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    sid = new_session(store)
    backup.stop()
    good = (bucket / "marginalia.db.backup").read_bytes()

    # The copy to the mount fails halfway: half a file under the temporary name, and then an error.
    def half(src, dst):
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read()[:4096])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(database_home, "_copy", half)
    store.save_answer(sid, "Who is Ahab?", "The captain.", [], 1.0)
    assert not backup.backup() and backup.pending  # tried again later
    assert (bucket / "marginalia.db.backup").read_bytes() == good
    monkeypatch.undo()
    # A crash at that point leaves the temporary file behind: the copy stays the good one.
    (bucket / "marginalia.db.backup.partial").write_bytes(good[:4096])
    shutil.rmtree(local)
    restored, what = database_home.restore_database(local / "marginalia.db", bucket / "marginalia.db.backup")
    assert restored and count(local / "marginalia.db", "sessions") == 1
    # The next copy writes over the leftover and replaces the copy whole.
    store = Store(local / "marginalia.db")
    backup = database_home.Backup(store, bucket / "marginalia.db.backup", changed=False)
    store.save_answer(sid, "Who is Ahab?", "The captain.", [], 1.0)
    assert backup.backup() and count(backup.target, "answers") == 1
    assert not (bucket / "marginalia.db.backup.partial").exists()


def test_an_unreadable_copy_is_set_aside_and_the_library_starts_empty(tmp_path):
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    bucket.mkdir()
    (bucket / "marginalia.db.backup").write_bytes(b"not a database " * 1000)
    store, backup = database_home.open_database(bucket, local, bucket_mounts(bucket), interval=3600)
    assert store.list_sessions("alice") == [] and (bucket / "marginalia.db.backup.unreadable").exists()
    backup.stop()
    assert backup.taken == 1 and count(backup.target) == 0  # a fresh copy of the new, empty database


def test_copies_are_taken_at_most_once_an_interval_and_only_after_a_change(tmp_path):
    bucket, local = tmp_path / "bucket", tmp_path / "local"
    bucket.mkdir()
    store, backup = database_home.open_database(bucket, local, bucket_mounts(bucket), interval=0.5)
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
    store, backup = database_home.open_database(data, data / "local", text, interval=0)
    assert backup is None and store.path == str(data / "marginalia.db")
    new_session(store)
    assert set(os.listdir(data)) <= {"marginalia.db", "marginalia.db-shm", "marginalia.db-wal"}
    assert not any("database-backup" == t.name for t in threading.enumerate())
