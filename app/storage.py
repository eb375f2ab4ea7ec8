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
survives a crash of the app (or the machine). Where the database file lives, and its copy where that is not
beside the data: app/database_home.py.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import sqlite3
import threading
import uuid
from typing import Any, Callable, Iterator

import sqlite_utils
from sqlite_utils.db import ForeignKey

from engine import Settings

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


@migration
def m006_answer_reasoning(db: sqlite_utils.Database) -> None:
    # What an answer said before its answer ("what the notes and the document say on the question"), shown
    # folded under it. NULL or "": an answer that did not reason first (plain reading, or one made before).
    db["answers"].add_column("reasoning", str)


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


def _settings(value: str | None) -> Settings:
    """A session's stored settings (a JSON object of Settings' fields) as the engine's Settings."""
    stored = _loads(value, {}) or {}
    if stored and "margins" not in stored:
        stored["margins"] = "abstractive"  # saved before margins had a style: they were free-form (resume alike)
    fields = Settings.__dataclass_fields__
    return Settings(**{k: v for k, v in stored.items() if k in fields})  # fields since removed are left out


# One write lock per database file, shared by every Store on that file in this process.
_WRITE_LOCKS: dict[str, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def _write_lock(path: str) -> threading.Lock:
    with _WRITE_LOCKS_GUARD:
        return _WRITE_LOCKS.setdefault(path, threading.Lock())


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
        """A connection of its own (a read uses it as it is; a write goes through _write)."""
        conn = sqlite3.connect(self.path, timeout=30)
        try:
            db = sqlite_utils.Database(conn, execute_plugins=False)
            db.execute("PRAGMA foreign_keys = ON")  # per connection, off by default in SQLite
            db.execute("PRAGMA synchronous = FULL")  # durable at commit, even in WAL mode
            yield db
        finally:
            conn.close()

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
        with self._connect() as db:
            rows = list(db.query("SELECT * FROM documents WHERE id = ?", [id]))
        if not rows:
            return None
        doc = rows[0]
        doc["page_starts"] = _loads(doc["page_starts"], None)
        return doc

    # -- sessions

    def create_session(self, owner: str, document_id: int, question: str, model: str,
                       settings: Settings, segments_total: int) -> str:
        session_id = str(uuid.uuid4())
        now = _now()
        with self._write() as db:
            db["sessions"].insert({
                "id": session_id, "owner": owner, "document_id": document_id,
                "question": question, "model": model, "settings": json.dumps(settings.to_dict()),
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
        row["settings"] = _settings(row["settings"])
        return row

    def get_session(self, id: str, owner: str | None = None) -> dict | None:
        """The session (its settings as Settings, plus title/document_name/margins_count/answers_count).

        With `owner`, a session belonging to someone else is None, exactly like a missing one.
        """
        with self._connect() as db:
            rows = list(db.query(self._SESSION_SELECT + " WHERE s.id = ?", [id]))
        if not rows or (owner is not None and rows[0]["owner"] != owner):
            return None
        return self._session_row(rows[0])

    def list_sessions(self, owner: str) -> list[dict]:
        """The owner's sessions, newest first, with the same keys as get_session."""
        with self._connect() as db:
            rows = list(db.query(
                self._SESSION_SELECT + " WHERE s.owner = ? ORDER BY s.created DESC, s.rowid DESC",
                [owner]))
        return [self._session_row(r) for r in rows]

    def library(self, owner: str) -> list[dict]:
        """The owner's sessions for the library, last opened first (a session never opened counts as opened
        when it was created), with its document's title/name/kind/pages, `kept` (finished margins with text
        that the reader or the classifier keeps) and `answers_count`."""
        with self._connect() as db:
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
            fields["settings"] = json.dumps(fields["settings"].to_dict())
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
        with self._connect() as db:
            rows = list(db.query(
                "SELECT * FROM margins WHERE session_id = ? ORDER BY segment_index", [session_id]))
        for row in rows:
            row["verdict"], row["mark"] = _flag(row["verdict"]), _flag(row["mark"])
            row["spans"] = [tuple(s) for s in _loads(row.get("spans"), [])]
            row["effective"] = row["mark"] if row["mark"] is not None else row["verdict"]
        return rows

    # -- answers

    def save_answer(self, session_id: str, question: str, text: str, margins_used: list[int],
                    seconds: float, reasoning: str = "") -> int:
        with self._write() as db:
            return db["answers"].insert({
                "session_id": session_id, "question": question, "text": text,
                "margins_used": json.dumps(list(margins_used or [])), "seconds": seconds,
                "created": _now(), "reasoning": reasoning or None,
            }).last_pk

    def answers(self, session_id: str) -> list[dict]:
        """Answers oldest first, margins_used decoded to a list of segment indexes."""
        with self._connect() as db:
            rows = list(db.query(
                "SELECT * FROM answers WHERE session_id = ? ORDER BY created, id", [session_id]))
        for row in rows:
            row["margins_used"] = _loads(row["margins_used"], [])
            row["reasoning"] = row.get("reasoning") or ""
        return rows
