"""Engine jobs from the reader's side: what a reading, a resume or a question needs checked before it is queued,
its place in the queue, and Stop. The queued jobs run in app/reading.py and app/answering.py."""
from __future__ import annotations

from engine import Settings

from . import worker
from .errors import UserError
from .records import Panel
from .render import duration


class Streams:
    """Service's part that queues, places and stops readings and answers (a job per session, in self.jobs)."""

    def queue_position(self, session_id: str) -> int:
        """How many engine jobs run or wait before this one."""
        return self.jobs.position(session_id)

    def release_tab(self, tab: str) -> list[str]:
        """Forget the jobs a closed (or disconnected) tab queued that have not begun (see JobQueue.release_tab)."""
        return self.jobs.release_tab(tab)

    def stop(self, owner: str, session_id: str) -> bool:
        """Ask the running (or queued) job of this session to stop; it ends within one forward pass."""
        self.owned_session(owner, session_id)
        return self.jobs.stop(session_id)

    def start_read(self, owner: str, document_id: int | None, question: str, settings: Settings,
                   tab: str | None = None) -> str:
        """Create the session for a new reading and queue it; returns its id. UserError if it can't start."""
        if not owner:
            raise UserError("The page is still loading; please try again in a moment.")
        doc = self.store.get_document(document_id) if document_id else None
        if doc is None:
            raise UserError("Please upload a document first.")
        question = (question or "").strip()
        if not question:
            raise UserError("Please type a question first: the margins are written with it in mind.")
        try:
            reading = self.layouts.open(doc, settings)
        except ValueError as e:  # DocumentTooLong included
            raise UserError(str(e)) from e
        self._fits_one_gpu_call(self.estimate_seconds(len(reading.doc.token_ids), len(reading.segments), settings))
        session_id = self.store.create_session(owner, document_id, question, self.model, settings,
                                               len(reading.segments))
        self.store.update_session(session_id, tokens=len(reading.doc.token_ids))
        self.store.mark_opened(session_id)
        self.jobs.enqueue(session_id, tab)
        return session_id

    def start_resume(self, owner: str, session_id: str, tab: str | None = None) -> str:
        session = self.owned_session(owner, session_id)
        if self.jobs.busy(session_id):
            raise UserError("This reading is already running.")
        if session["model"] and session["model"] != self.model:
            raise UserError(self.other_model(session, "Resume it"))
        if session["segments_read"] >= session["segments_total"]:
            raise UserError("This document has been read to the end already.")
        self._fits_one_gpu_call(self.read_estimate(session, self.store.margins(session_id)))
        self.jobs.enqueue(session_id, tab)
        self.store.mark_opened(session_id)
        return session_id

    def read_estimate(self, session: dict, kept: list[dict]) -> float:
        """Seconds of engine work to read the session's document, the margins in `kept` not written again."""
        segments = self.segments_of(session)
        return self.estimate_seconds(sum(s.tokens for s in segments), len(segments) - len(kept), session["settings"])

    def _fits_one_gpu_call(self, estimate_s: float) -> None:
        """On ZeroGPU a job runs in one GPU call, which the platform aborts past its duration: a job that cannot
        fit is refused before it starts, never cut off half-way."""
        if worker.ZERO_GPU and not worker.fits_one_call(estimate_s):
            raise UserError(
                f"This would take about {duration(estimate_s)} of GPU time, more than one GPU call on this "
                f"Space may run ({worker.GPU_MAX_SECONDS} s). Upload a shorter text (or one part of it), log in "
                "(a logged-in account gets more GPU time), or run Marginalia on your own machine (see the README).")

    def waiting(self, owner: str, session_id: str) -> Panel:
        """The panel of a queued job, with its place in the queue."""
        session = self.owned_session(owner, session_id)
        panel = self.panel_of(session, self.store.margins(session_id), self.segments_of(session))
        panel.status = "queued"
        ahead = self.queue_position(session_id)
        panel.message = ("Starting…" if ahead == 0 else
                         f"Waiting for the reader: {ahead} job{'s' if ahead != 1 else ''} ahead of you.")
        return panel

    def start_answer(self, owner: str, session_id: str | None, question: str, tab: str | None = None) -> dict:
        session = self.owned_session(owner, session_id)
        if session["model"] and session["model"] != self.model:
            raise UserError(self.other_model(session, "ask about it"))
        if self.jobs.busy(session_id):
            pass  # queued behind the reading: the answer uses the margins saved by then
        elif not self.store.margins(session_id):
            raise UserError("There are no margins yet: press Read (or Resume) first.")
        question = (question or "").strip() or session["question"]
        self.jobs.enqueue(session_id, tab)
        return {"session_id": session_id, "question": question}
