"""The reading stream: run a queued reading in the engine slot, save each margin the moment it is complete, and
yield what the panel shows as it goes (app/records.py's events)."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterator

from engine import Margin, MarginToken, Notice, SegmentRead, Stats, WindowStart
from engine.events import ServerRequest
from engine.saved import is_saved

from . import worker
from .records import Card, JobEnded, JobStarted, Message, Panel, PanelChanged, SegmentView, Update

log = logging.getLogger(__name__)

YIELD_EVERY_S = 0.1  # a margin's tokens repaint the panel at most this often


def _now() -> float:
    return time.perf_counter()


class ReadProgress:
    """What the panel shows while a reading runs: its cards as the margins are written, the segment read, the
    speed and the time left. Fed the engine's events one by one; each returns what changed on screen."""

    def __init__(self, panel: Panel, doc: dict, segments: list, skip: dict, work: list[float], estimate_s: float,
                 marks: Callable[[], dict]):
        self.panel, self.doc, self.segments, self.skip = panel, doc, segments, skip
        self.work, self.estimate_s, self.marks = work, estimate_s, marks
        self.started = _now()
        self.tokens = 0
        self.last_yield = 0.0
        self.sent = self.cached = 0  # prompt tokens sent to a server backend, and found in its prefix cache
        # The ETA, once a new segment is done: this reading's own rate (seconds per unit of work: reading a
        # segment and writing its margin) times the work left, each segment's work its tokens weighed by the
        # context they attend to (Models.segment_work). Margins kept from before are re-read, not written, and
        # cost less: the rate is measured from the first new segment on.
        self.new_from = self.started if not skip else None  # when the first new segment began
        self.new_left = sum(work[s.index] for s in segments if s.index not in skip)
        self.new_done = 0.0        # work of the new segments finished
        self.last_done_at = None   # when the last of them was finished

    def segment_view(self, index: int) -> SegmentView:
        seg = self.segments[index]
        return SegmentView(self.doc["text"], seg.char_start, seg.char_end, seg.index, len(self.segments), seg.pages,
                           seg.tokens, kind=self.doc["kind"])

    def shown(self, segment: SegmentView | None = None) -> PanelChanged:
        """The panel now, its ETA and the reader's marks brought up to date."""
        panel = self.panel
        elapsed = _now() - self.started
        panel.tokens_per_s = self.tokens / elapsed if elapsed > 0.5 and self.tokens else None
        if self.new_done and self.new_from is not None:
            rate = (self.last_done_at - self.new_from) / self.new_done
            panel.eta_s = max(rate * self.new_left - (_now() - self.last_done_at), 0)
        else:
            panel.eta_s = max(self.estimate_s - elapsed, 0)
        self.mark_cards()
        self.last_yield = _now()
        return PanelChanged(panel, segment)

    def mark_cards(self) -> None:
        for i, mark in self.marks().items():
            if i in self.panel.cards:
                self.panel.cards[i].mark = mark

    def segment_read(self, ev: SegmentRead) -> PanelChanged:
        panel, total = self.panel, len(self.segments)
        self.tokens += ev.tokens
        panel.read.add(ev.index)
        panel.current = ev.index
        if ev.index not in self.skip:
            panel.message = f"Writing the margin for segment {ev.index + 1} of {total}…"
            panel.cards[ev.index] = Card(ev.index, self.segments[ev.index].pages)
        else:
            self.new_from = _now()  # the segment after a kept margin begins now
            panel.message = f"Re-reading segment {ev.index + 1} of {total} (margin kept)…"
        return self.shown(self.segment_view(ev.index))

    def margin_token(self, ev: MarginToken) -> PanelChanged | None:
        self.tokens += 1
        card = self.panel.cards.setdefault(ev.index, Card(ev.index, self.segments[ev.index].pages))
        card.text += ev.text
        return self.shown() if _now() - self.last_yield >= YIELD_EVERY_S else None

    def margin(self, ev: Margin) -> PanelChanged:
        """A margin written (and saved by the caller): its card is done, and the engine reads the next segment."""
        panel, segments = self.panel, self.segments
        card = panel.cards.setdefault(ev.index, Card(ev.index, segments[ev.index].pages))
        card.text, card.verdict, card.score, card.done = ev.text, ev.relevant, ev.score, True
        if ev.index not in self.skip:
            self.new_done, self.new_left = self.new_done + self.work[ev.index], self.new_left - self.work[ev.index]
            self.last_done_at = _now()
        if len(panel.cards) == len(segments) and all(c.done for c in panel.cards.values()):
            panel.current, panel.message = None, "Saving the reading for follow-up questions…"
        if ev.index + 1 >= len(segments):
            return self.shown()
        panel.current = ev.index + 1  # the engine goes straight on to the next segment
        panel.message = f"Reading segment {ev.index + 2} of {len(segments)}…"
        return self.shown(self.segment_view(ev.index + 1))

    def server_request(self, ev: ServerRequest) -> None:
        self.sent, self.cached = self.sent + ev.prompt_tokens, self.cached + (ev.cached_tokens or 0)
        self.panel.reuse = self.cached / self.sent if self.sent else None

    def window_start(self, ev: WindowStart) -> PanelChanged:
        held = "its margin notes" if ev.reason.startswith("sliding") else f"{ev.carried_margins} margin note(s)"
        self.panel.window = ev.window
        self.panel.message = (f"New context window from segment {ev.first_segment + 1}: the text before it "
                              f"lives on in {held}.")
        return PanelChanged(self.panel)

    def ended(self, stopped: bool) -> str:
        """The engine's last event: the panel's final state; returns the session's status to store."""
        panel = self.panel
        for i in [i for i, c in panel.cards.items() if not c.done]:  # cut short by Stop, never saved
            del panel.cards[i]
        panel.current, panel.message, panel.eta_s = None, "", None
        self.mark_cards()
        complete = not stopped and all(i in panel.cards for i in range(len(self.segments)))
        panel.status = "done" if complete else "stopped"
        return "read" if complete else "stopped"


