"""From a margin to its passage (app/passage.py through app/service.py): reflowed text with the same offsets, PDF
offsets mapped onto PDFium's characters, pages rendered on demand (one page for one passage of a 117-page PDF),
the library's rows and the exports' passages. Real PDFs, the real tokenizer, a real SQLite file."""
from __future__ import annotations

import html
import io
import json
import re

import pypdfium2 as pdfium
import pytest

from engine.documents import _clean_pdf_text
from app.passage import clean_with_map
from app.render import library_html, page_view_html, passage_html, passage_view_html, reflow
from app.service import Defaults, Service, UserError
from app.storage import Store
from conftest import shared


def marks(passage: str) -> list[tuple[int, int, str]]:
    """(start, end, shown text) of every highlight in a passage's HTML."""
    return [(int(s), int(e), html.unescape(t)) for s, e, t in
            re.findall(r'<mark class="mg-span" data-start="(\d+)" data-end="(\d+)">(.*?)</mark>', passage, re.S)]


def test_reflow_joins_lines_and_undoes_hyphens_without_moving_offsets():
    text = ("A line of text that wraps at the end of the exam-\nple, as PDF text does, and goes on to\n"
            "the next line until the paragraph is over.\nShort last line.\n\nA new paragraph starts here.")
    shown = reflow(text, 0, len(text), dehyphenate=True)
    assert len(shown) == len(text)  # one display string per source character
    assert "".join(shown) == ("A line of text that wraps at the end of the example, as PDF text does, and goes on to "
                              "the next line until the paragraph is over. Short last line.\n\n"
                              "A new paragraph starts here.")
    # A highlight keeps its offsets; its shown text is the reflowed source text.
    start = text.index("exam-")
    end = text.index("goes on")
    page = passage_html(text, "pdf", 0, len(text), 0, 1, (1, 1), spans=[(start, end)])
    (s, e, shown_text), = marks(page)
    assert (s, e) == (start, end) and shown_text == "example, as PDF text does, and "
    # Markdown keeps its line breaks (lists, code); only PDF and plain text are reflowed.
    assert "\n" in marks(passage_html("- one\n- two", "md", 0, 11, 0, 1))[0][2]


@pytest.mark.parametrize("name", ["pdflatex-4-pages.pdf", "GeoTopo-komprimiert.pdf",
                                  "federal-register-2020-17221.pdf"])
def test_pdf_text_offsets_map_back_to_pdfium_characters(name):
    pdf = pdfium.PdfDocument(str(shared("pdf", name)))
    try:
        for i in range(len(pdf)):
            page = pdf[i]
            textpage = page.get_textpage()
            raw = textpage.get_text_range()
            cleaned, where = clean_with_map(raw)
            assert cleaned == _clean_pdf_text(raw), (name, i)  # the text ingest stored, exactly
            assert all(raw[w] == c or (c, raw[w]) in (("\n", "\r"), ("-", "\ufffe")) for c, w in zip(cleaned, where))
            textpage.close()
            page.close()
    finally:
        pdf.close()


@pytest.fixture
def service(engine, tmp_path):
    return Service(engine, Store(tmp_path / "marginalia.db"),
                   Defaults(segment_tokens=512, margin_tokens=8, answer_tokens=8, classifier="none"))


