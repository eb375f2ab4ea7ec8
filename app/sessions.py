"""The library and its sessions: listing, opening (as app/records.py records), marks, export and delete, each for
its owner only."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

from . import exports, worker
from .errors import UserError
from .records import AnswerView, Card, LibraryView, Panel, Passage, SegmentInfo, SegmentView, SessionView

ACCOUNT = "hf:"  # the owner of a logged-in account's sessions: ACCOUNT + its Hugging Face username


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text or "").strip("-")[:40].lower() or "session"


class Sessions:
    """Service's part for stored sessions: what the screen shows of one, and what the reader does to it."""

    def owned_session(self, owner: str, session_id: str | None) -> dict:
        if not owner:
            raise UserError("The page is still loading; please try again in a moment.")
        session = self.store.get_session(session_id, owner) if session_id else None
        if session is None:
            raise UserError("No reading is open. Upload a document and press Read first.")
        return session

    def segments_of(self, session: dict, doc: dict | None = None) -> list:
        """The session's document in segments (made once: app/layouts.py)."""
        doc = doc or self.store.get_document(session["document_id"])
        return self.layouts.segmented(doc, session["settings"]).segments

    def status_of(self, session: dict) -> str:
        """The panel status for a stored session, knowing what runs in this process."""
        sid, status = session["id"], session["status"]
        running = self.jobs.running(sid)
        if running:
            return "answering" if running == "answer" else "reading"
        if self.jobs.queued(sid):
            return "queued"
        if status in ("reading", "new"):
            return "interrupted"  # the app stopped (or crashed) while this was being read
        if status in ("read", "answered"):
            return "done" if session["segments_read"] >= session["segments_total"] else "stopped"
        return {"stopped": "stopped", "error": "error"}.get(status, "idle")

    def other_model(self, session: dict, to: str) -> str:
        """Why a session read by another model cannot continue: its margins and cache are that model's."""
        return (f"This reading was made with {session['model']}; the model loaded now is {self.model}. "
                f"Its margins and cache belong to that model, so they are not mixed: pick {session['model']} "
                f"under Model to {to}, or start a new reading with this one.")

    def can_resume(self, session: dict) -> bool:
        return (self.status_of(session) in ("stopped", "interrupted", "error")
                and session["segments_read"] < session["segments_total"])

    def panel_of(self, session: dict, margins: list[dict], segments: list) -> Panel:
        panel = Panel(session_id=session["id"], classifier=session["settings"].classifier,
                      kind=session.get("document_kind"))
        panel.segments = [SegmentInfo(s.index, s.tokens, s.pages) for s in segments]
        for m in margins:
            pages = (m["page_start"], m["page_end"]) if m["page_start"] is not None else None
            panel.cards[m["segment_index"]] = Card(m["segment_index"], pages, m["text"], m["verdict"], m["score"],
                                                   m["mark"], done=True)
            panel.read.add(m["segment_index"])
        panel.status = self.status_of(session)
        return panel

    def answer_views(self, session_id: str, margins: list[dict]) -> list[AnswerView]:
        pages = {m["segment_index"]: (m["page_start"], m["page_end"]) if m["page_start"] is not None else None
                 for m in margins}
        return [AnswerView(a["question"], a["text"], a["margins_used"], pages, True, seconds=a["seconds"],
                           reasoning=a["reasoning"])
                for a in reversed(self.store.answers(session_id))]

    def view(self, owner: str, session_id: str) -> SessionView:
        """Everything the screen shows for one stored session."""
        session = self.owned_session(owner, session_id)
        doc = self.store.get_document(session["document_id"])
        margins = self.store.margins(session_id)
        segments = self.segments_of(session, doc)
        panel = self.panel_of(session, margins, segments)
        answers = self.answer_views(session_id, margins)
        if answers and answers[0].used:
            panel.used = set(answers[0].used)
        segment = None
        if segments:
            seg = segments[min(max(panel.read) if panel.read else 0, len(segments) - 1)]
            segment = SegmentView(doc["text"], seg.char_start, seg.char_end, seg.index, len(segments), seg.pages,
                                  seg.tokens, label="Last read" if panel.read else "First segment",
                                  kind=doc["kind"])
        self.store.mark_opened(session_id)
        left_at = session.get("position")
        if left_at is not None and 0 <= left_at < len(segments):
            shown = self.passage_at(session, doc, segments, left_at)
        else:
            shown = Passage(None, self.no_page(doc))
        notice = ""
        if session["model"] and session["model"] != self.model:
            notice = self.other_model(session, "resume it or ask about it") + " You can look at it and export it."
        settings = session["settings"]
        return SessionView(session_id, session["document_id"], session["question"] or "", settings,
                           self.document(session["document_id"], settings), panel, answers, segment,
                           self.can_resume(session), notice, shown, left_at)

    def delete(self, owner: str, session_id: str) -> bool:
        self.owned_session(owner, session_id)
        if self.jobs.busy(session_id):
            raise UserError("This reading is still running: stop it first.")
        worker.forget(session_id)
        saved = self.cache_dir(self.store.get_session(session_id, owner))
        deleted = self.store.delete_session(session_id, owner)
        if deleted and saved:
            shutil.rmtree(saved, ignore_errors=True)
        return deleted

    def cache_dir(self, session: dict | None) -> str | None:
        """The folder holding the session's saved cache, if one was recorded."""
        path = (session or {}).get("cache_path")
        return os.path.join(self.data_dir, path) if path else None

    def export(self, owner: str, session_id: str) -> list[str]:
        session = self.owned_session(owner, session_id)
        folder = tempfile.mkdtemp(prefix="marginalia-export-")
        stem = f"marginalia-{_slug(session['title'] or session['document_name'])}-{session_id[:8]}"
        md = os.path.join(folder, stem + ".md")
        js = os.path.join(folder, stem + ".json")
        with open(md, "w", encoding="utf-8") as f:
            f.write(exports.markdown(self.store, session_id, owner))
        with open(js, "w", encoding="utf-8") as f:
            json.dump(exports.as_json(self.store, session_id, owner), f, ensure_ascii=False, indent=2)
        return [md, js]

    def library(self, owner: str, current: str | None = None) -> LibraryView:
        """The owner's library (nothing before the page's load event has said whose it is), `current` on screen."""
        rows = self.store.library(owner) if owner else []
        account = owner[len(ACCOUNT):] if owner and owner.startswith(ACCOUNT) else None
        return LibraryView(rows, self.jobs.sessions(), current, account, bool(owner))

    def last_opened(self, owner: str) -> str | None:
        """The session the reader had open last (where the app opens)."""
        rows = self.store.library(owner) if owner else []
        return rows[0]["id"] if rows else None

    def set_mark(self, owner: str, session_id: str, index: int, mark: bool | None) -> bool:
        """The reader's verdict on one margin, saved at once. False if there is no such (finished) margin."""
        self.owned_session(owner, session_id)
        saved = self.store.set_mark(session_id, int(index), mark)
        if saved:
            with self.lock:
                self.live_marks.setdefault(session_id, {})[int(index)] = mark
        return saved
