"""What Marginalia does for a reader, without any Gradio: documents, sessions, reading, answering, marks.

The Gradio layer (app/web.py) calls these methods and puts the HTML they return on screen; the API
endpoints call the same methods. Every method that takes a session id from outside also takes the
`owner` (the browser's id, or an API client's) and refuses sessions that are not the owner's.

Streams (`read_stream`, `answer_stream`) are generators of `Update`s: dicts naming the parts of the
screen that changed. They run in the single engine worker slot (see web.py: concurrency_limit=1), save
every margin the moment it is complete, and leave the session in a state a later Resume can continue.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

from engine.events import (Answer, AnswerToken, Margin, MarginToken, Notice, SegmentRead, ServerRequest, Stats,
                           WindowStart)
from engine.wim import Engine, Reading, Settings

from . import passage as passages
from . import render, worker
from .library import library_html
from engine.documents import IngestError, load_document
from .render import AnswerView, Card, Panel, SegmentInfo
from .storage import Store

log = logging.getLogger(__name__)

Update = dict  # keys: panel, segment, answers, sessions, notice, resume (each an HTML string or value)

WARMUP_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens and wrote the weather in a small leather book. Ships passed far out at sea; none of "
    "them knew his name. In winter the storms came from the north and the tower shook, but the light never "
    "failed. When he grew old, his daughter took over the work, and she kept the same book, adding a line "
    "each night in her own hand.")


# A reading estimated to take longer than this gets a warning with the estimate before it starts.
LONG_READ_SECONDS = 3600


class UserError(Exception):
    """Something the reader can fix; the message is shown on screen as is."""


@dataclass
class Defaults:
    segment_tokens: int = Settings.segment_tokens
    margin_tokens: int = Settings.margin_tokens
    answer_tokens: int = Settings.answer_tokens
    classifier: str = Settings.classifier
    context_limit: int | None = None  # cap on the tokens a reading's cache may hold (None: the model's window)
    margins: str = Settings.margins   # extractive | scored | abstractive


def _now() -> float:
    return time.perf_counter()


def _date(iso: str) -> str:
    try:
        return datetime.datetime.fromisoformat(iso).astimezone().strftime("%d %b %H:%M")
    except (TypeError, ValueError):
        return ""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text or "").strip("-")[:40].lower() or "session"


def benchmarked_rates(path: str | None = None) -> dict[str, dict]:
    """Model spec -> {"prefill", "decode"} tokens/s from bench/results/models.json (`python -m bench.models`),
    for the dtype the engine picks on this CPU; the picker shows them until a model's own warm-up measures it here."""
    from engine.model import cpu_has_bf16_matrix_units

    path = path or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results",
                                "models.json")
    try:
        with open(path, encoding="utf-8") as f:
            runs = json.load(f)["runs"]
    except (OSError, ValueError, KeyError):
        return {}
    source = "cache-bf16" if cpu_has_bf16_matrix_units() else "cache-fp32"
    return {r["model"]: {"prefill": r["prefill_tps"], "decode": r["decode_tps"]} for r in runs
            if r.get("source") == source}


