"""From a margin to its PDF page: the page rendered, with the boxes of the characters the margin's spans cover.
No Gradio, no SQLite, no HTML (app/render.py draws the passage and the page).

Offsets. Everything here takes character offsets into the document's stored text (what the engine reads,
what `margins.spans` and `documents.page_starts` refer to).

PDF pages. engine/documents.py stores each page's text cleaned (`_clean_pdf_text`) and joined with "\\n\\n".
`clean_with_map` repeats that cleaning while remembering which raw PDFium text index each kept character came
from, and PDFium's own text-to-char index translation does the rest; so a span maps onto the character boxes
it was copied from. PDFium is not thread-safe: every call here holds the same lock as engine.documents.
"""
from __future__ import annotations

import bisect
import io
import os
import re
import threading
from collections import OrderedDict

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c

from engine.documents import PDFIUM_LOCK  # one lock for every PDFium call in the process

PAGE_SCALE = 1.5             # 108 dpi: readable in a ~600 px column without rendering huge bitmaps
PAGE_CACHE = 12              # rendered pages kept in memory (PNG bytes of the unmarked page)


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
        with PDFIUM_LOCK:
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
