"""The answer stream: run a queued question in the engine slot from the margins kept, save the answer, and yield
what the answers panel shows as it is written (app/records.py's events)."""
from __future__ import annotations

import logging
import time
from typing import Iterator

from engine import Answer, AnswerToken, Notice, SegmentRead, Stats

from . import worker
from .records import AnswersChanged, Answered, AnswerView, JobEnded, Message, Update

log = logging.getLogger(__name__)

YIELD_EVERY_S = 0.1  # an answer's tokens repaint the answers at most this often


class AnswerStream:
    """Service's part that runs a queued question (see app/service.py for the state it shares)."""

    def answer_stream(self, owner: str, session_id: str, question: str) -> Iterator[Update]:
        session = self.owned_session(owner, session_id)
        stop = self.jobs.begin(session_id, "answer")
        try:
            if session["model"] and session["model"] != self.model:  # the model was switched while it waited
                yield Message(self.other_model(session, "ask about it"))
                return
            margins = self.store.margins(session_id)
            history = self.answer_views(session_id, margins)
            if not margins:
                yield Message("There are no margins yet: press Read (or Resume) first.")
                yield AnswersChanged(history)
                return
            current = AnswerView(question, pages=self._pages(margins), done=False)
            yield AnswersChanged([current, *history])
            yield Message("")
            yield from self._answer(session, margins, current, history, stop)
            self.jobs.end(session_id)
            session = self.store.get_session(session_id, owner)
            panel = self.panel_of(session, self.store.margins(session_id), self.segments_of(session))
            panel.used = set(current.used) if current.done and current.text else set()
            yield JobEnded(self.can_resume(session), session, panel, [current, *history])
        except Exception as e:
            log.exception("answering in session %s failed", session_id)
            yield Message(f"Answering failed: {e}")
        finally:
            self.jobs.end(session_id)

    @staticmethod
    def _pages(margins: list[dict]) -> dict:
        return {m["segment_index"]: (m["page_start"], m["page_end"]) if m["page_start"] is not None else None
                for m in margins}

    def _answer_job(self, session: dict, margins: list[dict], question: str) -> dict:
        """What the engine needs to answer `question` from the session's margins (see worker.engine_job)."""
        doc = self.store.get_document(session["document_id"])
        settings = session["settings"]
        cache_dir = self.cache_dir(session)
        return {"kind": "answer", "session_id": session["id"], "text": doc["text"], "page_starts": doc["page_starts"],
                "settings": settings, "segmented": self.layouts.segmented(doc, settings),
                "query": session["question"], "question": question,
                "skip": {m["segment_index"]: m["text"] for m in margins},
                "last": max(m["segment_index"] for m in margins),
                "selection": {m["segment_index"]: m["text"] for m in margins
                              if m["text"] and m["effective"] is not False},
                "cache_dir": cache_dir,
                # the question and the answer, and the document again if no saved cache will be found
                "estimate_s": (0 if cache_dir else self.read_estimate(session, margins))
                + self.estimate_seconds(len(question) // 3 + 200, 0, settings)
                + settings.answer_tokens / max(self.rates["decode"], 0.1)}  # the answer's room

    def _answer(self, session: dict, margins: list[dict], current: AnswerView, history: list[AnswerView],
                stop) -> Iterator[Update]:
        session_id = session["id"]
        job = self._answer_job(session, margins, current.question)
        started, last_yield = time.perf_counter(), 0.0
        for ev in worker.run(job, stop):
            if isinstance(ev, SegmentRead):
                current.note = (f"Loading the document into memory first (segment {ev.index + 1} of "
                                f"{job['last'] + 1})…")
                yield AnswersChanged([current, *history])
            elif isinstance(ev, AnswerToken):
                current.note = ""
                current.text = ev.text if ev.restart else current.text + ev.text
                if time.perf_counter() - last_yield >= YIELD_EVERY_S:
                    last_yield = time.perf_counter()
                    yield AnswersChanged([current, *history])
            elif isinstance(ev, Notice):
                current.note = ev.text
            elif isinstance(ev, Answer):
                current.text, current.used, current.done = ev.text, list(ev.margins_used), True
                current.reasoning, current.seconds = ev.reasoning, round(time.perf_counter() - started, 3)
                self.store.save_answer(session_id, current.question, ev.text, current.used, current.seconds,
                                       ev.reasoning)
                if session["status"] in ("read", "answered") or session["segments_read"] >= session["segments_total"]:
                    self.store.update_session(session_id, status="answered")
                yield Answered(current)
            elif isinstance(ev, Stats) and ev.stopped:
                current.done = True
                current.note = "Stopped before the answer was finished; nothing was saved."
