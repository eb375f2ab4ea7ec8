"""Everything Marginalia keeps on disk, in one SQLite file.

All SQLite access of the app goes through this module (via sqlite-utils). The schema evolves through
numbered migrations kept the way simonw/llm keeps its `migrations.py`: functions registered in order
with `@migration`, each applied once, its name recorded in `_migrations`. Never edit a migration that
has shipped; append a new one (`m002_...`) instead.

Threading: Gradio runs handlers on a pool of worker threads, so `Store` opens a fresh connection
for every call and closes it afterwards. A shared connection would need a lock around reads too
(a connection's transaction state is shared, so one thread's BEGIN would swallow another's writes,
and sqlite-utils returns lazy generators), and per-thread connections would leak with the pool.
Opening a connection costs well under a millisecond; WAL lets readers run in parallel with the
writer. Writes take a process-wide lock per database file (queueing in Python instead of spinning on
SQLite's busy handler) and `BEGIN IMMEDIATE`, plus a busy timeout for any other process.

Durability: each write method commits before it returns, with synchronous=FULL, so a saved margin
survives a crash of the app (or the machine). Where the database had to leave a mount on which SQLite is not
safe for local disk (database_path), Backup keeps a copy of it on the mount, and restore_database puts it back
at start when a restart wiped the local disk (open_database does both).
"""
from __future__ import annotations

import bisect
import contextlib
import datetime
import json
import logging
import math
import os
import re
import shutil
import sqlite3
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import sqlite_utils
from sqlite_utils.db import ForeignKey

log = logging.getLogger(__name__)

KINDS = ("txt", "md", "pdf", "epub")
STATUSES = ("new", "reading", "stopped", "read", "answered", "error")

# ---------------------------------------------------------------- migrations

MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = []


def migration(fn: Callable[[sqlite_utils.Database], None]):
    """Register `fn` as the next migration; its __name__ is what `_migrations` records."""
    MIGRATIONS.append(fn)
    return fn


def migrate(db: sqlite_utils.Database, migrations: list | None = None) -> list[str]:
    """Apply the migrations not yet recorded, in order; return the names applied now.

    Each migration and its record commit together (SQLite DDL is transactional), so a crash
    mid-migration leaves it unapplied rather than half-applied. `migrations` exists for tests.
    """
    migrations = MIGRATIONS if migrations is None else migrations
    if not db["_migrations"].exists():
        db["_migrations"].create({"name": str, "applied_at": str}, pk="name", if_not_exists=True)
    applied_now = []
    for fn in migrations:
        # IMMEDIATE: a second process starting at the same time waits here, then sees the record.
        db.execute("BEGIN IMMEDIATE")
        try:
            if db.execute("SELECT 1 FROM _migrations WHERE name = ?", [fn.__name__]).fetchone():
                db.rollback()
                continue
            fn(db)
            db["_migrations"].insert({"name": fn.__name__, "applied_at": _now()})
            db.commit()
        except BaseException:
            db.rollback()
            raise
        applied_now.append(fn.__name__)
    return applied_now


@migration
def m001_initial(db: sqlite_utils.Database) -> None:
    db["documents"].create(
        {
            "id": int, "sha256": str, "name": str, "kind": str, "title": str,
            "pages": int, "chars": int, "text": str,
            "page_starts": str,  # JSON list of char offsets where each page starts, or NULL
            "created": str,
        },
        pk="id",
        not_null={"sha256", "name", "kind", "chars", "text", "created"},
    )
    db["documents"].create_index(["sha256"], unique=True)

    db["sessions"].create(
        {
            "id": str, "owner": str, "document_id": int, "question": str, "model": str,
            "settings": str,  # JSON object
            "status": str, "segments_total": int, "segments_read": int,
            "created": str, "updated": str,
        },
        pk="id",
        not_null={"owner", "document_id", "status", "created", "updated"},
        defaults={"status": "new", "segments_total": 0, "segments_read": 0, "settings": "{}"},
        # Documents are shared between sessions (dedupe on sha256), so no cascade here.
        foreign_keys=[("document_id", "documents", "id")],
    )
    db["sessions"].create_index(["owner", "created"])

    # Margins and answers belong to their session: deleting the session takes them along.
    db["margins"].create(
        {
            "id": int, "session_id": str, "segment_index": int,
            "char_start": int, "char_end": int, "page_start": int, "page_end": int,
            "text": str,
            "verdict": int,  # the classifier's: 1 relevant, 0 not, NULL no classifier
            "score": float,
            "mark": int,  # the reader's override: 1, 0 or NULL (no override)
            "tokens": int, "seconds": float, "created": str,
        },
        pk="id",
        not_null={"session_id", "segment_index", "text", "created"},
        defaults={"tokens": 0, "seconds": 0.0},
        foreign_keys=[ForeignKey("margins", "session_id", "sessions", "id", on_delete="CASCADE")],
    )
    db["margins"].create_index(["session_id", "segment_index"], unique=True)

    db["answers"].create(
        {
            "id": int, "session_id": str, "question": str, "text": str,
            "margins_used": str,  # JSON list of segment indexes
            "seconds": float, "created": str,
        },
        pk="id",
        not_null={"session_id", "text", "created"},
        foreign_keys=[ForeignKey("answers", "session_id", "sessions", "id", on_delete="CASCADE")],
    )
    db["answers"].create_index(["session_id"])


