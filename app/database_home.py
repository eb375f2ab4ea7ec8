"""Where the database lives: in the data folder, unless that folder's file system is not safe for SQLite (a
network file system or FUSE, as a Space's storage bucket); then on local disk, with a copy kept on the mount and
put back at start after a restart wiped the local disk."""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import time

from .storage import Store

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- where the database may live

DATABASE = "marginalia.db"
# File systems on which SQLite must not be used: network file systems, whose locks SQLite cannot rely on and on
# which WAL's shared memory does not work (sqlite.org/howtocorrupt.html 2.1, sqlite.org/wal.html), and FUSE,
# where a user-space daemon decides what a lock, an fsync or a shared mapping does. A Space's persistent /data
# is a storage bucket mounted by hf-mount, over NFS or FUSE (huggingface.co/docs/hub/storage-buckets-access).
NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "gpfs"}


def _unescape_mount(field: str) -> str:
    """A path as /proc/self/mounts writes it: space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str, mounts: str) -> tuple[str, str] | None:
    """(mount point, file system type) of the mount that holds `path` (absolute, symlinks resolved), from the
    text of /proc/self/mounts: the longest mount point above it, the last one listed where two are the same."""
    best = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape_mount(fields[1])
        if (path == point or path.startswith(point.rstrip("/") + "/")) and (best is None
                                                                             or len(point) >= len(best[0])):
            best = (point, fields[2])
    return best


def unsafe_for_sqlite(fstype: str) -> bool:
    return fstype in NETWORK_FILESYSTEMS or fstype in ("fuse", "fuseblk") or fstype.startswith("fuse.")


def database_path(data_dir: str | os.PathLike, local_dir: str | os.PathLike,
                  mounts: str | None = None) -> tuple[str, str | None]:
    """Where the database goes, and why when not in `data_dir`: data_dir/marginalia.db, unless data_dir is on a
    file system where SQLite is not safe (see unsafe_for_sqlite); then local_dir/marginalia.db, on local disk.
    `mounts`: the text of /proc/self/mounts (read here when None; where there is none, data_dir is kept)."""
    here = os.path.join(os.path.abspath(data_dir), DATABASE)
    if mounts is None:
        try:
            with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        except OSError:
            return here, None
    found = mount_of(os.path.realpath(data_dir), mounts)
    if found is None or not unsafe_for_sqlite(found[1]):
        return here, None
    point, fstype = found
    local = os.path.join(os.path.abspath(local_dir), DATABASE)
    other = mount_of(os.path.realpath(local_dir), mounts)
    if other is not None and unsafe_for_sqlite(other[1]):
        return here, (f"{data_dir} is on {fstype} ({point}), where SQLite is not safe, and so is {local_dir}: "
                      f"the database stays at {here}")
    return local, (f"{data_dir} is on {fstype} ({point}), where SQLite's locking is not safe: the database is "
                   f"kept on local disk at {local}; files and caches stay in {data_dir}")


# ---------------------------------------------------------------- a moved database's copy, kept on the mount

BACKUP = DATABASE + ".backup"  # in the data folder, beside the files and caches it lists


def _copy(src: str, dst: str) -> None:
    """Copy the bytes and fsync them, so that a rename after this never publishes a file still half in flight."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 20)
        g.flush()
        os.fsync(g.fileno())


def _remove(*paths: str) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _readable(path: str) -> bool:
    """SQLite opens the file and finds nothing wrong in it (PRAGMA quick_check)."""
    try:
        conn = sqlite3.connect(path)
        try:
            return conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        finally:
            conn.close()
    except sqlite3.Error:
        return False
    finally:
        _remove(path + "-wal", path + "-shm")


def restore_database(path: str | os.PathLike, backup: str | os.PathLike) -> tuple[bool, str | None]:
    """Before the Store opens `path`: where it does not exist and `backup` does (local disk wiped by a restart,
    the copy kept on the mount), copy the backup there. Returns (restored, what to log; None where nothing was
    to be done). A backup SQLite cannot read is set aside as backup + ".unreadable" and the database starts
    empty; an error reading the mount is raised (starting empty would soon copy the empty library over it)."""
    path, backup = os.path.abspath(os.fspath(path)), os.path.abspath(os.fspath(backup))
    if os.path.exists(path) or not os.path.exists(backup):
        return False, None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _remove(path + "-wal", path + "-shm", path + "-journal")  # another database's, of this name: not this one's
    partial = path + ".restoring"
    _copy(backup, partial)
    if not _readable(partial):
        _remove(partial)
        os.replace(backup, backup + ".unreadable")
        return False, f"the database's backup {backup} is not a readable database: set aside as " \
                      f"{backup}.unreadable, the library starts empty"
    os.replace(partial, path)
    saved = datetime.datetime.fromtimestamp(os.path.getmtime(backup)).isoformat(" ", "seconds")
    return True, f"the database was restored from {backup} (saved {saved}, {os.path.getsize(path):,} bytes) to {path}"


