"""Documents and their passages: uploads read and stored, what reading one would take, and a margin's passage and page."""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass

from engine.documents import IngestError, load_document
from engine.wim import Settings

from . import passage as passages
from . import render
from .errors import UserError

log = logging.getLogger(__name__)

# A reading estimated to take longer than this gets a warning with the estimate before it starts.
LONG_READ_SECONDS = 3600

# "Try a sample": a short public-domain text (provenance in data/README.md) and a question about it, so that a
# newcomer sees margins being written before choosing a file of their own.
SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "sample",
                      "alice-down-the-rabbit-hole.md")
SAMPLE_QUESTION = "Why does Alice follow the White Rabbit, and what happens to her?"


@dataclass
class Defaults:
    segment_tokens: int = Settings.segment_tokens
    margin_tokens: int = Settings.margin_tokens
    answer_tokens: int = Settings.answer_tokens
    classifier: str = Settings.classifier
    context_limit: int | None = None  # cap on the tokens a reading's cache may hold (None: the model's window)
    margins: str = Settings.margins   # extractive | scored | abstractive
    reasoning_tokens: int = Settings.reasoning_tokens  # above 0: the answer first says what the notes say


def remember(cache: OrderedDict, key, value, most: int, lock):
    """Keep `value` under `key` in a cache of the `most` recently used entries; returns `value`."""
    with lock:
        cache[key] = value
        while len(cache) > most:
            cache.popitem(last=False)
    return value


class Documents:
    """Service's part for documents, their layout under some settings, and the passage (and PDF page) of a margin."""

    def settings(self, segment_tokens=None, margin_tokens=None, answer_tokens=None, classifier=None,
                 margins=None) -> Settings:
        d = self.defaults
        try:
            return Settings(segment_tokens=int(segment_tokens or d.segment_tokens),
                            margin_tokens=int(margin_tokens or d.margin_tokens),
                            answer_tokens=int(answer_tokens or d.answer_tokens),
                            classifier=classifier or d.classifier, context_limit=d.context_limit,
                            margins=margins or d.margins, reasoning_tokens=d.reasoning_tokens).validate()
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
        return remember(self._layouts, key, layout, 64, self._lock)

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
