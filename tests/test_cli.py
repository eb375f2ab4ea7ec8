"""`python -m engine` reads documents as the app's upload does: the same text, the same page starts, the same
one-line message (and exit code 2) for a file it cannot read. The app side is the real Service and SQLite store."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

import hostile
from app.service import Service, UserError
from app.storage import Store
from tests.conftest import ROOT, shared
from tests.test_ingest import build_epub

FED_REG = ("pdf", "federal-register-2020-17221.pdf")


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def service(engine, tmp_path):
    return Service(engine, Store(tmp_path / "marginalia.db"))


def uploaded(service: Service, path) -> dict:
    """What the app stored for an upload of `path`: the text and page starts a reading of it reads."""
    doc_id, _ = service.add_upload(str(path))
    return service.store.get_document(doc_id)


def cli_text(path) -> dict:
    out = cli("text", str(path), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_cli_reads_a_pdf_and_an_epub_as_the_app_does(service, tmp_path):
    pdf = shared(*FED_REG)
    epub = build_epub(tmp_path / "book.epub")
    for path in (pdf, epub):
        app_doc, cli_doc = uploaded(service, path), cli_text(path)
        assert cli_doc["text"] == app_doc["text"], path
        assert cli_doc["page_starts"] == app_doc["page_starts"], path
    assert len(cli_text(pdf)["page_starts"]) == 15 and "%PDF" not in cli_text(pdf)["text"]


@pytest.mark.parametrize("name", ["encrypted.pdf", "header-only.pdf", "deflate-bomb.epub", "nul-heavy.txt"])
def test_a_file_the_cli_cannot_read_gets_the_apps_message(service, tmp_path, name):
    case = next(c for c in hostile.available() if c.name == name)
    path = hostile.write(tmp_path, [case])[name]
    with pytest.raises(UserError) as app_error:
        service.add_upload(str(path))
    assert case.refused in str(app_error.value)
    out = cli("read", str(path), "--query", "What is it about?")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [str(app_error.value)]


@pytest.mark.slow
def test_a_cli_reading_of_a_pdf_carries_its_pages(service, tmp_path):
    """One real reading on the embedded model: two pages of the Federal Register PDF, whose margins name the
    pages they were written on (a reading of the raw bytes would have no pages at all)."""
    pypdf = pytest.importorskip("pypdf")
    writer = pypdf.PdfWriter(clone_from=str(shared(*FED_REG)))
    while len(writer.pages) > 2:
        writer.remove_page(len(writer.pages) - 1)
    data = io.BytesIO()
    writer.write(data)
    path = tmp_path / "two-pages.pdf"
    path.write_bytes(data.getvalue())
    app_doc = uploaded(service, path)
    assert len(app_doc["page_starts"]) == 2
    out = cli("read", str(path), "--query", "Which airplanes does the directive cover?", "--jsonl",
              "--segment-tokens", "600", "--margin-tokens", "8", "--answer-tokens", "8", "--classifier", "none",
              timeout=900)
    assert out.returncode == 0, out.stderr
    margins = [e for e in map(json.loads, out.stdout.splitlines()) if e["event"] == "margin"]
    assert len(margins) >= 2
    assert margins[0]["pages"][0] == 1 and margins[-1]["pages"][1] == 2
