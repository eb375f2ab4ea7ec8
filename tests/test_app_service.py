"""app/service.py and app/render.py with the real tokenizer/model and a real SQLite file (no server, no browser)."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile

import pytest

from app import render
from app.records import AnswersChanged, JobEnded, PanelChanged, SessionView
from app.service import Defaults, Service, UserError
from app.storage import Store
from engine import DocumentTooLong, Settings

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
        "the rightful property of some one or other of their daughters.\n\n") * 3


@pytest.fixture
def service(engine, tmp_path):
    return Service(engine, Store(tmp_path / "marginalia.db"),
                   Defaults(segment_tokens=64, margin_tokens=8, answer_tokens=8, classifier="none"))


def saved_session(service, owner="alice"):
    """A session with one margin, a mark and an answer, written straight to the store."""
    store = service.store
    doc = store.add_document("pride.txt", "txt", "Pride and Prejudice", TEXT, hashlib.sha256(TEXT.encode()).hexdigest())
    sid = store.create_session(owner, doc, "Who is in want of a wife?", service.model,
                               service.settings(), 4)
    store.save_margin(sid, 0, "A single man <b>with a fortune</b>.", True, 0.9, 0, 120)
    store.set_mark(sid, 0, False)
    store.save_answer(sid, "Who is in want of a wife?", "A single man.", [0], 1.5)
    return sid


def snapshot(store, sid):
    return store.get_session(sid), store.margins(sid), store.answers(sid)


def pdf_bytes(*, encrypt: bool = False) -> bytes:
    """A one-page PDF with no text on it (a scan, as far as text goes), optionally password-protected."""
    pypdf = pytest.importorskip("pypdf")
    writer = pypdf.PdfWriter()
    writer.add_blank_page(width=300, height=300)
    if encrypt:
        writer.encrypt("secret")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_bad_uploads_get_clear_messages_and_lose_nothing(service, tmp_path):
    sid = saved_session(service)
    before = snapshot(service.store, sid)
    broken_epub = io.BytesIO()
    with zipfile.ZipFile(broken_epub, "w") as z:
        z.writestr("mimetype", "application/epub+zip")
    cases = {
        "empty.txt": (b"", "is empty"),
        "notes.docx": (b"PK\x03\x04 something", "isn't a supported file type"),
        "broken.pdf": (b"%PDF-1.4\n this is not really a pdf", "couldn't be opened as a PDF"),
        "locked.pdf": (pdf_bytes(encrypt=True), "password-protected"),
        "scan.pdf": (pdf_bytes(), "no text layer"),
        "book.epub": (broken_epub.getvalue(), "isn't a valid EPUB"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(UserError, match=message):
            service.add_upload(str(path))
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:  # sparse: 51 MB on paper, nothing on disk
        f.truncate(51 * 2**20)
    with pytest.raises(UserError, match="over the 50 MB limit"):
        service.add_upload(str(huge))
    with pytest.raises(UserError, match="choose a file"):
        service.add_upload(None)
    assert snapshot(service.store, sid) == before


def test_read_refuses_what_it_cannot_read(service, engine, tmp_path):
    sid = saved_session(service)
    before = snapshot(service.store, sid)
    doc = service.store.get_session(sid)["document_id"]
    settings = service.settings()
    with pytest.raises(UserError, match="upload a document"):
        service.start_read("alice", None, "Who?", settings)
    with pytest.raises(UserError, match="question"):
        service.start_read("alice", doc, "   ", settings)
    with pytest.raises(UserError, match="still loading"):
        service.start_read("", doc, "Who?", settings)
    # Too long for the model (here: a reading capped at 256 tokens): the engine's own message, verbatim.
    tight = Settings(segment_tokens=200, margin_tokens=8, classifier="none", context_limit=256)
    with pytest.raises(DocumentTooLong) as expected:
        engine.open(TEXT * 4, tight)
    long_doc = service.store.add_document("long.txt", "txt", "Long", TEXT * 4,
                                          hashlib.sha256((TEXT * 4).encode()).hexdigest())
    with pytest.raises(UserError) as shown:
        service.start_read("alice", long_doc, "Who?", tight)
    assert str(shown.value) == str(expected.value)
    card = service.document(long_doc, tight)
    assert card.title == "Long" and card.problem == str(expected.value) and card.tokens is None
    assert render.esc(str(expected.value)) in render.document_card_html(card)
    with pytest.raises(UserError, match="settings"):
        service.settings(segment_tokens=8)
    assert snapshot(service.store, sid) == before
    assert [r["id"] for r in service.store.library("alice")] == [sid]  # nothing half-created


def test_sessions_belong_to_their_browser(service):
    sid = saved_session(service, owner="alice")
    assert service.store.library("bob") == [] and "empty" in render.library_html(service.library("bob"))
    for call in (lambda: service.view("bob", sid), lambda: service.set_mark("bob", sid, 0, True),
                 lambda: service.export("bob", sid), lambda: service.stop("bob", sid),
                 lambda: service.delete("bob", sid), lambda: service.start_answer("bob", sid, "Who?"),
                 lambda: service.start_resume("bob", sid), lambda: service.view("", sid)):
        with pytest.raises(UserError):
            call()
    assert service.store.margins(sid)[0]["mark"] is False  # bob's attempt changed nothing
    view = service.view("alice", sid)
    assert view.session_id == sid and view.answers[0].text == "A single man."


def test_view_export_and_marks(service):
    sid = saved_session(service)
    view = service.view("alice", sid)
    assert isinstance(view, SessionView) and view.panel.cards[0].mark is False
    panel = render.panel_html(view.panel)
    assert 'data-mark="0"' in panel and "&lt;b&gt;with a fortune&lt;/b&gt;" in panel and "<b>with" not in panel
    assert view.resume is True  # 1 of 4 segments has a margin and nothing runs: resumable
    assert view.panel.status == "interrupted" and 'data-status="interrupted"' in panel
    assert service.set_mark("alice", sid, 0, True) and service.store.margins(sid)[0]["mark"] is True
    assert not service.set_mark("alice", sid, 3, True)  # no such margin (yet)
    md, js = service.export("alice", sid)
    assert md.endswith(".md") and "Pride and Prejudice" in open(md, encoding="utf-8").read()
    data = json.load(open(js, encoding="utf-8"))
    assert data["format"] == "marginalia/1" and data["margins"][0]["mark"] is True
    assert data["answers"][0]["text"] == "A single man."
    assert service.delete("alice", sid) and service.store.library("alice") == []


def test_everything_from_documents_is_escaped():
    evil = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    card = render.card_html(render.Card(0, (2, 3), evil, True, 0.5, None, True), "llm")
    assert "<script" not in card and "<img" not in card and "&lt;script&gt;" in card and "pp. 2–3" in card
    panel = render.panel_html(render.Panel("s", "reading", evil, [render.SegmentInfo(0, 10, (1, 1))],
                                           {0: render.Card(0, None, evil, done=False)}, {0}, 0))
    assert "<script" not in panel and "<img" not in panel
    segment = render.segment_html("before " + evil + " after", 7, 7 + len(evil), 0, 1)
    assert "<script" not in segment and "&lt;img src=x" in segment
    answers = render.answers_html([render.AnswerView(evil, evil, [0], {0: (4, 4)}, reasoning=evil + " [segment 1]")])
    assert "<script" not in answers and "<img" not in answers and "Segment 1 · p. 4" in answers
    assert "How the answer was found" in answers
    doc = render.document_html(evil, "txt", evil, None, 10, 5, 1, 64, 3.0, problem=evil)
    assert "<script" not in doc and "<img" not in doc
    assert "<script" not in render.notice_html(evil) and "<script" not in render.header_html({"name": evil})


def test_formatting():
    assert render.pages_label((3, 3)) == "p. 3" and render.pages_label((3, 5)) == "pp. 3–5"
    assert render.pages_label(None) == "" and render.pages_label((None, None)) == ""
    assert render.duration(8.2) == "9 s" and render.duration(80) == "1 min 20 s"
    assert render.duration(1500) == "25 min" and render.duration(4000) == "1 h 06 min"
    assert render.duration(None) == "—"


def test_a_text_past_the_window_shows_which_window_is_read(engine, tmp_path):
    """Read in several windows: the panel says which window is read and that earlier text is held only in
    the margins; every segment still gets its margin."""
    service = Service(engine, Store(tmp_path / "marginalia.db"),
                      Defaults(segment_tokens=64, margin_tokens=8, answer_tokens=8, classifier="none",
                               context_limit=512))
    text = TEXT * 2
    doc = service.store.add_document("pride.txt", "txt", "Pride and Prejudice", text,
                                     hashlib.sha256(text.encode()).hexdigest())
    sid = service.start_read("alice", doc, "Who is in want of a wife?", service.settings())
    # Drawn as they come, as the screen draws them: the panel is one record, changed as the reading goes.
    panels = [render.panel_html(e.panel) for e in service.read_stream("alice", sid) if getattr(e, "panel", None)]
    assert any("New context window from segment" in p for p in panels)
    assert "window 2 · earlier text held only in margins" in "".join(panels)
    assert "window 1 ·" not in "".join(panels)  # the first window is not labelled: most texts have one only
    session = service.store.get_session(sid)
    assert session["status"] == "read"
    assert len(service.store.margins(sid)) == session["segments_total"] == session["segments_read"] > 2


@pytest.mark.parametrize("apart", [False, True], ids=["beside-the-database", "database-elsewhere"])
def test_follow_up_after_a_restart_loads_the_saved_cache(engine, tmp_path, apart):
    """Read, answer, restart (new Service and Store objects, the worker's readings gone), ask again: the
    answer comes from the cache saved in the data folder, with no document token prefilled again. `apart`: the
    database is kept elsewhere (on local disk while the data folder is a network mount: app.py), and the caches
    still go to the data folder."""
    from app import worker
    db = (tmp_path / "local" if apart else tmp_path) / "marginalia.db"
    db.parent.mkdir(exist_ok=True)
    defaults = Defaults(segment_tokens=64, margin_tokens=8, answer_tokens=8, classifier="none")
    data = {"data_dir": tmp_path} if apart else {}
    first = Service(engine, Store(db), defaults, **data)
    doc = first.store.add_document("pride.txt", "txt", "Pride and Prejudice", TEXT,
                                   hashlib.sha256(TEXT.encode()).hexdigest())
    sid = first.start_read("alice", doc, "Who is in want of a wife?", first.settings())
    list(first.read_stream("alice", sid))
    session = first.store.get_session(sid)
    assert session["status"] == "read" and session["cache_path"]
    folder = tmp_path / session["cache_path"]
    assert (folder / "reading.json").exists() and list(folder.glob("window-*.safetensors"))
    if apart:
        assert not (db.parent / "caches").exists()
    question = "Is the man rich?"
    first.start_answer("alice", sid, question)
    list(first.answer_stream("alice", sid, question))
    before = first.store.answers(sid)[-1]["text"]

    worker.clear()
    second = Service(engine, Store(db), defaults, **data)
    assert worker.cached_sessions() == []
    second.start_answer("alice", sid, question)
    notes = [a.note for e in second.answer_stream("alice", sid, question) if isinstance(e, AnswersChanged)
             for a in e.answers]
    assert not any("Loading the document" in note for note in notes)
    reading = worker._readings[sid][1]
    assert reading.document_tokens_prefilled == 0            # the document was not read again
    assert reading.read_segments == list(range(len(reading.segments)))
    assert second.store.answers(sid)[-1]["text"] == before    # the same cache, bit for bit: the same answer
    assert second.delete("alice", sid) and not folder.exists()


def test_upload_notices_and_long_read_warning(service, tmp_path):
    """A few bad bytes: read, with a notice; a document estimated past LONG_READ_SECONDS: a warning with the
    estimate before Read (here the measured speed is set low, as on a slow machine)."""
    from app.service import LONG_READ_SECONDS

    path = tmp_path / "novel.txt"
    path.write_bytes(TEXT.replace("wife", "wife’").encode() + b"\xff")  # UTF-8, cut short by a stray byte
    doc_id, notices = service.add_upload(str(path))
    assert notices and "1 byte" in notices[0]
    settings = service.settings()
    assert not service.document(doc_id, settings).warning
    service.rates = {"prefill": 0.1, "decode": 0.01}  # ~250 tokens now take hours
    html = render.document_card_html(service.document(doc_id, settings))
    assert "mg-doc-warning" in html and "will take about" in html
    tokens_estimate = service.estimate_seconds(250, 4, settings)
    assert tokens_estimate > LONG_READ_SECONDS


def test_a_closed_tabs_queued_jobs_are_released(service):
    """Gradio drops a tab's queued events when the tab goes; the jobs they would have run must leave the queue,
    or their sessions stay "queued" and refuse Resume until a restart, and others count them ahead."""
    first, second = saved_session(service), saved_session(service)
    service.start_resume("alice", first, tab="tab-1")
    service.start_resume("alice", second, tab="tab-2")
    service.start_answer("alice", first, "Who is in want of a wife?", tab="tab-1")  # queued behind the reading
    assert service.queue_position(second) == 1
    with pytest.raises(UserError, match="already running"):
        service.start_resume("alice", first, tab="tab-3")
    assert service.release_tab("tab-3") == []
    assert service.release_tab("tab-1") == [first]
    assert service.queue_position(second) == 0  # nothing left ahead of it
    assert service.status_of(service.store.get_session(first)) != "queued"
    service.start_resume("alice", first, tab="tab-3")  # resumable again
    assert service.queue_position(first) == 1
    assert service.release_tab("tab-2") == [second] and service.release_tab("tab-3") == [first]


def test_each_queued_job_belongs_to_the_tab_that_queued_it(service):
    """One session, a job from each of two tabs (Resume in one, a question in the other): closing the first
    tab drops its job only; the session stays queued for the second tab's until that tab goes too."""
    first, second = saved_session(service), saved_session(service)
    service.start_resume("alice", second, tab="tab-0")  # ahead of both, so nothing starts
    service.start_resume("alice", first, tab="tab-1")
    service.start_answer("alice", first, "Who is in want of a wife?", tab="tab-2")
    assert service.queue_position(first) == 1
    assert service.release_tab("tab-1") == [first]
    assert service.status_of(service.store.get_session(first)) == "queued"  # tab-2's question still waits
    assert service.queue_position(first) == 1
    assert service.release_tab("tab-2") == [first]
    assert service.status_of(service.store.get_session(first)) != "queued"
    assert service.release_tab("tab-0") == [second] and service.jobs.waiting == []


@pytest.mark.slow
def test_warm_up_measures_reading_and_writing(service):
    """The picker shows the loaded model's speed as measured by its warm-up, copied notes (no decode step) or not."""
    rates = service.warm_up()
    assert service.measured[service.engine.lm.spec] == rates
    assert rates["prefill"] > 0 and rates["decode"] > 0


def test_a_reading_segments_its_document_once(service, monkeypatch):
    """Upload, the document card, Read, the reading itself, a question and the session reopened: the document is
    segmented once (app/layouts.py), and the engine job takes those segments instead of segmenting again."""
    import sys

    import engine.segment

    real, calls = engine.segment.segment, []

    def segment(*args, **kwargs):
        calls.append(args[2])  # the segment size
        return real(*args, **kwargs)

    # Counted wherever it was imported (app/layouts.py, the engine's Reading), the function itself untouched.
    for module in [m for name, m in sys.modules.items() if name.split(".")[0] in ("app", "engine")]:
        if getattr(module, "segment", None) is real:
            monkeypatch.setattr(module, "segment", segment)
    text = TEXT.replace("wife", "husband")  # a document no other test has segmented
    doc = service.store.add_document("pride.txt", "txt", "Pride", text, hashlib.sha256(text.encode()).hexdigest())
    settings = service.settings()
    assert service.document(doc, settings).segments >= 2
    sid = service.start_read("alice", doc, "Who is in want of a husband?", settings)
    events = list(service.read_stream("alice", sid))
    assert isinstance(events[-1], JobEnded) and events[-1].session["status"] == "read"
    service.start_answer("alice", sid, "Who?")
    list(service.answer_stream("alice", sid, "Who?"))
    service.view("alice", sid)
    assert calls == [settings.segment_tokens]


def test_the_streams_yield_records_not_html(service):
    """What a reading streams is data for any screen (or the API): no HTML in it."""
    doc = service.store.add_document("pride.txt", "txt", "Pride", TEXT, hashlib.sha256(TEXT.encode()).hexdigest())
    sid = service.start_read("alice", doc, "Who is in want of a wife?", service.settings())
    events = list(service.read_stream("alice", sid))
    assert [type(e).__name__ for e in events[:1] + events[-1:]] == ["JobStarted", "JobEnded"]
    assert any(isinstance(e, PanelChanged) and e.segment for e in events)
    assert "<div" not in repr(events) and "<span" not in repr(events)
    panel = events[-1].panel  # as the reading left it, drawn with the library's change in one repaint
    assert panel.status == "done" and all(c.done for c in panel.cards.values())
    assert [c.text for _, c in sorted(panel.cards.items())] == [m["text"] for m in service.store.margins(sid)]
