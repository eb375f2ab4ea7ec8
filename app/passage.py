"""From a margin to its passage: the segment's text with the margin's spans highlighted, reflowed for reading,
and for a PDF the page itself with the spans' character boxes drawn on it. No Gradio, no SQLite.

Offsets. Everything here takes character offsets into the document's stored text (what the engine reads,
what `margins.spans` and `documents.page_starts` refer to). Reflowing (joining a PDF's hard-wrapped lines,
undoing end-of-line hyphenation) happens only on the way to the screen: `render.reflow` returns one display string
per source character, so a highlight still covers exactly the characters its offsets name.

PDF pages. engine/documents.py stores each page's text cleaned (`_clean_pdf_text`) and joined with "\\n\\n".
`clean_with_map` repeats that cleaning while remembering which raw PDFium text index each kept character came
from, and PDFium's own text-to-char index translation does the rest; so a span maps onto the character boxes
it was copied from. PDFium is not thread-safe: every call here holds the same lock as engine.documents.
"""
from __future__ import annotations

import base64
import bisect
import io
import os
import re
import threading
from collections import OrderedDict

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c

from engine.documents import _PDFIUM_LOCK  # one lock for every PDFium call in the process
from .render import esc, pages_label, reflow

CONTEXT_CHARS = 300          # text shown (dimmed) before and after the segment
PAGE_SCALE = 1.5             # 108 dpi: readable in a ~600 px column without rendering huge bitmaps
PAGE_CACHE = 12              # rendered pages kept in memory (PNG bytes of the unmarked page)


# ---------------------------------------------------------------- the passage, as text

