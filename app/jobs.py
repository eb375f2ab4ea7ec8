"""The engine's job queue: which sessions' jobs wait and which run, in order, each with the stop flag Stop sets."""
from __future__ import annotations

import threading


class JobQueue:
    """Engine jobs (readings and answers) by session id. The jobs themselves run in Gradio's engine slot; this
    keeps what the screen says of them (queued, reading, answering, places ahead) and the flags that stop them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stops: dict[str, threading.Event] = {}
        self._active: dict[str, str] = {}       # session id -> "read" | "answer", while its job runs
        # Jobs queued, oldest first: (session id, the browser tab that queued it, for release_tab).
        self.waiting: list[tuple[str, str | None]] = []

    def running(self, session_id: str) -> str | None:
        """"read" or "answer" while a job of this session runs, else None."""
        return self._active.get(session_id)

    def any_running(self) -> bool:
        return bool(self._active)

    def queued(self, session_id: str) -> bool:
        return any(sid == session_id for sid, _ in self.waiting)

    def busy(self, session_id: str) -> bool:
        """A job of this session runs or waits."""
        return session_id in self._active or self.queued(session_id)

    def sessions(self) -> set[str]:
        """Every session with a job running or waiting."""
        with self._lock:
            return set(self._active) | {sid for sid, _ in self.waiting}

    def position(self, session_id: str) -> int:
        """How many engine jobs run or wait before this one."""
        with self._lock:
            queued = [sid for sid, _ in self.waiting]
            ahead = queued.index(session_id) if session_id in queued else len(queued)
            return ahead + len(self._active)

    def enqueue(self, session_id: str, tab: str | None = None) -> threading.Event:
        """Note a job queued for this session (by browser tab `tab`, if a tab queued it). Jobs of one session
        share a stop flag, so Stop ends the reading and an answer queued behind it; a flag already set (a job
        stopping) is not reused."""
        with self._lock:
            busy = session_id in self._active or self.queued(session_id)
            stop = self._stops.get(session_id)
            if stop is None or stop.is_set() or not busy:
                stop = self._stops[session_id] = threading.Event()
            self.waiting.append((session_id, tab))
            return stop

    def begin(self, session_id: str, kind: str) -> threading.Event:
        with self._lock:
            # A session's jobs run in the order they were queued: this is its oldest.
            first = next((k for k, (sid, _) in enumerate(self.waiting) if sid == session_id), None)
            if first is not None:
                del self.waiting[first]
            self._active[session_id] = kind
            return self._stops.setdefault(session_id, threading.Event())

    def end(self, session_id: str) -> None:
        with self._lock:
            self._active.pop(session_id, None)

    def release_tab(self, tab: str) -> list[str]:
        """Forget the jobs a closed (or disconnected) tab queued that have not begun. Gradio drops a tab's
        queued events when its connection goes, so those jobs never run; left in the queue, their sessions
        would show "queued" and refuse Resume until a restart, and every other reader would count them ahead."""
        with self._lock:
            gone = list(dict.fromkeys(sid for sid, t in self.waiting if t == tab))
            self.waiting = [(sid, t) for sid, t in self.waiting if t != tab]
        return gone

    def stop(self, session_id: str) -> bool:
        """Set the stop flag of this session's running (or queued) job; False if it has none."""
        stop = self._stops.get(session_id)
        if stop is None or not self.busy(session_id):
            return False
        stop.set()
        return True