@migration
def m002_session_cache_path(db: sqlite_utils.Database) -> None:
    # Where a finished reading's KV cache was saved (a folder relative to the database's own), so a
    # follow-up question after a restart loads it instead of reading the document again. NULL: none.
    db["sessions"].add_column("cache_path", str)


@migration
def m003_margin_spans(db: sqlite_utils.Database) -> None:
    # The passages an extractive margin copied: a JSON list of [char_start, char_end] offsets into the
    # document's text, in the order the margin quotes them. NULL or []: a free-form margin, or nothing relevant.
    db["margins"].add_column("spans", str)


@migration
def m004_session_library(db: sqlite_utils.Database) -> None:
    # The library and "open where the reader left off": when the reader last opened the session (ISO time,
    # NULL: never since it was created), the segment whose passage they last looked at (NULL: none), and the
    # document's length in the session model's tokens (NULL for sessions made before this migration).
    db["sessions"].add_column("opened", str)
    db["sessions"].add_column("position", int)
    db["sessions"].add_column("tokens", int)


@migration
def m005_session_server_reuse(db: sqlite_utils.Database) -> None:
    # A reading through a model server (--backend openai): prompt tokens sent, and those the server reported
    # found in its prefix cache. Their ratio is the reading's reuse rate. NULL: read by the local engine.
    db["sessions"].add_column("server_prompt_tokens", int)
    db["sessions"].add_column("server_cached_tokens", int)


# ---------------------------------------------------------------- helpers


def _now() -> str:
    # Microseconds keep "newest first" stable for sessions created within the same second.
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def _bit(value: Any) -> int | None:
    """bool/int/None -> 1/0/None, the way verdict and mark are stored."""
    return None if value is None else int(bool(value))


def _flag(value: int | None) -> bool | None:
    return None if value is None else bool(value)


def _loads(value: str | None, default: Any) -> Any:
    return default if value is None else json.loads(value)


def _spans_out(doc: dict, margin: dict) -> list[dict]:
    """A margin's passages for the exports: offsets, pages and the text they cover. A margin that copied none
    is quoted by its whole segment (`whole`: true), as the passage view highlights it."""
    spans = margin["spans"] or []
    whole = not spans
    if whole:
        spans = [(margin["char_start"], margin["char_end"])] if margin["char_end"] is not None else []
    starts = doc.get("page_starts")
    out = []
    for start, end in spans:
        item = {"start": start, "end": end, "text": doc["text"][start:end], "whole_segment": whole}
        if starts:
            item["page_start"] = bisect.bisect_right(starts, start)
            item["page_end"] = bisect.bisect_right(starts, max(start, end - 1))
        out.append(item)
    return out


QUOTE_CHARS = 600  # a whole segment quoted in the Markdown export is cut here


def _quote(margin: dict) -> list[str]:
    """Markdown blockquote of the margin's passage(s), with their pages."""
    lines = []
    for span in margin["spans"]:
        text = " ".join(span["text"].split())
        if span["whole_segment"] and len(text) > QUOTE_CHARS:
            text = text[:QUOTE_CHARS].rsplit(" ", 1)[0] + " …"
        if "page_start" in span:
            pages = span["page_start"] if span["page_end"] == span["page_start"] else \
                f"{span['page_start']}–{span['page_end']}"
            text += f" (p. {pages})"
        if lines:
            lines.append(">")
        lines.append("> " + text)
    return lines