def _clip(spans, lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for s, e in spans or ():
        s, e = max(int(s), lo), min(int(e), hi)
        if e > s:
            out.append((s, e))
    return sorted(out)


def _window(text: str, seg_start: int, seg_end: int, context: int) -> tuple[int, int]:
    """The shown stretch: the segment and `context` characters either side, cut at whitespace."""
    lo, hi = max(0, seg_start - context), min(len(text), seg_end + context)
    if lo > 0:
        cut = text.find(" ", lo, seg_start)
        lo = cut + 1 if cut != -1 else lo
    if hi < len(text):
        cut = text.rfind(" ", seg_end, hi)
        hi = cut if cut != -1 else hi
    return lo, hi


def passage_html(text: str, kind: str, seg_start: int, seg_end: int, index: int, total: int,
                 pages: tuple[int, int] | None = None, spans=(), margin: str | None = None,
                 context: int = CONTEXT_CHARS) -> str:
    """One segment of the document, with the margin's spans highlighted (the whole segment when it has none).
    `margin`: the margin's text; None when the segment has no margin yet.

    Each highlight is a <mark class="mg-span"> carrying data-start/data-end, the offsets it covers."""
    spans = _clip(spans, seg_start, seg_end)
    whole = not spans
    marks = spans or [(seg_start, seg_end)]
    lo, hi = _window(text, seg_start, seg_end, context)
    shown = reflow(text, lo, hi, dehyphenate=kind == "pdf") if kind in ("pdf", "txt") else list(text[lo:hi])
    cuts = sorted({lo, hi, seg_start, seg_end, *(x for s in marks for x in s)})
    parts = ["…" if lo > 0 else ""]
    for a, b in zip(cuts, cuts[1:]):
        shown_text = esc("".join(shown[a - lo:b - lo]))
        if any(s <= a and b <= e for s, e in marks):
            parts.append(f'<mark class="mg-span" data-start="{a}" data-end="{b}">{shown_text}</mark>')
        elif seg_start <= a and b <= seg_end:
            parts.append(f'<span class="mg-seg-text">{shown_text}</span>')
        else:
            parts.append(f'<span class="mg-ctx">{shown_text}</span>')
    parts.append("…" if hi < len(text) else "")
    meta = [f"segment {index + 1} of {total}"]
    if pages:
        meta.append(pages_label(pages))
    if margin is None:
        meta.append("no margin yet: whole segment highlighted")
    elif whole:
        meta.append("whole segment highlighted: this margin copied no passage")
    else:
        meta.append(f"{len(spans)} passage{'s' if len(spans) != 1 else ''} the margin copied highlighted")
    note = f'<div class="mg-passage-margin"><span>Margin</span> {esc(margin)}</div>' if margin else ""
    return (f'<div class="mg-segview mg-passage" data-index="{index}" data-whole="{1 if whole else 0}" '
            f'data-start="{seg_start}" data-end="{seg_end}"><div class="mg-segview-head">'
            f'<span class="mg-segview-label">Passage</span> {esc(" · ".join(meta))}</div>{note}'
            f'<div class="mg-segview-body mg-reflowed">{"".join(parts)}</div></div>')


def empty_passage() -> str:
    return ('<div class="mg-segview mg-passage mg-segview-empty"><div class="mg-segview-head">'
            '<span class="mg-segview-label">Passage</span></div><div class="mg-segview-body">Click a margin card, '
            'a cell of the reading map or an answer\'s segment chip to see its passage here, highlighted.'
            '</div></div>')


# ---------------------------------------------------------------- PDF pages

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean_with_map(raw: str) -> tuple[str, list[int]]:
    """documents._clean_pdf_text(raw), and for each character of the result the index in `raw` it came from."""
    chars: list[str] = []
    where: list[int] = []
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == "\r":
            chars.append("\n")
            where.append(i)
            i += 2 if raw[i + 1:i + 2] == "\n" else 1
            continue
        if c == "\ufffe":
            c = "-"
        elif _CONTROL.match(c):
            i += 1
            continue
        chars.append(c)
        where.append(i)
        i += 1
    # "[ \t]+\n" -> "\n", then strip()
    keep = [True] * len(chars)
    run = []
    for k, c in enumerate(chars):
        if c in " \t":
            run.append(k)
        else:
            if c == "\n":
                for r in run:
                    keep[r] = False
            run = []
    chars = [c for c, k in zip(chars, keep) if k]
    where = [w for w, k in zip(where, keep) if k]
    lo, hi = 0, len(chars)
    while lo < hi and chars[lo].isspace():
        lo += 1
    while hi > lo and chars[hi - 1].isspace():
        hi -= 1
    return "".join(chars[lo:hi]), where[lo:hi]


def page_of(page_starts: list[int], offset: int) -> int:
    """1-based page holding a document offset."""
    return max(1, bisect.bisect_right(page_starts, offset))


class PageImages:
    """PDF pages as PNGs with highlighted character boxes: rendered on demand, one page at a time, cached.

    `renders` counts the bitmaps PDFium has rendered since start-up (never more than the pages asked for)."""

    def __init__(self, cache_pages: int = PAGE_CACHE, scale: float = PAGE_SCALE):
        self.scale = scale
        self.renders = 0
        self._cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._cache_size = cache_pages
        self._lock = threading.Lock()  # guards the cache and the counter (PDFium has its own lock)

    def page(self, pdf_path: str, page_no: int, page_text: str, ranges: list[tuple[int, int]]) -> dict:
        """Page `page_no` (1-based) of the PDF, and the boxes of the characters in `ranges` (offsets into the
        page's cleaned text, as engine.documents stored it: `page_text`). Returns {png: bytes of the unmarked page, width,
        height, boxes: [(x0, y0, x1, y1)] in image pixels}. The boxes are drawn over the image in HTML, so a
        cached page is sent as it is, with no decoding or re-encoding."""
        key = (os.path.abspath(pdf_path), page_no)
        with self._lock:
            png = self._cache.get(key)
            if png is not None:
                self._cache.move_to_end(key)
        with _PDFIUM_LOCK:
            pdf = pdfium.PdfDocument(pdf_path)
            try:
                page = pdf[page_no - 1]
                textpage = page.get_textpage()
                try:
                    width, height = page.get_size()
                    left, bottom, _, _ = page.get_cropbox()
                    boxes = self._boxes(textpage, page_text, ranges, left, bottom, height)
                    if png is None:
                        bitmap = page.render(scale=self.scale)
                        image = bitmap.to_pil()
                        bitmap.close()
                        buf = io.BytesIO()
                        image.save(buf, format="PNG", compress_level=1)  # fast; the page is sent once a view
                        png = buf.getvalue()
                        with self._lock:
                            self.renders += 1
                            self._cache[key] = png
                            while len(self._cache) > self._cache_size:
                                self._cache.popitem(last=False)
                finally:
                    textpage.close()  # explicitly, under the lock: a finalizer could run later, elsewhere
                    page.close()
            finally:
                pdf.close()
        return {"png": png, "width": round(width * self.scale), "height": round(height * self.scale),
                "boxes": boxes}

    def _boxes(self, textpage, page_text: str, ranges, left: float, bottom: float, height: float) -> list:
        raw = textpage.get_text_range()
        cleaned, where = clean_with_map(raw)
        if cleaned != page_text:  # not the text engine.documents stored (another PDFium build?): draw nothing wrong
            return []
        boxes = []
        for s, e in ranges:
            s, e = max(0, s), min(len(where), e)
            if e <= s:
                continue
            first = pdfium_c.FPDFText_GetCharIndexFromTextIndex(textpage, where[s])
            last = pdfium_c.FPDFText_GetCharIndexFromTextIndex(textpage, where[e - 1])
            if first < 0 or last < first:
                continue
            n = textpage.count_rects(first, last - first + 1)
            for r in range(n):
                x0, y0, x1, y1 = textpage.get_rect(r)  # PDF units: origin bottom-left
                boxes.append((round((x0 - left) * self.scale), round((bottom + height - y1) * self.scale),
                              round((x1 - left) * self.scale), round((bottom + height - y0) * self.scale)))
        return boxes


def page_html(result: dict | None, page_no: int | None, pages_total: int | None, message: str = "",
              continues: int | None = None) -> str:
    """The page tab: the rendered page as an inline PNG, or why there is none. `continues`: the last page the
    passage runs on to, when it does not end on this one."""
    if result is None:
        body = esc(message or "Pages show here for PDF documents.")
        return f'<div class="mg-page mg-page-empty">{body}</div>'
    data = base64.b64encode(result["png"]).decode("ascii")
    of = f" of {pages_total}" if pages_total else ""
    w, h = result["width"], result["height"]
    focus = min(b[1] for b in result["boxes"]) / h if result["boxes"] else 0.0
    boxes = "".join(
        f'<span class="mg-box" style="left:{100 * x0 / w:.2f}%;top:{100 * y0 / h:.2f}%;'
        f'width:{100 * (x1 - x0) / w:.2f}%;height:{100 * (y1 - y0) / h:.2f}%"></span>'
        for x0, y0, x1, y1 in result["boxes"])
    n = len(result["boxes"])
    return (f'<div class="mg-page" data-page="{page_no}" data-focus="{focus:.3f}"><div class="mg-segview-head">'
            f'<span class="mg-segview-label">Page {page_no}{of}</span> the passage\'s characters highlighted'
            f'{"" if n else " (none found on this page)"}'
            f'{f" · continues to p. {continues}" if continues and continues > page_no else ""}</div>'
            f'<div class="mg-page-scroll"><div class="mg-page-frame">'
            f'<img class="mg-page-img" data-page="{page_no}" alt="Page {page_no} of the PDF" width="{w}" '
            f'height="{h}" src="data:image/png;base64,{data}">{boxes}</div></div></div>')
