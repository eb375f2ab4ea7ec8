"""Documents and their passages: uploads read and stored, what reading one would take, and a margin's passage and page."""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

from engine import Settings
from engine.documents import IngestError, load_document

from . import passage as passages
from .errors import UserError
from .records import DocumentCard, PageView, Passage, PassageView
from .render import duration

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

    def document(self, doc_id: int | None, settings: Settings) -> DocumentCard | None:
        """What the document card says of a stored document under these settings (None: no document)."""
        doc = self.store.get_document(doc_id) if doc_id else None
        if doc is None:
            return None
        layout = self.layouts.layout(doc, settings)
        estimate, warning = None, ""
        if layout.tokens is not None:
            estimate = self.estimate_seconds(layout.tokens, layout.segments, settings)
            if estimate > LONG_READ_SECONDS:
                warning = (f"Reading all of it will take about {duration(estimate)} on this machine. "
                           "You can Stop at any point and keep the margins written so far, or upload one part "
                           "of the document.")
        return DocumentCard(doc["title"] or doc["name"], doc["kind"], doc["name"], doc["pages"], doc["chars"],
                            layout.tokens, layout.segments, settings.segment_tokens, estimate, layout.problem,
                            layout.note, warning)

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

    def no_page(self, doc: dict | None) -> PageView:
        if doc and doc["kind"] == "pdf":
            return PageView(message="Open a passage to see its page here.")
        return PageView(message="Pages show here for PDF documents; this one is "
                                f"{doc['kind'].upper() if doc else 'not open'}.")

    def passage(self, owner: str, session_id: str | None, index: int) -> Passage:
        """The passage of margin `index` (segment index), as text and as its page. Remembers it as where the
        reader left off."""
        session = self.owned_session(owner, session_id)
        doc = self.store.get_document(session["document_id"])
        segments = self.segments_of(session, doc)
        index = int(index)
        if not 0 <= index < len(segments):
            raise UserError(f"This reading has no segment {index + 1}.")
        shown = self.passage_at(session, doc, segments, index)
        self.store.mark_opened(session_id, index)
        return shown

    def passage_at(self, session: dict, doc: dict, segments: list, index: int) -> Passage:
        seg = segments[index]
        margin = next((m for m in self.store.margins(session["id"]) if m["segment_index"] == index), None)
        spans = margin["spans"] if margin else []
        text = PassageView(doc["text"], doc["kind"], seg.char_start, seg.char_end, index, len(segments), seg.pages,
                           spans, margin["text"] if margin else None)
        return Passage(text, self._page(doc, seg, spans))

    def _page(self, doc: dict, seg, spans) -> PageView:
        """The page tab for a passage: the page where it starts, its spans (or the segment) highlighted."""
        starts = doc["page_starts"]
        if doc["kind"] != "pdf" or not starts:
            return self.no_page(doc)
        ranges = [(s, e) for s, e in spans if e > s] or [(seg.char_start, seg.char_end)]
        page_no = passages.page_of(starts, ranges[0][0])
        lo = starts[page_no - 1]
        hi = starts[page_no] - 2 if page_no < len(starts) else len(doc["text"])  # pages are joined by "\n\n"
        local = [(max(s, lo) - lo, min(e, hi) - lo) for s, e in ranges if s < hi and e > lo]
        path = self._original_path(doc["sha256"])
        if not os.path.exists(path):
            return PageView(message="The original PDF of this document isn't kept here (it was uploaded before "
                                    "pages were shown): upload it again to see its pages.")
        try:
            image = self.pages.page(path, page_no, doc["text"][lo:hi], local)
        except Exception as e:  # a damaged file on disk: say so, keep the text view
            log.exception("rendering page %s of %s failed", page_no, path)
            return PageView(message=f"Page {page_no} couldn't be drawn: {e}")
        last = passages.page_of(starts, max(e for _, e in ranges) - 1)
        return PageView(image, page_no, len(starts), continues=last)