class Service:
    def __init__(self, engine: Engine, store: Store, defaults: Defaults | None = None,
                 rates: dict | None = None, load: Callable[[str], Engine] | None = None):
        self.engine, self.store = engine, store
        self.defaults = defaults or Defaults()
        self.model = engine.lm.name
        self.rates = rates or {"prefill": 400.0, "decode": 8.0}
        self._load = load or Engine.load     # spec -> Engine, for the model picker
        self.measured: dict[str, dict] = {}  # model spec -> the speed its warm-up (and readings) measured here
        self._stops: dict[str, threading.Event] = {}
        self._active: dict[str, str] = {}       # session id -> "read" | "answer", while its job runs
        # Engine jobs queued, oldest first: (session id, the browser tab that queued it, for release_tab).
        self._waiting: list[tuple[str, str | None]] = []
        self._marks: dict[str, dict[int, bool | None]] = {}
        self._segments: OrderedDict[str, list] = OrderedDict()
        # What document_html says of a document under some settings: (tokens, segments, note, problem).
        # Reopening a session shows it again; segmenting a novel costs seconds (3.2 s for pg1342 here).
        self._layouts: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()
        # Finished readings' KV caches, one folder a session, beside the database (paths stored relative to it).
        self.data_dir = os.path.dirname(store.path)
        self.pages = passages.PageImages()  # PDF pages, rendered on demand for the passage view
        worker.set_engine(engine)

    # ------------------------------------------------------------------ start-up

    def warm_up(self) -> dict:
        """One tiny reading: the first forward passes are slow, and it measures this machine's speed for
        the reading-time estimates."""
        reading = self.engine.open(WARMUP_TEXT, Settings(segment_tokens=160, margin_tokens=6, answer_tokens=4,
                                                         classifier=self.defaults.classifier,
                                                         context_limit=1024))
        question = "Who keeps the light?"
        read = [ev for ev in reading.read(question) if isinstance(ev, Stats)][-1]
        # Copied notes may take no decode step at all: the answer's few tokens measure writing.
        answer = [ev for ev in reading.answer(question) if isinstance(ev, Stats)][-1]
        decode_tokens = read.decode_tokens + answer.decode_tokens
        decode_seconds = read.decode_seconds + answer.decode_seconds
        if read.prefill_seconds > 0 and decode_seconds > 0:
            self.rates = {"prefill": read.prefill_tokens / read.prefill_seconds,
                          "decode": decode_tokens / decode_seconds}
            self.measured[self.engine.lm.spec] = dict(self.rates)
        return self.rates

    # ------------------------------------------------------------------ the model picker

    def models(self, extra: str | None = None) -> list[dict]:
        """The models this machine can load (the loaded one marked), with what the picker shows of each."""
        from engine.model import available_models

        current = self.engine.lm.spec
        if not self.engine.lm.serial:  # a model server: it serves one model, and switching is done there
            lm = self.engine.lm
            return [{"spec": current, "name": lm.name, "parameters": None, "context_length": lm.context_length,
                     "file_bytes": None, "rates": self.measured.get(current), "loaded": True}]
        reference = benchmarked_rates()
        out = []
        for choice in available_models(extra or current):
            out.append({"spec": choice.spec, "name": choice.name, "parameters": choice.parameters,
                        "context_length": choice.context_length, "file_bytes": choice.file_bytes,
                        "rates": self.measured.get(choice.spec) or reference.get(choice.spec),
                        "loaded": choice.spec == current})
        return out

    def switch_model(self, spec: str, warm_up: bool = True) -> bool:
        """Load another model in place of the current one (False if it is already loaded).

        Runs in the engine slot (web.py gives it the engine's concurrency id), so no reading or answer is in
        flight: they finish first, and jobs queued later run on the new model. One model is loaded at a
        time; if the new one cannot be loaded the old one stays. UserError with the reason."""
        if spec == self.engine.lm.spec:
            return False
        if not self.engine.lm.serial:  # hence a switch only ever runs alone in the engine's one slot
            raise UserError("This app reads through a model server (--backend openai): switch the model there.")
        with self._lock:
            if self._active:
                raise UserError("A reading or an answer is running: stop it (or wait) before switching models.")
        try:
            engine = self._load(spec)
        except (ValueError, RuntimeError, OSError) as e:
            raise UserError(f"Could not load {spec}: {e}") from e
        old, self.engine = self.engine, engine
        self.model = engine.lm.name
        worker.set_engine(engine)  # drops the readings cached for the old model
        with self._lock:
            self._segments.clear()  # segments are measured in the old model's tokens
        del old
        import gc
        gc.collect()
        self.rates = dict(self.measured.get(spec) or {"prefill": 400.0, "decode": 8.0})
        if warm_up:
            self.warm_up()
        return True

    def _learn_rates(self, stats: Stats) -> None:
        if stats.stopped or stats.prefill_seconds <= 0.2 or stats.decode_seconds <= 0.2:
            return
        prefill = stats.prefill_tokens / stats.prefill_seconds
        decode = stats.decode_tokens / stats.decode_seconds
        self.rates = {"prefill": 0.5 * self.rates["prefill"] + 0.5 * prefill,
                      "decode": 0.5 * self.rates["decode"] + 0.5 * decode}

    def estimate_seconds(self, tokens: int, segments: int, settings: Settings) -> float:
        prefill = tokens + segments * 60
        if settings.classifier == "llm":
            prefill += segments * 120
        decode = segments * settings.margin_tokens * 0.8
        return prefill / self.rates["prefill"] + decode / max(self.rates["decode"], 0.1)

    # ------------------------------------------------------------------ settings and documents

    def settings(self, segment_tokens=None, margin_tokens=None, answer_tokens=None, classifier=None,
                 margins=None) -> Settings:
        d = self.defaults
        try:
            return Settings(segment_tokens=int(segment_tokens or d.segment_tokens),
                            margin_tokens=int(margin_tokens or d.margin_tokens),
                            answer_tokens=int(answer_tokens or d.answer_tokens),
                            classifier=classifier or d.classifier, context_limit=d.context_limit,
                            margins=margins or d.margins).validate()
        except (TypeError, ValueError) as e:
            raise UserError(f"Those settings don't work: {e}") from e

    def add_upload(self, path: str | None) -> tuple[int, tuple[str, ...]]:
        """Read an uploaded file and store it; returns the document id and notices about how it was read
        (e.g. bytes replaced). UserError for a bad file, and then nothing is stored."""
        if not path:
            raise UserError("Please choose a file to upload.")
        try:
            doc = load_document(path, os.path.basename(path))
        except IngestError as e:
            raise UserError(str(e)) from e
        doc_id = self.store.add_document(os.path.basename(path), doc.kind, doc.title, doc.text, doc.sha256,
                                         doc.page_starts)
        self._keep_original(path, doc.kind, doc.sha256)
        return doc_id, doc.notices

    def _open(self, doc: dict, settings: Settings):
        """Segment the document for this model (raises DocumentTooLong / ValueError)."""
        return self.engine.open(doc["text"], settings, doc["page_starts"])

    def document_html(self, doc_id: int | None, settings: Settings) -> str:
        doc = self.store.get_document(doc_id) if doc_id else None
        if doc is None:
            return render.no_document()
        tokens, segments, note, problem = self._layout(doc, settings)
        estimate, warning = None, ""
        if tokens is not None:
            estimate = self.estimate_seconds(tokens, segments, settings)
            if estimate > LONG_READ_SECONDS:
                warning = (f"Reading all of it will take about {render.duration(estimate)} on this machine. "
                           "You can Stop at any point and keep the margins written so far, or upload one part "
                           "of the document.")
        return render.document_html(doc["title"] or doc["name"], doc["kind"], doc["name"], doc["pages"],
                                    doc["chars"], tokens, segments, settings.segment_tokens, estimate, problem,
                                    note, warning)

    def _layout(self, doc: dict, settings: Settings) -> tuple:
        key = (doc["sha256"], json.dumps(settings.to_dict(), sort_keys=True))  # documents never change
        with self._lock:
            if key in self._layouts:
                self._layouts.move_to_end(key)
                return self._layouts[key]
        try:
            reading = self._open(doc, settings)
            note = getattr(reading, "document_note", lambda: None)() or ""  # e.g. "read in 3 windows"
            layout = (len(reading.doc.token_ids), len(reading.segments), note, "")
        except ValueError as e:  # DocumentTooLong included
            layout = (None, None, "", str(e))
        with self._lock:
            self._layouts[key] = layout
            while len(self._layouts) > 64:
                self._layouts.popitem(last=False)
        return layout

    # ------------------------------------------------------------------ sessions

    def _session(self, owner: str, session_id: str | None) -> dict:
        if not owner:
            raise UserError("The page is still loading; please try again in a moment.")
        session = self.store.get_session(session_id, owner) if session_id else None
        if session is None:
            raise UserError("No reading is open. Upload a document and press Read first.")
        return session

    def _segments_of(self, session: dict, doc: dict | None = None) -> list:
        sid = session["id"]
        with self._lock:
            if sid in self._segments:
                self._segments.move_to_end(sid)
                return self._segments[sid]
        doc = doc or self.store.get_document(session["document_id"])
        try:
            segments = self._open(doc, worker.settings_from(session["settings"])).segments
        except ValueError:
            segments = []
        with self._lock:
            self._segments[sid] = segments
            while len(self._segments) > 32:
                self._segments.popitem(last=False)
        return segments

    def sessions(self, owner: str) -> list[tuple[str, str]]:
        """(label, id) for the owner's sessions, newest first."""
        out = []
        for s in self.store.list_sessions(owner) if owner else []:
            status = self._status(s)
            word = {"done": "read", "interrupted": "interrupted", "stopped": "stopped", "reading": "reading",
                    "queued": "queued", "error": "failed", "idle": "new"}.get(status, status)
            question = s["question"] or ""
            question = question if len(question) <= 60 else question[:57] + "…"
            label = (f"{s['title'] or s['document_name']} — “{question}” · {word} "
                     f"{s['segments_read']}/{s['segments_total']} · {_date(s['created'])}")
            out.append((label, s["id"]))
        return out

    def _status(self, session: dict) -> str:
        """The panel status for a stored session, knowing what runs in this process."""
        sid, status = session["id"], session["status"]
        if sid in self._active:
            return "answering" if self._active[sid] == "answer" else "reading"
        if self._queued(sid):
            return "queued"
        if status in ("reading", "new"):
            return "interrupted"  # the app stopped (or crashed) while this was being read
        if status in ("read", "answered"):
            return "done" if session["segments_read"] >= session["segments_total"] else "stopped"
        return {"stopped": "stopped", "error": "error"}.get(status, "idle")

    def _other_model(self, session: dict, to: str) -> str:
        """Why a session read by another model cannot continue: its margins and cache are that model's."""
        return (f"This reading was made with {session['model']}; the model loaded now is {self.model}. "
                f"Its margins and cache belong to that model, so they are not mixed: pick {session['model']} "
                f"under Model to {to}, or start a new reading with this one.")

    def can_resume(self, session: dict) -> bool:
        return (self._status(session) in ("stopped", "interrupted", "error")
                and session["segments_read"] < session["segments_total"])

    def _panel(self, session: dict, margins: list[dict], segments: list) -> Panel:
        panel = Panel(session_id=session["id"], classifier=session["settings"].get("classifier", "llm"))
        panel.segments = [SegmentInfo(s.index, s.tokens, s.pages) for s in segments]
        for m in margins:
            pages = (m["page_start"], m["page_end"]) if m["page_start"] is not None else None
            panel.cards[m["segment_index"]] = Card(m["segment_index"], pages, m["text"], m["verdict"], m["score"],
                                                   m["mark"], done=True)
            panel.read.add(m["segment_index"])
        panel.status = self._status(session)
        return panel

    def _answer_views(self, session_id: str, margins: list[dict]) -> list[AnswerView]:
        pages = {m["segment_index"]: (m["page_start"], m["page_end"]) if m["page_start"] is not None else None
                 for m in margins}
        return [AnswerView(a["question"], a["text"], a["margins_used"], pages, True, seconds=a["seconds"])
                for a in reversed(self.store.answers(session_id))]

    def view(self, owner: str, session_id: str) -> dict:
        """Everything the screen shows for one stored session."""
        session = self._session(owner, session_id)
        doc = self.store.get_document(session["document_id"])
        margins = self.store.margins(session_id)
        segments = self._segments_of(session, doc)
        panel = self._panel(session, margins, segments)
        answers = self._answer_views(session_id, margins)
        if answers and answers[0].used:
            panel.used = set(answers[0].used)
        settings = worker.settings_from(session["settings"])
        if segments:
            last = max(panel.read) if panel.read else 0
            seg = segments[min(last, len(segments) - 1)]
            label = "Last read" if panel.read else "First segment"
            segment = render.segment_html(doc["text"], seg.char_start, seg.char_end, seg.index, len(segments),
                                          seg.pages, seg.tokens, label=label)
        else:
            segment = render.empty_segment()
        self.store.mark_opened(session_id)
        left_at = session.get("position")
        if left_at is not None and 0 <= left_at < len(segments):
            shown = self._passage(session, doc, segments, left_at)
        else:
            shown = {"text": passages.empty_passage(), "page": self._no_page(doc)}
        notice = ""
        if session["model"] and session["model"] != self.model:
            notice = self._other_model(session, "resume it or ask about it") + " You can look at it and export it."
        return {
            "session_id": session_id, "document_id": session["document_id"],
            "question": session["question"] or "", "settings": settings,
            "document": self.document_html(session["document_id"], settings),
            "panel": render.panel_html(panel), "answers": render.answers_html(answers), "segment": segment,
            "resume": self.can_resume(session), "notice": notice,
            "passage": shown["text"], "page": shown["page"], "position": left_at,
        }

    def delete(self, owner: str, session_id: str) -> bool:
        self._session(owner, session_id)
        if session_id in self._active or self._queued(session_id):
            raise UserError("This reading is still running: stop it first.")
        worker.forget(session_id)
        saved = self._cache_dir(self.store.get_session(session_id, owner))
        deleted = self.store.delete_session(session_id, owner)
        if deleted and saved:
            shutil.rmtree(saved, ignore_errors=True)
        return deleted

    def _cache_dir(self, session: dict | None) -> str | None:
        """The folder holding the session's saved cache, if one was recorded."""
        path = (session or {}).get("cache_path")
        return os.path.join(self.data_dir, path) if path else None

    def export(self, owner: str, session_id: str) -> list[str]:
        session = self._session(owner, session_id)
        folder = tempfile.mkdtemp(prefix="marginalia-export-")
        stem = f"marginalia-{_slug(session['title'] or session['document_name'])}-{session_id[:8]}"
        md = os.path.join(folder, stem + ".md")
        js = os.path.join(folder, stem + ".json")
        with open(md, "w", encoding="utf-8") as f:
            f.write(self.store.export_markdown(session_id, owner))
        with open(js, "w", encoding="utf-8") as f:
            json.dump(self.store.export_json(session_id, owner), f, ensure_ascii=False, indent=2)
        return [md, js]

    # ------------------------------------------------------------------ passages and the library

    def _original_path(self, sha256: str) -> str:
        return os.path.join(self.data_dir, "files", sha256 + ".pdf")

    def _keep_original(self, path: str, kind: str, sha256: str) -> None:
        """Keep an uploaded PDF (by content hash, beside the database): its pages are drawn in the page tab."""
        if kind != "pdf":
            return
        target = self._original_path(sha256)
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = target + ".part"
            shutil.copyfile(path, tmp)
            os.replace(tmp, target)  # never a half-copied file under the final name

    def _no_page(self, doc: dict | None) -> str:
        if doc and doc["kind"] == "pdf":
            return passages.page_html(None, None, None, "Open a passage to see its page here.")
        return passages.page_html(None, None, None, "Pages show here for PDF documents; this one is "
                                                    f"{doc['kind'].upper() if doc else 'not open'}.")

    def passage(self, owner: str, session_id: str | None, index: int) -> dict:
        """The passage of margin `index` (segment index): {"text": html, "page": html, "page_no": int | None}.
        Remembers it as where the reader left off."""
        session = self._session(owner, session_id)
        doc = self.store.get_document(session["document_id"])
        segments = self._segments_of(session, doc)
        index = int(index)
        if not 0 <= index < len(segments):
            raise UserError(f"This reading has no segment {index + 1}.")
        shown = self._passage(session, doc, segments, index)
        self.store.mark_opened(session_id, index)
        return shown

    def _passage(self, session: dict, doc: dict, segments: list, index: int) -> dict:
        seg = segments[index]
        margin = next((m for m in self.store.margins(session["id"]) if m["segment_index"] == index), None)
        spans = margin["spans"] if margin else []
        text = passages.passage_html(doc["text"], doc["kind"], seg.char_start, seg.char_end, index, len(segments),
                                     seg.pages, spans, margin["text"] if margin else None)
        page, page_no = self._page(doc, seg, spans)
        return {"text": text, "page": page, "page_no": page_no}

    def _page(self, doc: dict, seg, spans) -> tuple[str, int | None]:
        """The page tab for a passage: the page where it starts, its spans (or the segment) highlighted."""
        starts = doc["page_starts"]
        if doc["kind"] != "pdf" or not starts:
            return self._no_page(doc), None
        ranges = [(s, e) for s, e in spans if e > s] or [(seg.char_start, seg.char_end)]
        page_no = passages.page_of(starts, ranges[0][0])
        lo = starts[page_no - 1]
        hi = starts[page_no] - 2 if page_no < len(starts) else len(doc["text"])  # pages are joined by "\n\n"
        local = [(max(s, lo) - lo, min(e, hi) - lo) for s, e in ranges if s < hi and e > lo]
        path = self._original_path(doc["sha256"])
        if not os.path.exists(path):
            return passages.page_html(None, None, None, "The original PDF of this document isn't kept here (it was "
                                      "uploaded before pages were shown): upload it again to see its pages."), None
        try:
            result = self.pages.page(path, page_no, doc["text"][lo:hi], local)
        except Exception as e:  # a damaged file on disk: say so, keep the text view
            log.exception("rendering page %s of %s failed", page_no, path)
            return passages.page_html(None, None, None, f"Page {page_no} couldn't be drawn: {e}"), None
        last = passages.page_of(starts, max(e for _, e in ranges) - 1)
        return passages.page_html(result, page_no, len(starts), continues=last), page_no

    def library_html(self, owner: str, current: str | None = None) -> str:
        rows = self.store.library(owner) if owner else []
        with self._lock:
            running = set(self._active) | {sid for sid, _ in self._waiting}
        return library_html(rows, running, current)

    def last_opened(self, owner: str) -> str | None:
        """The session the reader had open last (where the app opens)."""
        rows = self.store.library(owner) if owner else []
        return rows[0]["id"] if rows else None

    # ------------------------------------------------------------------ marks

    def set_mark(self, owner: str, session_id: str, index: int, mark: bool | None) -> bool:
        """The reader's verdict on one margin, saved at once. False if there is no such (finished) margin."""
        self._session(owner, session_id)
        saved = self.store.set_mark(session_id, int(index), mark)
        if saved:
            with self._lock:
                self._marks.setdefault(session_id, {})[int(index)] = mark
        return saved

    # ------------------------------------------------------------------ the engine queue

    def queue_position(self, session_id: str) -> int:
        """How many engine jobs run or wait before this one."""
        with self._lock:
            queued = [sid for sid, _ in self._waiting]
            ahead = queued.index(session_id) if session_id in queued else len(queued)
            return ahead + len(self._active)

    def _queued(self, session_id: str) -> bool:
        return any(sid == session_id for sid, _ in self._waiting)

    def _enqueue(self, session_id: str, tab: str | None = None) -> threading.Event:
        """Note a job queued for this session (by browser tab `tab`, if a tab queued it). Jobs of one session
        share a stop flag, so Stop ends the reading and an answer queued behind it; a flag already set (a job
        stopping) is not reused."""
        with self._lock:
            busy = session_id in self._active or self._queued(session_id)
            stop = self._stops.get(session_id)
            if stop is None or stop.is_set() or not busy:
                stop = self._stops[session_id] = threading.Event()
            self._waiting.append((session_id, tab))
            return stop

    def _begin(self, session_id: str, kind: str) -> threading.Event:
        with self._lock:
            # A session's jobs run in the order they were queued: this is its oldest.
            first = next((k for k, (sid, _) in enumerate(self._waiting) if sid == session_id), None)
            if first is not None:
                del self._waiting[first]
            self._active[session_id] = kind
            return self._stops.setdefault(session_id, threading.Event())

    def release_tab(self, tab: str) -> list[str]:
        """Forget the jobs a closed (or disconnected) tab queued that have not begun. Gradio drops a tab's
        queued events when its connection goes, so those jobs never run; left in the queue, their sessions
        would show "queued" and refuse Resume until a restart, and every other reader would count them ahead."""
        with self._lock:
            gone = list(dict.fromkeys(sid for sid, t in self._waiting if t == tab))
            self._waiting = [(sid, t) for sid, t in self._waiting if t != tab]
        return gone

    def _end(self, session_id: str) -> None:
        with self._lock:
            self._active.pop(session_id, None)

    def stop(self, owner: str, session_id: str) -> bool:
        """Ask the running (or queued) job of this session to stop; it ends within one forward pass."""
        self._session(owner, session_id)
        stop = self._stops.get(session_id)
        if stop is None or (session_id not in self._active and not self._queued(session_id)):
            return False
        stop.set()
        return True

    # ------------------------------------------------------------------ reading

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
        session_id = self.store.create_session(owner, document_id, question, self.model, settings.to_dict(),
                                               len(reading.segments))
        self.store.update_session(session_id, tokens=len(reading.doc.token_ids))
        self.store.mark_opened(session_id)
        with self._lock:
            self._segments[session_id] = reading.segments
        self._enqueue(session_id, tab)
        return session_id

    def start_resume(self, owner: str, session_id: str, tab: str | None = None) -> str:
        session = self._session(owner, session_id)
        if session_id in self._active or self._queued(session_id):
            raise UserError("This reading is already running.")
        if session["model"] and session["model"] != self.model:
            raise UserError(self._other_model(session, "Resume it"))
        if session["segments_read"] >= session["segments_total"]:
            raise UserError("This document has been read to the end already.")
        self._enqueue(session_id, tab)
        self.store.mark_opened(session_id)
        return session_id

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
        stop = self._begin(session_id, "read")
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
                   "cache_dir": os.path.join(self.data_dir, "caches", session_id)}
            yield from self._drive_read(job, panel, segments, doc, settings, stop, len(skip))
            finished = True
        except Exception as e:  # a bug or an engine failure: keep what was saved, say what happened
            log.exception("reading session %s failed", session_id)
            self.store.update_session(session_id, status="error")
            finished = True
            yield {"notice": render.notice_html(f"Reading failed: {e}. The margins written so far are saved; "
                                                "you can Resume."), "resume": True, "sessions": True}
        finally:
            self._end(session_id)
            if not finished:  # the client went away mid-reading: leave it resumable
                stop.set()
                try:
                    self.store.update_session(session_id, status="stopped")
                except Exception:
                    log.exception("could not mark session %s stopped", session_id)

    def _drive_read(self, job, panel: Panel, segments, doc, settings: Settings, stop, skipped: int):
        sid = job["session_id"]
        started = _now()
        first_new_at = None
        tokens = 0
        new_done = 0
        remaining_new = len(segments) - skipped
        last_yield = 0.0
        sent = cached = 0  # prompt tokens sent to a server backend, and found in its prefix cache
        estimate = self.estimate_seconds(sum(s.tokens for s in segments), remaining_new, settings)

        def refresh_eta():
            elapsed = _now() - started
            panel.tokens_per_s = tokens / elapsed if elapsed > 0.5 and tokens else None
            if new_done and first_new_at is not None:
                per = (_now() - first_new_at) / new_done
                panel.eta_s = per * max(remaining_new - new_done, 0)
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
                    first_new_at = first_new_at or _now()
                    panel.message = f"Writing the margin for segment {ev.index + 1} of {len(segments)}…"
                    panel.cards[ev.index] = Card(ev.index, seg.pages)
                else:
                    panel.message = f"Re-reading segment {ev.index + 1} of {len(segments)} (margin kept)…"
                refresh_eta()
                marks()
                last_yield = _now()
                yield {"panel": render.panel_html(panel),
                       "segment": render.segment_html(doc["text"], seg.char_start, seg.char_end, seg.index,
                                                      len(segments), seg.pages, seg.tokens)}
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
                new_done += 1
                update = {}
                if ev.index + 1 < len(segments):  # the engine goes straight on to the next segment
                    nxt = segments[ev.index + 1]
                    panel.current = nxt.index
                    panel.message = f"Reading segment {nxt.index + 1} of {len(segments)}…"
                    update["segment"] = render.segment_html(doc["text"], nxt.char_start, nxt.char_end, nxt.index,
                                                            len(segments), nxt.pages, nxt.tokens)
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
                    self._learn_rates(ev)
                    complete = all(i in panel.cards for i in range(len(segments)))
                    status, panel.status = ("read", "done") if complete else ("stopped", "stopped")
                reuse = {"server_prompt_tokens": sent, "server_cached_tokens": cached} if sent else {}
                self.store.update_session(sid, status=status, **reuse)
                self._end(sid)  # before the last update, so the sessions list no longer says "reading"
                panel.message, panel.eta_s = "", None
                yield {"panel": render.panel_html(panel), "resume": panel.status != "done", "sessions": True}
        # The worker saves a finished reading's cache after its last event: record it for later follow-ups.
        if panel.status == "done" and os.path.exists(os.path.join(job["cache_dir"], Reading.SAVED)):
            self.store.update_session(sid, cache_path=os.path.relpath(job["cache_dir"], self.data_dir))

    # ------------------------------------------------------------------ answering

    def start_answer(self, owner: str, session_id: str | None, question: str, tab: str | None = None) -> dict:
        session = self._session(owner, session_id)
        if session["model"] and session["model"] != self.model:
            raise UserError(self._other_model(session, "ask about it"))
        if session_id in self._active or self._queued(session_id):
            pass  # queued behind the reading: the answer uses the margins saved by then
        elif not self.store.margins(session_id):
            raise UserError("There are no margins yet: press Read (or Resume) first.")
        question = (question or "").strip() or session["question"]
        self._enqueue(session_id, tab)
        return {"session_id": session_id, "question": question}

    def answer_stream(self, owner: str, session_id: str, question: str) -> Iterator[Update]:
        session = self._session(owner, session_id)
        doc = self.store.get_document(session["document_id"])
        settings = worker.settings_from(session["settings"])
        stop = self._begin(session_id, "answer")
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
                   "cache_dir": self._cache_dir(session)}
            started, last_yield = _now(), 0.0
            for ev in worker.run(job, stop):
                if isinstance(ev, SegmentRead):
                    current.note = (f"Loading the document into memory first (segment {ev.index + 1} of "
                                    f"{job['last'] + 1})…")
                    yield {"answers": render.answers_html([current, *history])}
                elif isinstance(ev, AnswerToken):
                    current.note = ""
                    current.text += ev.text
                    if _now() - last_yield >= 0.1:
                        last_yield = _now()
                        yield {"answers": render.answers_html([current, *history])}
                elif isinstance(ev, Notice):
                    current.note = ev.text
                elif isinstance(ev, Answer):
                    current.text, current.used, current.done = ev.text, list(ev.margins_used), True
                    current.seconds = _now() - started
                    self.store.save_answer(session_id, question, ev.text, current.used, round(current.seconds, 3))
                    if session["status"] in ("read", "answered") or session["segments_read"] >= session["segments_total"]:
                        self.store.update_session(session_id, status="answered")
                elif isinstance(ev, Stats) and ev.stopped:
                    current.done = True
                    current.note = "Stopped before the answer was finished; nothing was saved."
            self._end(session_id)
            session = self.store.get_session(session_id, owner)
            panel = self._panel(session, self.store.margins(session_id), self._segments_of(session, doc))
            panel.used = set(current.used) if current.done and current.text else set()
            yield {"answers": render.answers_html([current, *history]), "panel": render.panel_html(panel),
                   "sessions": True, "resume": self.can_resume(session)}
        except Exception as e:
            log.exception("answering in session %s failed", session_id)
            yield {"notice": render.notice_html(f"Answering failed: {e}")}
        finally:
            self._end(session_id)
