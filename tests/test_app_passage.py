"""From a margin to its passage, keyboard, and the library: `python app.py` with the real model and SQLite, in real
Chromium. Short texts, 400-token segments and 12-token margins keep the module to a few minutes.

The tests run in order on one server and one browser profile: a text read to the end (cards, chips, keys), a PDF
stopped after three margins (its page tab), then the library with both, and continuing the stopped one.
"""
from __future__ import annotations

import base64
import io
import json
import os
import re

import pytest

from conftest import ROOT, shared, wait_ready
from test_app_browser import alice_chapter_one, db, panel, start_reading, wait_cards, wait_status

pytestmark = [pytest.mark.browser, pytest.mark.server]  # left out of `make quick`

SERVER_ARGS = ["--segment-tokens", "400", "--margin-tokens", "48", "--answer-tokens", "16", "--classifier", "none"]
SLOW = 240_000
SCREENSHOTS = bool(os.environ.get("MARGINALIA_SCREENSHOT"))  # the README's pictures


@pytest.fixture(scope="module")
def alice(tmp_path_factory):
    path = tmp_path_factory.mktemp("uploads") / "alice-opening.txt"
    path.write_text(alice_chapter_one()[:5200], encoding="utf-8")
    return path


def normal(text: str) -> str:
    """Whitespace and end-of-line hyphens as the reflowed view shows them."""
    return " ".join(re.sub(r"(?<=[a-z])-\n(?=[a-z])", "", text).split())


def shown_passage(page, server, index: int) -> None:
    """The passage view shows segment `index`: its highlights are the margin's spans, or the whole segment when
    the margin copied none, and what each highlight shows is text of that segment."""
    page.wait_for_selector(f'#passage-text .mg-passage[data-index="{index}"]', timeout=60_000)
    view = page.locator("#passage-text .mg-passage")
    marks = page.locator("#passage-text mark.mg-span").evaluate_all(
        "ms => ms.map(m => [+m.dataset.start, +m.dataset.end, m.innerText])")
    session = panel(page)["session"]
    with db(server) as conn:
        m = conn.execute("SELECT char_start, char_end, spans FROM margins WHERE session_id = ? AND segment_index = ?",
                         [session, index]).fetchone()
        text = conn.execute("SELECT d.text FROM documents d JOIN sessions s ON s.document_id = d.id WHERE s.id = ?",
                            [session]).fetchone()[0]
    spans = [tuple(s) for s in json.loads(m["spans"] or "[]")]
    segment = text[m["char_start"]:m["char_end"]]
    assert marks, "nothing highlighted"
    if spans:
        assert view.get_attribute("data-whole") == "0"
        clipped = sorted((max(s, m["char_start"]), min(e, m["char_end"])) for s, e in spans)  # document order
        assert [(s, e) for s, e, _ in marks] == clipped
    else:
        assert view.get_attribute("data-whole") == "1"
        assert [(s, e) for s, e, _ in marks] == [(m["char_start"], m["char_end"])]
    for start, end, shown in marks:
        assert m["char_start"] <= start < end <= m["char_end"]
        assert normal(shown) and normal(shown) in normal(segment)
        assert normal(shown) == normal(text[start:end])
    assert f"segment {index + 1} of" in view.locator(".mg-segview-head").inner_text()