# One write lock per database file, shared by every Store on that file in this process.
_WRITE_LOCKS: dict[str, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def _write_lock(path: str) -> threading.Lock:
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(path, threading.Lock())


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


# ---------------------------------------------------------------- the store


class Store:
    """The app's database. Safe to share one instance across threads (see module docstring)."""

    _SESSION_FIELDS = {"question", "model", "settings", "status", "segments_total", "segments_read", "cache_path",
                       "opened", "position", "tokens", "server_prompt_tokens", "server_cached_tokens"}

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        self._lock = _write_lock(self.path)
        self._on_commit: list[Callable[[], None]] = []
        with self._lock, self._connect() as db:
            db.enable_wal()  # persistent in the file; needs no transaction, so done once here
            migrate(db)

    # -- connections

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite_utils.Database]:
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            db = sqlite_utils.Database(conn, execute_plugins=False)
            db.execute("PRAGMA foreign_keys = ON")  # per connection, off by default in SQLite
            db.execute("PRAGMA synchronous = FULL")  # durable at commit, even in WAL mode
            yield db
        finally:
            conn.close()

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite_utils.Database]:
        with self._connect() as db:
            yield db

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        """One transaction, committed before this returns; rolled back on any error."""
        with self._lock, self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.commit()
            except BaseException:
                db.rollback()
                raise
            changed = db.conn.total_changes > 0
        if changed:
            for fn in self._on_commit:
                fn()

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call `fn` after each write that committed a change (in the writer's thread: keep it short)."""
        self._on_commit.append(fn)

    # -- documents

    def add_document(self, name: str, kind: str, title: str, text: str, sha256: str,
                     page_starts: list[int] | None = None) -> int:
        """Store a document, or return the id of the one with the same sha256.

        `pages` is len(page_starts) (NULL without page_starts); `chars` is len(text).
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        with self._write() as db:
            row = db.execute("SELECT id FROM documents WHERE sha256 = ?", [sha256]).fetchone()
            if row:
                return row[0]
            return db["documents"].insert({
                "sha256": sha256, "name": name, "kind": kind, "title": title,
                "pages": len(page_starts) if page_starts else None, "chars": len(text), "text": text,
                "page_starts": json.dumps(page_starts) if page_starts is not None else None,
                "created": _now(),
            }).last_pk

    def get_document(self, id: int) -> dict | None:
        """The document with its full text, page_starts decoded (a list or None)."""
        with self._read() as db:
            rows = list(db.query("SELECT * FROM documents WHERE id = ?", [id]))
        if not rows:
            return None
        doc = rows[0]
        doc["page_starts"] = _loads(doc["page_starts"], None)
        return doc

    # -- sessions

    def create_session(self, owner: str, document_id: int, question: str, model: str,
                       settings: dict, segments_total: int) -> str:
        session_id = str(uuid.uuid4())
        now = _now()
        with self._write() as db:
            db["sessions"].insert({
                "id": session_id, "owner": owner, "document_id": document_id,
                "question": question, "model": model, "settings": json.dumps(settings or {}),
                "status": "new", "segments_total": segments_total, "segments_read": 0,
                "created": now, "updated": now,
            })
        return session_id

    _SESSION_SELECT = """
        SELECT s.*, d.title AS title, d.name AS document_name, d.kind AS document_kind,
               (SELECT count(*) FROM margins m WHERE m.session_id = s.id) AS margins_count,
               (SELECT count(*) FROM answers a WHERE a.session_id = s.id) AS answers_count
        FROM sessions s JOIN documents d ON d.id = s.document_id
    """

    @staticmethod
    def _session_row(row: dict) -> dict:
        row["settings"] = _loads(row["settings"], {})
        return row

    def get_session(self, id: str, owner: str | None = None) -> dict | None:
        """The session (settings decoded, plus title/document_name/margins_count/answers_count).

        With `owner`, a session belonging to someone else is None, exactly like a missing one.
        """
        with self._read() as db:
            rows = list(db.query(self._SESSION_SELECT + " WHERE s.id = ?", [id]))
        if not rows or (owner is not None and rows[0]["owner"] != owner):
            return None
        return self._session_row(rows[0])

    def list_sessions(self, owner: str) -> list[dict]:
        """The owner's sessions, newest first, with the same keys as get_session."""
        with self._read() as db:
            rows = list(db.query(
                self._SESSION_SELECT + " WHERE s.owner = ? ORDER BY s.created DESC, s.rowid DESC",
                [owner]))
        return [self._session_row(r) for r in rows]

    def library(self, owner: str) -> list[dict]:
        """The owner's sessions for the library, last opened first (a session never opened counts as opened
        when it was created), with its document's title/name/kind/pages, `kept` (finished margins with text
        that the reader or the classifier keeps) and `answers_count`."""
        with self._read() as db:
            return list(db.query(
                """SELECT s.id, s.document_id, s.question, s.model, s.status, s.segments_total, s.segments_read,
                          s.created, s.updated, s.tokens, s.position, COALESCE(s.opened, s.created) AS opened,
                          d.title, d.name AS document_name, d.kind, d.pages, d.chars,
                          (SELECT count(*) FROM margins m WHERE m.session_id = s.id AND m.text != ''
                              AND COALESCE(m.mark, m.verdict, 1) = 1) AS kept,
                          (SELECT count(*) FROM answers a WHERE a.session_id = s.id) AS answers_count
                   FROM sessions s JOIN documents d ON d.id = s.document_id
                   WHERE s.owner = ? ORDER BY COALESCE(s.opened, s.created) DESC, s.rowid DESC""", [owner]))

    def update_session(self, id: str, **fields: Any) -> None:
        """Set some of question/model/settings/status/segments_total/segments_read/cache_path/opened/position/
        tokens/server_prompt_tokens/server_cached_tokens; bumps `updated`."""
        unknown = set(fields) - self._SESSION_FIELDS
        if unknown:
            raise ValueError(f"cannot update session fields {sorted(unknown)}")
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {fields['status']!r}")
        if "settings" in fields:
            fields["settings"] = json.dumps(fields["settings"] or {})
        fields["updated"] = _now()
        with self._write() as db:
            db["sessions"].update(id, fields)  # raises NotFoundError for an unknown id

    def mark_opened(self, id: str, position: int | None = None) -> None:
        """The reader opened this session now (and looked at segment `position`'s passage, if given).
        Looking is not changing: `updated` stays as it is."""
        with self._write() as db:
            if position is None:
                db.execute("UPDATE sessions SET opened = ? WHERE id = ?", [_now(), id])
            else:
                db.execute("UPDATE sessions SET opened = ?, position = ? WHERE id = ?", [_now(), int(position), id])

    def delete_session(self, id: str, owner: str) -> bool:
        """Delete the owner's session with its margins and answers; False if not theirs/absent."""
        with self._write() as db:
            cursor = db.execute("DELETE FROM sessions WHERE id = ? AND owner = ?", [id, owner])
            return cursor.rowcount > 0

    # -- margins

    def save_margin(self, session_id: str, segment_index: int, text: str, verdict: bool | None,
                    score: float | None, char_start: int, char_end: int,
                    page_start: int | None = None, page_end: int | None = None,
                    tokens: int = 0, seconds: float = 0.0,
                    spans: list[tuple[int, int]] | tuple = ()) -> None:
        """Insert or replace the margin for this segment, keeping any mark the reader set.
        `spans`: the document passages the margin copied, as (char_start, char_end) pairs.

        Also sets sessions.segments_read to the number of margins, in the same transaction.
        """
        now = _now()
        with self._write() as db:
            # Hand-written upsert: the conflict target is (session_id, segment_index), not the pk,
            # and `mark` and `created` must survive a re-read of the segment.
            db.execute(
                """INSERT INTO margins (session_id, segment_index, char_start, char_end, page_start,
                       page_end, text, verdict, score, mark, tokens, seconds, spans, created)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?, ?)
                   ON CONFLICT (session_id, segment_index) DO UPDATE SET
                       char_start = excluded.char_start, char_end = excluded.char_end,
                       page_start = excluded.page_start, page_end = excluded.page_end,
                       text = excluded.text, verdict = excluded.verdict, score = excluded.score,
                       tokens = excluded.tokens, seconds = excluded.seconds, spans = excluded.spans""",
                [session_id, segment_index, char_start, char_end, page_start, page_end, text,
                 _bit(verdict), score, tokens, seconds, json.dumps([list(s) for s in spans]), now],
            )
            db.execute(
                """UPDATE sessions SET updated = ?,
                       segments_read = (SELECT count(*) FROM margins WHERE session_id = ?)
                   WHERE id = ?""",
                [now, session_id, session_id],
            )

    def set_mark(self, session_id: str, segment_index: int, mark: bool | None) -> bool:
        """The reader's override for one margin (None clears it). False if there is no such margin."""
        with self._write() as db:
            cursor = db.execute(
                "UPDATE margins SET mark = ? WHERE session_id = ? AND segment_index = ?",
                [_bit(mark), session_id, segment_index])
            if cursor.rowcount:
                db.execute("UPDATE sessions SET updated = ? WHERE id = ?", [_now(), session_id])
            return cursor.rowcount > 0

    def margins(self, session_id: str) -> list[dict]:
        """Margins by segment_index; verdict/mark/effective as True/False/None.

        effective = mark if the reader set one, else the classifier's verdict.
        """
        with self._read() as db:
            rows = list(db.query(
                "SELECT * FROM margins WHERE session_id = ? ORDER BY segment_index", [session_id]))
        for row in rows:
            row["verdict"], row["mark"] = _flag(row["verdict"]), _flag(row["mark"])
            row["spans"] = [tuple(s) for s in _loads(row.get("spans"), [])]
            row["effective"] = row["mark"] if row["mark"] is not None else row["verdict"]
        return rows

    # -- answers

    def save_answer(self, session_id: str, question: str, text: str, margins_used: list[int],
                    seconds: float) -> int:
        with self._write() as db:
            return db["answers"].insert({
                "session_id": session_id, "question": question, "text": text,
                "margins_used": json.dumps(list(margins_used or [])), "seconds": seconds,
                "created": _now(),
            }).last_pk

    def answers(self, session_id: str) -> list[dict]:
        """Answers oldest first, margins_used decoded to a list of segment indexes."""
        with self._read() as db:
            rows = list(db.query(
                "SELECT * FROM answers WHERE session_id = ? ORDER BY created, id", [session_id]))
        for row in rows:
            row["margins_used"] = _loads(row["margins_used"], [])
        return rows

    # -- export

    def export_json(self, session_id: str, owner: str | None = None) -> dict:
        """Everything about one session, JSON-serialisable. KeyError if absent (or not owner's)."""
        session = self.get_session(session_id, owner)
        if session is None:
            raise KeyError(session_id)
        doc = self.get_document(session["document_id"])
        return {
            "format": "marginalia/1",
            "document": {k: doc[k] for k in ("title", "name", "kind", "pages", "chars", "sha256")},
            "question": session["question"],
            "model": session["model"],
            "settings": session["settings"],
            "status": session["status"],
            "segments_total": session["segments_total"],
            "segments_read": session["segments_read"],
            "created": session["created"],
            "updated": session["updated"],
            "margins": [
                {**{k: m[k] for k in ("segment_index", "char_start", "char_end", "page_start",
                                      "page_end", "text", "verdict", "score", "mark", "effective")},
                 "spans": _spans_out(doc, m)}
                for m in self.margins(session_id)
            ],
            "answers": [
                {k: a[k] for k in ("question", "text", "margins_used", "seconds", "created")}
                for a in self.answers(session_id)
            ],
        }

    def export_markdown(self, session_id: str, owner: str | None = None) -> str:
        """A readable report: answers first, then every margin note with its verdict and pages."""
        data = self.export_json(session_id, owner)
        doc = data["document"]
        out = [f"# {doc['title'] or doc['name']}", ""]
        if data["question"]:
            out += [f"**Question:** {data['question']}", ""]
        out += [f"*{doc['name']} · model {data['model']} · {data['segments_read']}/"
                f"{data['segments_total']} segments read · {data['status']}*", ""]
        if data["answers"]:
            out += ["## Answers", ""]
            for a in data["answers"]:
                out += [f"### {a['question']}", "", a["text"], ""]
                if a["margins_used"]:
                    out += [f"*Margins used: segments {', '.join(str(i + 1) for i in a['margins_used'])}*", ""]
        out += ["## Margin notes", ""]
        for m in data["margins"]:
            head = f"### Segment {m['segment_index'] + 1}"
            if m["page_start"] is not None:
                pages = m["page_start"] if m["page_end"] in (None, m["page_start"]) \
                    else f"{m['page_start']}–{m['page_end']}"
                head += f" · p. {pages}"
            if m["effective"] is not None:
                head += " · relevant" if m["effective"] else " · not relevant"
                if m["mark"] is not None:
                    head += " (reader)"
                elif m["score"] is not None:
                    head += f" ({m['score']:.2f})"
            out += [head, "", m["text"], "", *_quote(m), ""]
        out += ["## Settings", "", "```json", json.dumps(data["settings"], indent=2, sort_keys=True),
                "```", ""]
        return "\n".join(out)