class Backup:
    """A copy of the Store's database at `target`, kept up to date while the app runs. Where the database was
    moved to local disk off a mount on which SQLite is not safe (database_path), this copy on the mount is what
    outlives a restart that wipes local disk; restore_database puts it back.

    When: each commit that changed rows counts (Store.on_commit; every write goes through the Store), and a
    thread takes a copy once there is one, at most once every `interval` seconds; stop() takes a last one if
    anything changed since. A counter read before each copy begins says whether the copy holds the last commit.
    How: sqlite3's online backup API writes a consistent snapshot (one read transaction: what was committed
    when it began, whatever other connections write meanwhile) to a file beside the database on local disk;
    that goes to the mount under a temporary name, fsynced, and os.replace puts it on `target`, so a crash or
    a failed write midway leaves the previous copy as it was. `changed`: whether the database may differ from
    the copy already (False just after restoring from it)."""

    def __init__(self, store: Store, target: str | os.PathLike, interval: float = 30.0, changed: bool = True):
        self.store, self.interval = store, interval
        self.target = os.path.abspath(os.fspath(target))
        self.taken = 0  # copies written
        self._changes, self._saved = int(changed), 0  # commits counted; the count the last copy holds
        self._last = -math.inf  # time.monotonic() of the last try
        self._count = threading.Lock()
        self._one = threading.Lock()  # one copy at a time
        self._wake, self._stopped = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        if changed:
            self._wake.set()
        store.on_commit(self.changed)

    def changed(self) -> None:
        with self._count:
            self._changes += 1
        self._wake.set()

    @property
    def pending(self) -> bool:
        return self._changes != self._saved

    def backup(self) -> bool:
        """Take a copy now if anything changed since the last one; True when one was written. A failure is
        logged and leaves the change pending (the thread tries again an interval later)."""
        with self._one:
            seen = self._changes
            if seen == self._saved:
                return False
            self._last = time.monotonic()
            try:
                self._write_copy()
            except (OSError, sqlite3.Error) as e:
                log.warning("could not back up the database to %s: %s", self.target, e)
                return False
            self.taken += 1
            self._saved = seen
            return True

    def _write_copy(self) -> None:
        fd, snapshot = tempfile.mkstemp(prefix=DATABASE + ".", suffix=".snapshot", dir=os.path.dirname(self.store.path))
        os.close(fd)
        partial = self.target + ".partial"
        try:
            src = sqlite3.connect(self.store.path, timeout=30)
            try:
                dst = sqlite3.connect(snapshot)
                try:
                    src.backup(dst)
                finally:
                    dst.close()
            finally:
                src.close()
            _copy(snapshot, partial)
            os.replace(partial, self.target)
        except BaseException:
            _remove(partial)
            raise
        finally:
            _remove(snapshot, snapshot + "-journal")

    def start(self) -> Backup:
        self._thread = threading.Thread(target=self._run, name="database-backup", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait()
            self._wake.clear()
            wait = self._last + self.interval - time.monotonic()
            if (wait > 0 and self._stopped.wait(wait)) or self._stopped.is_set():
                return
            self.backup()

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop the thread and take a last copy if anything changed since the last one; True when one was."""
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.backup()


def open_database(data_dir: str | os.PathLike, local_dir: str | os.PathLike, mounts: str | None = None,
                  interval: float = 30.0) -> tuple[Store, Backup | None]:
    """The app's Store, where database_path puts it, and where that is not in `data_dir` (moved off a mount on
    which SQLite is not safe) its Backup in data_dir, started, after restoring from it where the database is
    gone. Where the database stays in data_dir: no backup. Logs what it does; the caller stops the Backup."""
    path, why = database_path(data_dir, local_dir, mounts)
    if why:
        log.warning("%s", why)
    data_dir = os.path.abspath(data_dir)
    if os.path.dirname(path) == data_dir:
        return Store(path), None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    restored, what = restore_database(path, os.path.join(data_dir, BACKUP))
    if what:
        log.warning("%s", what)
    store = Store(path)
    backup = Backup(store, os.path.join(data_dir, BACKUP), interval, changed=not restored).start()
    log.info("a copy of the database is kept at %s (at most every %g s, and at shutdown)", backup.target, interval)
    return store, backup