class ReadStream:
    """Service's part that runs a queued reading (see app/service.py for the state it shares)."""

    def read_stream(self, owner: str, session_id: str, resume: bool = False) -> Iterator[Update]:
        """Read the session's document (or resume it), yielding what the screen shows as margins are written."""
        session = self.owned_session(owner, session_id)
        stop = self.jobs.begin(session_id, "read")
        finished = False
        try:
            if session["model"] and session["model"] != self.model:  # the model was switched while it waited
                if resume or self.store.margins(session_id):
                    finished = True
                    yield Message(self.other_model(session, "resume it"))
                    yield JobEnded(True, session)
                    return
                self.store.update_session(session_id, model=self.model)  # nothing read yet: this model reads it
            yield from self._read(session, resume, stop)
            finished = True
        except Exception as e:  # a bug or an engine failure: keep what was saved, say what happened
            log.exception("reading session %s failed", session_id)
            self.store.update_session(session_id, status="error")
            finished = True
            yield Message(f"Reading failed: {e}. The margins written so far are saved; you can Resume.")
            yield JobEnded(True, self.store.get_session(session_id))
        finally:
            self.jobs.end(session_id)
            if not finished:  # the client went away mid-reading: leave it resumable
                stop.set()
                try:
                    self.store.update_session(session_id, status="stopped")
                except Exception:
                    log.exception("could not mark session %s stopped", session_id)

    def _read(self, session: dict, resume: bool, stop) -> Iterator[Update]:
        session_id, settings = session["id"], session["settings"]
        doc = self.store.get_document(session["document_id"])
        segmented = self.layouts.segmented(doc, settings)
        saved = self.store.margins(session_id) if resume else []
        with self.lock:
            self.live_marks[session_id] = {m["segment_index"]: m["mark"] for m in saved}
        panel = self.panel_of(session, saved, segmented.segments)
        panel.status, panel.message = "reading", ("Resuming…" if resume else "Starting…")
        panel.read = set()  # re-filled as the engine goes through the document again
        self.store.update_session(session_id, status="reading")
        yield JobStarted(panel)
        if stop.is_set():
            self.store.update_session(session_id, status="stopped")
            panel.status, panel.message = "stopped", ""
            yield JobEnded(True, self.store.get_session(session_id), panel)
            return
        skip = {m["segment_index"]: m["text"] for m in saved}
        job = {"kind": "read", "session_id": session_id, "text": doc["text"], "page_starts": doc["page_starts"],
               "settings": settings, "segmented": segmented, "query": session["question"], "skip": skip,
               "cache_dir": os.path.join(self.data_dir, "caches", session_id),
               "estimate_s": self.read_estimate(session, saved)}
        yield from self._drive_read(job, panel, doc, segmented.segments, stop)

    def _drive_read(self, job: dict, panel: Panel, doc: dict, segments: list, stop) -> Iterator[Update]:
        sid, settings = job["session_id"], job["settings"]
        estimate = self.estimate_seconds(sum(s.tokens for s in segments), len(segments) - len(job["skip"]), settings)

        def marks() -> dict:
            with self.lock:
                return dict(self.live_marks.get(sid, {}))

        progress = ReadProgress(panel, doc, segments, job["skip"], self.segment_work(segments, settings), estimate,
                                marks)
        for ev in worker.run(job, stop):
            if isinstance(ev, SegmentRead):
                yield progress.segment_read(ev)
            elif isinstance(ev, MarginToken):
                shown = progress.margin_token(ev)
                if shown is not None:
                    yield shown
            elif isinstance(ev, Margin):
                seg = segments[ev.index]
                pages = seg.pages or (None, None)
                self.store.save_margin(sid, ev.index, ev.text, ev.relevant, ev.score, seg.char_start, seg.char_end,
                                       pages[0], pages[1], ev.tokens, ev.seconds, ev.spans)
                yield progress.margin(ev)
            elif isinstance(ev, ServerRequest):
                progress.server_request(ev)
            elif isinstance(ev, Notice):
                yield Message(ev.text, "info")
            elif isinstance(ev, WindowStart):
                yield progress.window_start(ev)
            elif isinstance(ev, Stats):
                yield from self._read_ended(job, progress, ev)

    def _read_ended(self, job: dict, progress: ReadProgress, stats: Stats) -> Iterator[Update]:
        sid = job["session_id"]
        if not stats.stopped:
            self.learn_rates(stats, progress.estimate_s, _now() - progress.started)
        status = progress.ended(stats.stopped)
        reuse = {"server_prompt_tokens": progress.sent, "server_cached_tokens": progress.cached} if progress.sent \
            else {}
        # The worker saved a finished reading's cache before this event: recorded with "read", so a follow-up
        # finds it whichever process (or restart) runs it.
        if status == "read" and is_saved(job["cache_dir"]):
            reuse["cache_path"] = os.path.relpath(job["cache_dir"], self.data_dir)
        self.store.update_session(sid, status=status, **reuse)
        self.jobs.end(sid)  # before the last update, so the sessions list no longer says "reading"
        yield JobEnded(status != "read", self.store.get_session(sid), progress.panel)
