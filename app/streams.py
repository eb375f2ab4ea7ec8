"""The reading and answering streams: queue a job, then run it in the engine slot, yielding screen updates and
saving each margin and answer the moment it is complete."""
from __future__ import annotations

import logging
import os
import time
from typing import Iterator

from engine.events import Answer, AnswerToken, Margin, MarginToken, Notice, SegmentRead, ServerRequest, Stats, \
    WindowStart
from engine.saved import SAVED
from engine.wim import Settings

from . import render, worker
from .errors import UserError
from .render import AnswerView, Card, Panel

log = logging.getLogger(__name__)

Update = dict  # keys: panel, segment, answers, sessions, notice, resume (each an HTML string or value)


def _now() -> float:
    return time.perf_counter()


class Streams:
    """Service's part that starts, stops and runs readings and answers (a job per session, in self.jobs)."""

    def queue_position(self, session_id: str) -> int:
        """How many engine jobs run or wait before this one."""
        return self.jobs.position(session_id)

    def release_tab(self, tab: str) -> list[str]:
        """Forget the jobs a closed (or disconnected) tab queued that have not begun (see JobQueue.release_tab)."""
        return self.jobs.release_tab(tab)

    def stop(self, owner: str, session_id: str) -> bool:
        """Ask the running (or queued) job of this session to stop; it ends within one forward pass."""
        self._session(owner, session_id)
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
            reading = self._open(doc, settings)
        except ValueError as e:  # DocumentTooLong included
            raise UserError(str(e)) from e
        self._fits_one_gpu_call(self.estimate_seconds(len(reading.doc.token_ids), len(reading.segments), settings))
        session_id = self.store.create_session(owner, document_id, question, self.model, settings.to_dict(),
                                               len(reading.segments))
        self.store.update_session(session_id, tokens=len(reading.doc.token_ids))
        self.store.mark_opened(session_id)
        with self._lock:
            self._segments[session_id] = reading.segments
        self.jobs.enqueue(session_id, tab)
        return session_id

    def start_resume(self, owner: str, session_id: str, tab: str | None = None) -> str:
        session = self._session(owner, session_id)
        if self.jobs.busy(session_id):
            raise UserError("This reading is already running.")
        if session["model"] and session["model"] != self.model:
            raise UserError(self._other_model(session, "Resume it"))
        if session["segments_read"] >= session["segments_total"]:
            raise UserError("This document has been read to the end already.")
        self._fits_one_gpu_call(self._read_estimate(session, self.store.margins(session_id)))
        self.jobs.enqueue(session_id, tab)
        self.store.mark_opened(session_id)
        return session_id

    def _read_estimate(self, session: dict, kept: list[dict]) -> float:
        """Seconds of engine work to read the session's document, the margins in `kept` not written again."""
        segments = self._segments_of(session)
        return self.estimate_seconds(sum(s.tokens for s in segments), len(segments) - len(kept),
                                     worker.settings_from(session["settings"]))

    def _fits_one_gpu_call(self, estimate_s: float) -> None:
        """On ZeroGPU a job runs in one GPU call, which the platform aborts past its duration: a job that cannot
        fit is refused before it starts, never cut off half-way."""
        if worker.ZERO_GPU and not worker.fits_one_call(estimate_s):
            raise UserError(
                f"This would take about {render.duration(estimate_s)} of GPU time, more than one GPU call on this "
                f"Space may run ({worker.GPU_MAX_SECONDS} s). Upload a shorter text (or one part of it), log in "
                "(a logged-in account gets more GPU time), or run Marginalia on your own machine (see the README).")

    def waiting_panel(self, owner: str, session_id: str) -> str:
        session = self._session(owner, session_id)
        margins = self.store.margins(session_id)
        panel = self._panel(session, margins, self._segments_of(session))
        panel.status = "queued"
        ahead = self.queue_position(session_id)
        panel.message = ("Starting…" if ahead == 0 else
                         f"Waiting for the reader: {ahead} job{'s' if ahead != 1 else ''} ahead of you.")
        return render.panel_html(panel)

    def read_stream(self, owner: str, session_id: str, resume: bool = False) -> Iterator[Update]:
        """Read the session's document (or resume it), yielding screen updates as margins are written."""
        session = self._session(owner, session_id)
        doc = self.store.get_document(session["document_id"])
        settings = worker.settings_from(session["settings"])
        segments = self._segments_of(session, doc)
        stop = self.jobs.begin(session_id, "read")
        finished = False
        try:
            if session["model"] and session["model"] != self.model:  # the model was switched while it waited
                if resume or self.store.margins(session_id):
                    finished = True
                    yield {"notice": render.notice_html(self._other_model(session, "resume it")), "resume": True,
                           "sessions": True}
                    return
                self.store.update_session(session_id, model=self.model)  # nothing read yet: this model reads it
            saved = self.store.margins(session_id) if resume else []
            with self._lock:
                self._marks[session_id] = {m["segment_index"]: m["mark"] for m in saved}
            panel = self._panel(session, saved, segments)
            panel.status, panel.message = "reading", ("Resuming…" if resume else "Starting…")
            panel.read = set()  # re-filled as the engine goes through the document again
            self.store.update_session(session_id, status="reading")
            yield {"panel": render.panel_html(panel), "resume": False}
            if stop.is_set():
                self.store.update_session(session_id, status="stopped")
                panel.status, panel.message = "stopped", ""
                finished = True
                yield {"panel": render.panel_html(panel), "resume": True, "sessions": True}
                return
            skip = {m["segment_index"]: m["text"] for m in saved}
            job = {"kind": "read", "session_id": session_id, "text": doc["text"], "page_starts": doc["page_starts"],
                   "settings": settings.to_dict(), "query": session["question"], "skip": skip,
                   "cache_dir": os.path.join(self.data_dir, "caches", session_id),
                   "estimate_s": self._read_estimate(session, saved)}
            yield from self._drive_read(job, panel, segments, doc, settings, stop, len(skip))
            finished = True
        except Exception as e:  # a bug or an engine failure: keep what was saved, say what happened
            log.exception("reading session %s failed", session_id)
            self.store.update_session(session_id, status="error")
            finished = True
            yield {"notice": render.notice_html(f"Reading failed: {e}. The margins written so far are saved; "
                                                "you can Resume."), "resume": True, "sessions": True}
        finally:
            self.jobs.end(session_id)
            if not finished:  # the client went away mid-reading: leave it resumable
                stop.set()
                try:
                    self.store.update_session(session_id, status="stopped")
                except Exception:
                    log.exception("could not mark session %s stopped", session_id)

    def _drive_read(self, job, panel: Panel, segments, doc, settings: Settings, stop, skipped: int):
        sid = job["session_id"]
        started = _now()
        tokens = 0
        last_yield = 0.0
        sent = cached = 0  # prompt tokens sent to a server backend, and found in its prefix cache
        estimate = self.estimate_seconds(sum(s.tokens for s in segments), len(segments) - skipped, settings)
        # The ETA, once a new segment is done: this reading's own rate (seconds per unit of work: reading a
        # segment and writing its margin) times the work left, each segment's work its tokens weighed by the
        # context they attend to (segment_work). Margins kept from before are re-read, not written, and cost
        # less: the rate is measured from the first new segment on.
        work = self.segment_work(segments, settings)
        new_from = started if not skipped else None  # when the first new segment began
        new_left = sum(work[s.index] for s in segments if s.index not in job["skip"])
        new_done = 0.0        # work of the new segments finished
        last_done_at = None   # when the last of them was finished

        def refresh_eta():
            elapsed = _now() - started
            panel.tokens_per_s = tokens / elapsed if elapsed > 0.5 and tokens else None
            if new_done and new_from is not None:
                rate = (last_done_at - new_from) / new_done
                panel.eta_s = max(rate * new_left - (_now() - last_done_at), 0)
            else:
                panel.eta_s = max(estimate - elapsed, 0)

        def marks():
            with self._lock:
                for i, mark in self._marks.get(sid, {}).items():
                    if i in panel.cards:
                        panel.cards[i].mark = mark

        for ev in worker.run(job, stop):
            if isinstance(ev, SegmentRead):
                tokens += ev.tokens
                panel.read.add(ev.index)
                panel.current = ev.index
                seg = segments[ev.index]
                if ev.index not in job["skip"]:
                    panel.message = f"Writing the margin for segment {ev.index + 1} of {len(segments)}…"
                    panel.cards[ev.index] = Card(ev.index, seg.pages)
                else:
                    new_from = _now()  # the segment after a kept margin begins now
                    panel.message = f"Re-reading segment {ev.index + 1} of {len(segments)} (margin kept)…"
                refresh_eta()
                marks()
                last_yield = _now()
                yield {"panel": render.panel_html(panel),
                       "segment": render.segment_html(doc["text"], seg.char_start, seg.char_end, seg.index,
                                                      len(segments), seg.pages, seg.tokens, kind=doc["kind"])}
            elif isinstance(ev, MarginToken):
                tokens += 1
                card = panel.cards.setdefault(ev.index, Card(ev.index, segments[ev.index].pages))
                card.text += ev.text
                if _now() - last_yield >= 0.1:
                    refresh_eta()
                    marks()
                    last_yield = _now()
                    yield {"panel": render.panel_html(panel)}
            elif isinstance(ev, Margin):
                seg = segments[ev.index]
                pages = seg.pages or (None, None)
                self.store.save_margin(sid, ev.index, ev.text, ev.relevant, ev.score, seg.char_start, seg.char_end,
                                       pages[0], pages[1], ev.tokens, ev.seconds, ev.spans)
                card = panel.cards.setdefault(ev.index, Card(ev.index, seg.pages))
                card.text, card.verdict, card.score, card.done = ev.text, ev.relevant, ev.score, True
                if ev.index not in job["skip"]:
                    new_done, new_left, last_done_at = new_done + work[ev.index], new_left - work[ev.index], _now()
                update = {}
                if len(panel.cards) == len(segments) and all(c.done for c in panel.cards.values()):
                    panel.current, panel.message = None, "Saving the reading for follow-up questions…"
                if ev.index + 1 < len(segments):  # the engine goes straight on to the next segment
                    nxt = segments[ev.index + 1]
                    panel.current = nxt.index
                    panel.message = f"Reading segment {nxt.index + 1} of {len(segments)}…"
                    update["segment"] = render.segment_html(doc["text"], nxt.char_start, nxt.char_end, nxt.index,
                                                            len(segments), nxt.pages, nxt.tokens,
                                                            kind=doc["kind"])
                refresh_eta()
                marks()
                last_yield = _now()
                yield {"panel": render.panel_html(panel), **update}
            elif isinstance(ev, ServerRequest):
                sent, cached = sent + ev.prompt_tokens, cached + (ev.cached_tokens or 0)
                panel.reuse = cached / sent if sent else None
            elif isinstance(ev, Notice):
                yield {"notice": render.notice_html(ev.text, "info")}
            elif isinstance(ev, WindowStart):
                held = ("its margin notes" if ev.reason.startswith("sliding")
                        else f"{ev.carried_margins} margin note(s)")
                panel.window = ev.window
                panel.message = (f"New context window from segment {ev.first_segment + 1}: the text before it "
                                 f"lives on in {held}.")
                yield {"panel": render.panel_html(panel)}
            elif isinstance(ev, Stats):
                # A margin cut short by Stop was never saved: drop its card.
                for i in [i for i, c in panel.cards.items() if not c.done]:
                    del panel.cards[i]
                panel.current = None
                marks()
                if ev.stopped:
                    status, panel.status = "stopped", "stopped"
                else:
                    self._learn_rates(ev, estimate, _now() - started)
                    complete = all(i in panel.cards for i in range(len(segments)))
                    status, panel.status = ("read", "done") if complete else ("stopped", "stopped")
                reuse = {"server_prompt_tokens": sent, "server_cached_tokens": cached} if sent else {}
                # The worker saved a finished reading's cache before this event: recorded with "read", so a
                # follow-up finds it whichever process (or restart) runs it.
                if panel.status == "done" and os.path.exists(os.path.join(job["cache_dir"], SAVED)):
                    reuse["cache_path"] = os.path.relpath(job["cache_dir"], self.data_dir)
                self.store.update_session(sid, status=status, **reuse)
                self.jobs.end(sid)  # before the last update, so the sessions list no longer says "reading"
                panel.message, panel.eta_s = "", None
                yield {"panel": render.panel_html(panel), "resume": panel.status != "done", "sessions": True}

    def start_answer(self, owner: str, session_id: str | None, question: str, tab: str | None = None) -> dict:
        session = self._session(owner, session_id)
        if session["model"] and session["model"] != self.model:
            raise UserError(self._other_model(session, "ask about it"))
        if self.jobs.busy(session_id):
            pass  # queued behind the reading: the answer uses the margins saved by then
        elif not self.store.margins(session_id):
            raise UserError("There are no margins yet: press Read (or Resume) first.")
        question = (question or "").strip() or session["question"]
        self.jobs.enqueue(session_id, tab)
        return {"session_id": session_id, "question": question}

    def answer_stream(self, owner: str, session_id: str, question: str) -> Iterator[Update]:
        session = self._session(owner, session_id)
        doc = self.store.get_document(session["document_id"])
        settings = worker.settings_from(session["settings"])
        stop = self.jobs.begin(session_id, "answer")
        try:
            if session["model"] and session["model"] != self.model:  # the model was switched while it waited
                yield {"notice": render.notice_html(self._other_model(session, "ask about it"))}
                return
            margins = self.store.margins(session_id)
            history = self._answer_views(session_id, margins)
            if not margins:
                yield {"notice": render.notice_html("There are no margins yet: press Read (or Resume) first."),
                       "answers": render.answers_html(history)}
                return
            pages = {m["segment_index"]: (m["page_start"], m["page_end"]) if m["page_start"] is not None else None
                     for m in margins}
            selection = {m["segment_index"]: m["text"] for m in margins if m["text"] and m["effective"] is not False}
            current = AnswerView(question, pages=pages, done=False)
            yield {"answers": render.answers_html([current, *history]), "notice": ""}
            job = {"kind": "answer", "session_id": session_id, "text": doc["text"],
                   "page_starts": doc["page_starts"], "settings": settings.to_dict(), "query": session["question"],
                   "question": question, "skip": {m["segment_index"]: m["text"] for m in margins},
                   "last": max(m["segment_index"] for m in margins), "selection": selection,
                   "cache_dir": self._cache_dir(session),
                   # the question and the answer, and the document again if no saved cache will be found
                   "estimate_s": (0 if self._cache_dir(session) else self._read_estimate(session, margins))
                   + self.estimate_seconds(len(question) // 3 + 200, 0, settings)
                   # the answer's room, and the reasoning's before it where the settings ask for one
                   + (settings.answer_tokens + settings.reasoning_tokens) / max(self.rates["decode"], 0.1)}
            started, last_yield = _now(), 0.0
            for ev in worker.run(job, stop):
                if isinstance(ev, SegmentRead):
                    current.note = (f"Loading the document into memory first (segment {ev.index + 1} of "
                                    f"{job['last'] + 1})…")
                    yield {"answers": render.answers_html([current, *history])}
                elif isinstance(ev, AnswerToken):
                    current.note = ""
                    current.text = ev.text if ev.restart else current.text + ev.text
                    if _now() - last_yield >= 0.1:
                        last_yield = _now()
                        yield {"answers": render.answers_html([current, *history])}
                elif isinstance(ev, Notice):
                    current.note = ev.text
                elif isinstance(ev, Answer):
                    current.text, current.used, current.done = ev.text, list(ev.margins_used), True
                    current.reasoning, current.seconds = ev.reasoning, _now() - started
                    self.store.save_answer(session_id, question, ev.text, current.used, round(current.seconds, 3),
                                           ev.reasoning)
                    if session["status"] in ("read", "answered") or session["segments_read"] >= session["segments_total"]:
                        self.store.update_session(session_id, status="answered")
                elif isinstance(ev, Stats) and ev.stopped:
                    current.done = True
                    current.note = "Stopped before the answer was finished; nothing was saved."
            self.jobs.end(session_id)
            session = self.store.get_session(session_id, owner)
            panel = self._panel(session, self.store.margins(session_id), self._segments_of(session, doc))
            panel.used = set(current.used) if current.done and current.text else set()
            yield {"answers": render.answers_html([current, *history]), "panel": render.panel_html(panel),
                   "sessions": True, "resume": self.can_resume(session)}
        except Exception as e:
            log.exception("answering in session %s failed", session_id)
            yield {"notice": render.notice_html(f"Answering failed: {e}")}
        finally:
            self.jobs.end(session_id)