def test_card_chip_and_keys_open_passages(page, server, alice):
    start_reading(page, alice, "Why does Alice follow the White Rabbit?")
    page.wait_for_selector(f'#library .mg-reading[data-session="{panel(page)["session"]}"]', timeout=60_000)
    wait_status(page, "done", timeout=600_000)
    assert panel(page)["done"] >= 3

    page.click('#margin-panel .mg-card[data-index="2"] .mg-seg')  # the third card
    shown_passage(page, server, 2)
    if SCREENSHOTS:
        page.wait_for_timeout(800)  # the smooth scroll to the passage
        page.screenshot(path=str(ROOT / "static" / "passage.png"), full_page=True)

    page.click("#answer-btn")
    page.wait_for_selector('#answers .mg-answer[data-state="done"] .mg-chip', timeout=SLOW)
    chips = page.locator("#answers .mg-answer").first.locator(".mg-chip")
    chip = chips.nth(chips.count() - 1)
    index = int(chip.get_attribute("data-index"))
    if index == 2:
        chip = chips.first
        index = int(chip.get_attribute("data-index"))
    chip.click()
    shown_passage(page, server, index)
    page.click('#margin-panel .mg-cell[data-index="0"]')  # a cell of the reading map
    shown_passage(page, server, 0)

    # Keyboard: from the third card, k k j lands on the second; o opens it, x marks it irrelevant.
    page.click('#margin-panel .mg-card[data-index="2"] .mg-seg')
    shown_passage(page, server, 2)
    assert "j/k" in page.inner_text("#margin-panel .mg-keys")
    for key in "kkj":
        page.keyboard.press(key)
    assert page.locator('#margin-panel .mg-card[data-focused="1"]').get_attribute("data-index") == "1"
    page.keyboard.press("o")
    shown_passage(page, server, 1)
    page.keyboard.press("x")
    card = page.locator('#margin-panel .mg-card[data-index="1"]')
    page.wait_for_function("() => document.querySelector('#mg-card-1').dataset.mark === '0'", timeout=10_000)
    page.wait_for_timeout(1500)
    with db(server) as conn:
        assert conn.execute("SELECT mark FROM margins WHERE session_id = ? AND segment_index = 1",
                            [panel(page)["session"]]).fetchone()[0] == 0
    page.keyboard.press("r")
    assert card.get_attribute("data-mark") == "1"
    # Typing in the question box is typing, not shortcuts.
    page.click("#question textarea")
    page.keyboard.press("x")
    assert card.get_attribute("data-mark") == "1"


def test_an_answers_inline_citation_opens_its_passage(page, server):
    """An answer citing "[segment 2]" shows the citation in its text as a chip that opens that passage; a cited
    segment whose note the answer did not use is still a chip, marked as such, and opens its passage too. (The
    answer is stored in the real database: whether the model cites is what bench.eval measures.)"""
    from datetime import datetime, timezone
    session = panel(page)["session"]
    text = "Alice follows the White Rabbit out of curiosity [segment 2], down the hole [segments 3]."
    with db(server) as conn:
        conn.execute("INSERT INTO answers (session_id, question, text, margins_used, seconds, created) "
                     "VALUES (?, ?, ?, ?, ?, ?)", [session, "Why does Alice follow it?", text, json.dumps([1]), 1.0,
                                                   datetime.now(timezone.utc).isoformat()])
        conn.commit()
    page.reload()
    wait_ready(page)
    page.wait_for_selector('#answers .mg-answer .mg-cite[data-index="1"]', timeout=60_000)
    answer = page.locator("#answers .mg-answer").first
    assert answer.locator(".mg-a").inner_text().startswith("Alice follows the White Rabbit out of curiosity")
    assert "[segment" not in answer.locator(".mg-a").inner_text()  # shown as chips, not as brackets
    kept, unkept = answer.locator('.mg-cite[data-index="1"]'), answer.locator('.mg-cite[data-index="2"]')
    assert kept.get_attribute("data-kept") == "1" and "not kept" not in kept.inner_text()
    assert unkept.get_attribute("data-kept") == "0" and "note not kept" in unkept.inner_text()
    unkept.click()
    shown_passage(page, server, 2)
    kept.click()
    shown_passage(page, server, 1)  # the passage last looked at stays segment 2's, as the library test expects


def page_image_of(page) -> "Image.Image":
    from PIL import Image
    src = page.get_attribute("#passage-page img.mg-page-img", "src")
    return Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("L")


def test_pdf_page_tab_shows_the_page(page, server):
    import pypdfium2 as pdfium
    from PIL import ImageChops, ImageStat

    pdf_path = shared("pdf", "pdflatex-4-pages.pdf")
    start_reading(page, pdf_path, "What does the text say about the alphabet?")
    wait_cards(page, 3)
    page.click("#stop-btn")
    wait_status(page, "stopped", timeout=60_000)
    session = panel(page)["session"]
    with db(server) as conn:
        m = conn.execute("SELECT max(segment_index) AS i FROM margins WHERE session_id = ?", [session]).fetchone()
        last = m["i"]
        row = conn.execute("SELECT char_start, spans FROM margins WHERE session_id = ? AND segment_index = ?",
                           [session, last]).fetchone()
        starts = json.loads(conn.execute("SELECT page_starts FROM documents WHERE name = ?",
                                         [pdf_path.name]).fetchone()[0])
    spans = json.loads(row["spans"] or "[]")
    first = spans[0][0] if spans else row["char_start"]
    expected = max(p for p, s in enumerate(starts, 1) if s <= first)

    page.click(f'#margin-panel .mg-card[data-index="{last}"] .mg-seg')
    shown_passage(page, server, last)
    page.get_by_role("tab", name="Page").click()
    page.wait_for_selector("#passage-page img.mg-page-img", timeout=60_000)
    assert page.get_attribute("#passage-page img.mg-page-img", "data-page") == str(expected)
    assert page.locator("#passage-page .mg-box").count() >= 1  # the passage's characters, drawn over the page
    image = page_image_of(page)
    pdf = pdfium.PdfDocument(str(pdf_path))
    try:
        distance = {}
        for p in range(1, len(pdf) + 1):
            ref = pdf[p - 1].render(scale=1.5).to_pil().convert("L").resize(image.size)
            distance[p] = ImageStat.Stat(ImageChops.difference(image, ref)).mean[0]
    finally:
        pdf.close()
    assert min(distance, key=distance.get) == expected, distance
    if SCREENSHOTS:
        page.locator("#passage-tabs").screenshot(path=str(ROOT / "static" / "page.png"))
    page.get_by_role("tab", name="Passage").click()