def test_one_passage_of_a_117_page_pdf_renders_one_page(service):
    path = shared("pdf", "GeoTopo-komprimiert.pdf")
    doc_id, _ = service.add_upload(str(path))
    doc = service.store.get_document(doc_id)
    assert doc["pages"] == 117
    sid = service.store.create_session("alice", doc_id, "Was ist eine Überlagerung?", service.model,
                                       service.settings(), 0)
    segments = service.segments_of(service.store.get_session(sid))
    # A segment in the middle of the book, and a sentence in it as the margin's copied passage.
    seg = next(s for s in segments if s.pages and s.pages[0] >= 60)
    body = doc["text"][seg.char_start:seg.char_end]
    sentence = re.search(r"[A-ZÄÖÜ][^.\n]{20,80}\.", body)
    span = (seg.char_start + sentence.start(), seg.char_start + sentence.end())
    service.store.save_margin(sid, seg.index, sentence.group(), True, None, seg.char_start, seg.char_end,
                              seg.pages[0], seg.pages[1], spans=[span])
    expected_page = max(p for p, start in enumerate(doc["page_starts"], 1) if start <= span[0])

    passage = service.passage("alice", sid, seg.index)
    shown = {"text": passage_view_html(passage.text), "page": page_view_html(passage.page)}
    assert service.pages.renders == 1  # one page drawn, of 117
    assert f'data-page="{expected_page}"' in shown["page"] and passage.page.page_no == expected_page
    assert shown["page"].count('class="mg-box"') >= 1  # the sentence's character boxes were found
    (s, e, text), = marks(shown["text"])
    assert (s, e) == span and " ".join(text.split()) == " ".join(sentence.group().replace("-\n", "").split())
    # The image is that page: closest, pixel for pixel, to that page rendered straight from the file.
    from PIL import Image, ImageChops, ImageStat
    import base64
    png = base64.b64decode(re.search(r'src="data:image/png;base64,([^"]+)"', shown["page"]).group(1))
    image = Image.open(io.BytesIO(png)).convert("L")
    pdf = pdfium.PdfDocument(str(path))
    try:
        def distance(p):
            ref = pdf[p - 1].render(scale=service.pages.scale).to_pil().convert("L").resize(image.size)
            return ImageStat.Stat(ImageChops.difference(image, ref)).mean[0]
        assert distance(expected_page) < min(distance(expected_page - 1), distance(expected_page + 1))
    finally:
        pdf.close()

    service.passage("alice", sid, seg.index)  # again: from the cache
    assert service.pages.renders == 1
    assert service.store.get_session(sid)["position"] == seg.index  # where the reader left off
    assert passage_view_html(service.view("alice", sid).passage.text).count('class="mg-span"') == 1  # reopened there
    assert service.pages.renders == 1
    unread = service.passage("alice", sid, seg.index + 1)  # a segment with no margin yet: shown whole
    assert "no margin yet" in passage_view_html(unread.text) and service.pages.renders <= 2
    with pytest.raises(UserError):
        service.passage("alice", sid, len(segments) + 5)
    with pytest.raises(UserError):
        service.passage("mallory", sid, seg.index)  # someone else's reading

    # Exports carry the spans with their pages, and the Markdown quotes the passage.
    md, js = service.export("alice", sid)
    data = json.load(open(js, encoding="utf-8"))
    (out,) = data["margins"][0]["spans"]
    assert (out["start"], out["end"], out["page_start"], out["whole_segment"]) == (*span, expected_page, False)
    assert out["text"] == sentence.group()
    quote = f"> {' '.join(sentence.group().split())} (p. {expected_page})"
    assert quote in open(md, encoding="utf-8").read()


def test_library_lists_documents_with_progress(service, tmp_path):
    (tmp_path / "a.txt").write_text("One sentence here. " * 600, encoding="utf-8")
    (tmp_path / "b.txt").write_text("Another text there. " * 200, encoding="utf-8")
    a, _ = service.add_upload(str(tmp_path / "a.txt"))
    b, _ = service.add_upload(str(tmp_path / "b.txt"))
    first = service.start_read("alice", a, "What is here?", service.settings())
    second = service.start_read("alice", b, "What is there?", service.settings())
    service.jobs.waiting.clear()  # nothing runs them in this test
    total = service.store.get_session(first)["segments_total"]
    for i in range(total):
        service.store.save_margin(first, i, f"note {i}", i != 0, None, 0, 1)
    service.store.save_margin(second, 0, "", None, None, 0, 1)
    service.store.save_answer(first, "What is here?", "A sentence.", [1], 1.0)
    service.view("alice", first)  # opened last
    page = library_html(service.library("alice"))
    rows = re.findall(r'<li class="mg-reading" data-session="([^"]+)" data-read="(\d+)" data-total="(\d+)" '
                      r'data-status="([a-z ]+)"', page)
    assert [(sid, int(r), int(t), st) for sid, r, t, st in rows] == [
        (first, total, total, "read"),
        (second, 1, service.store.get_session(second)["segments_total"], "stopped")]
    assert f"{total - 1} margins kept · 1 question asked" in page  # margin 0 judged irrelevant
    assert service.last_opened("alice") == first
    assert "tokens" in page and library_html(service.library("bob")).count("mg-reading") == 0