def library_rows(page) -> list[dict]:
    return page.locator("#library .mg-reading").evaluate_all(
        """rs => rs.map(r => ({session: r.dataset.session, read: +r.dataset.read, total: +r.dataset.total,
            status: r.dataset.status, doc: r.closest('.mg-libdoc').querySelector('.mg-libdoc-title').innerText}))""")


def test_library_lists_progress_opens_where_left_and_continues(page, server):
    page.wait_for_selector("#library .mg-reading", timeout=60_000)
    assert page.locator("#library .mg-libdoc").count() == 2
    rows = library_rows(page)
    with db(server) as conn:
        stored = {r["id"]: dict(r) for r in conn.execute("SELECT id, segments_read, segments_total FROM sessions")}
    assert len(rows) == 2
    assert {r["session"]: (r["read"], r["total"]) for r in rows} == {
        sid: (s["segments_read"], s["segments_total"]) for sid, s in stored.items()}
    full = next(r for r in rows if r["status"] == "read")
    stopped = next(r for r in rows if r["status"] == "stopped")
    assert full["read"] == full["total"] and 0 < stopped["read"] < stopped["total"]
    assert stopped["session"] == panel(page)["session"]  # the page opened on the last reading

    # Open the finished one from the library, reload: the app opens on it, at the passage last looked at.
    page.locator(f'#library .mg-reading[data-session="{full["session"]}"] button[data-action="open"]').click()
    page.wait_for_function(f"() => document.querySelector('#margin-panel .mg-panel').dataset.session === "
                           f"{full['session']!r}", timeout=60_000)
    page.reload()
    wait_ready(page)
    assert panel(page)["session"] == full["session"]
    shown_passage(page, server, 1)  # the keyboard test opened segment 2's passage last

    if SCREENSHOTS:  # one reading finished, one stopped (Continue)
        page.locator("#sessions-box").screenshot(path=str(ROOT / "static" / "library.png"))
    # Continue the stopped one: it resumes where it stopped and reads to the end.
    with db(server) as conn:
        before = {r["segment_index"]: r["created"] for r in conn.execute(
            "SELECT segment_index, created FROM margins WHERE session_id = ?", [stopped["session"]])}
    page.locator(f'#library .mg-reading[data-session="{stopped["session"]}"] button[data-action="continue"]').click()
    page.wait_for_function(f"() => document.querySelector('#margin-panel .mg-panel').dataset.session === "
                           f"{stopped['session']!r}", timeout=60_000)
    wait_status(page, "done", timeout=600_000)
    with db(server) as conn:
        after = {r["segment_index"]: r["created"] for r in conn.execute(
            "SELECT segment_index, created FROM margins WHERE session_id = ?", [stopped["session"]])}
    assert len(after) == stopped["total"] and all(after[i] == c for i, c in before.items())
    row = f'#library .mg-reading[data-session="{stopped["session"]}"]'
    page.wait_for_function(f"""() => {{ const r = document.querySelector('{row}');
        return r && r.dataset.status === 'read'; }}""", timeout=60_000)

    # Delete from the library asks once more on the button, then removes the reading.
    delete = page.locator(f'#library .mg-reading[data-session="{full["session"]}"] button[data-action="delete"]')
    delete.click()
    assert "again" in delete.inner_text()
    delete.click()
    page.wait_for_function(f"() => !document.querySelector('#library .mg-reading[data-session=\"{full['session']}\"]')",
                           timeout=60_000)
    with db(server) as conn:
        assert conn.execute("SELECT count(*) FROM sessions WHERE id = ?", [full["session"]]).fetchone()[0] == 0
