"""engine.documents on real files: the shared books and PDFs, plus good and bad files built in tmp_path."""
from __future__ import annotations

import hashlib
import io
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.documents import Document, IngestError, Limits, load_bytes, load_document

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
BOOKS = SHARED / "books"
PDFS = SHARED / "pdf"
FED_REG = PDFS / "federal-register-2020-17221.pdf"
LATEX = PDFS / "pdflatex-4-pages.pdf"
YELLOW = BOOKS / "pg1952_yellow_wallpaper_with_pg_header.txt"


def shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared fixture missing: {path}")
    return path


# ---------------------------------------------------------------- text

@pytest.mark.parametrize("file, phrase", [
    ("pg11.txt", "Down the Rabbit-Hole"),
    ("pg1342.txt", "It is a truth universally acknowledged"),
    ("pg1661.txt", "To Sherlock Holmes she is always"),
    ("pg84.txt", "You will rejoice to hear that no disaster"),
    (YELLOW.name, "It is very seldom that mere ordinary people"),
])
def test_books_load(file, phrase):
    path = shared(BOOKS / file)
    doc = load_document(path)
    assert doc.kind == "txt" and doc.page_starts is None and doc.page_of(0) is None
    assert phrase in doc.text
    assert "\r" not in doc.text and doc.text == doc.text.strip()
    assert doc.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "text=" not in repr(doc)  # a book in a log line or a test failure would drown it


def test_gutenberg_header_and_footer_stripped():
    doc = load_document(shared(YELLOW))
    assert doc.title == "The Yellow Wallpaper"
    assert doc.text.startswith("Produced by An Anonymous Volunteer")  # the line right after the START marker
    assert doc.text.endswith("so that I had to creep over him every time!")
    for boilerplate in ("*** START OF", "*** END OF", "End of Project Gutenberg", "Posting Date:",
                        "FULL LICENSE", "Project Gutenberg Literary Archive Foundation", "gutenberg.org"):
        assert boilerplate not in doc.text
    assert "John is a physician" in doc.text


@pytest.mark.parametrize("header, footer", [
    ("Title: A Test Book\r\n\r\n*** START OF THE PROJECT GUTENBERG EBOOK A TEST BOOK ***\r\n",
     "*** END OF THE PROJECT GUTENBERG EBOOK A TEST BOOK ***\r\nLicense text here\r\n"),
    ("Title: A Test Book\n\n***START OF THE PROJECT GUTENBERG EBOOK A TEST BOOK***\n",
     "End of the Project Gutenberg EBook of A Test Book\n\n"
     "***END OF THE PROJECT GUTENBERG EBOOK***\nLicense text here\n"),
    ("Title: A Test Book\nSmall print: License text here\n"
     "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n",
     "End of The Project Gutenberg Etext of A Test Book\nLicense text here\n"),
], ids=["current-crlf", "no-spaces-and-end-line", "1990s-small-print"])
def test_gutenberg_variants(tmp_path, header, footer):
    path = tmp_path / "book.txt"
    path.write_bytes((header + "\nChapter 1\n\nThe story.\n\n" + footer).encode())
    doc = load_document(path)
    assert (doc.title, doc.text) == ("A Test Book", "Chapter 1\n\nThe story.")


def test_gutenberg_title_may_wrap(tmp_path):
    path = tmp_path / "jekyll.txt"
    path.write_text("Title: The Strange Case of Dr. Jekyll\n       and Mr. Hyde\n\nBody.\n")
    assert load_document(path).title == "The Strange Case of Dr. Jekyll and Mr. Hyde"


def test_plain_text_title_is_file_name(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("Just some notes.\n")
    assert load_document(path).title == "notes"
    assert load_document(path, name="My Notes.TXT").title == "My Notes"


LEGACY = "“Café society,” she said — naïve, déjà vu, Zoë’s résumé.\r\nSecond line.\r\n"


@pytest.mark.parametrize("encoding", ["cp1252", "utf-8-sig", "utf-16"])
def test_text_encodings(tmp_path, encoding):
    path = tmp_path / "legacy.txt"
    path.write_bytes(LEGACY.encode(encoding))
    assert load_document(path).text == LEGACY.replace("\r\n", "\n").strip()


def test_legacy_encoding_whole_book():
    # The detector alone calls this cp852 ("Ôאְ" soup); the cp1252 preference must win on long text too.
    data = shared(BOOKS / "pg1342.txt").read_text(encoding="utf-8").encode("cp1252", errors="replace")
    assert "Elizabeth’s" in load_bytes(data, "pg1342.txt").text


def test_markdown(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("Intro line\n\n# The *Real* Title #\n\nBody text.\n\n## Section\n")
    doc = load_document(path)
    assert (doc.kind, doc.title, doc.page_starts) == ("md", "The *Real* Title", None)
    assert doc.text.startswith("Intro line") and "## Section" in doc.text


# ---------------------------------------------------------------- PDF

@pytest.mark.parametrize("path, pages", [(FED_REG, 15), (LATEX, 4)], ids=["federal-register", "latex"])
def test_pdfs_load(path, pages):
    doc = load_document(shared(path))
    assert (doc.kind, doc.title, len(doc.page_starts)) == ("pdf", path.stem, pages)  # no metadata title
    starts = doc.page_starts
    assert starts[0] == 0 and starts == sorted(set(starts))
    for page, start in enumerate(starts, 1):
        assert doc.page_of(start) == page
        assert doc.page_of(start - 1) == (page - 1 if page > 1 else None)
    assert doc.page_of(len(doc.text) - 1) == doc.page_of(len(doc.text)) == pages
    assert doc.page_of(len(doc.text) + 1) is None
    assert "\r" not in doc.text and "\ufffe" not in doc.text


def test_pdf_pages_line_up_with_text():
    doc = load_document(shared(LATEX))
    bounds = doc.page_starts + [len(doc.text) + 2]
    for page in range(1, 5):  # pdfTeX prints the page number as the last line of each page
        assert doc.text[bounds[page - 1]:bounds[page] - 2].endswith(f"\n{page}")
    fed = load_document(shared(FED_REG))
    assert fed.page_of(fed.text.index("47706 Federal Register")) == 9  # page 9 of 85 FR 47698-47712
    assert "FAA-approved MEL" in fed.text  # hyphen PDFium marked as a line-break join (U+FFFE)


def test_pdf_title_from_metadata(tmp_path):
    pypdf = pytest.importorskip("pypdf")
    writer = pypdf.PdfWriter(clone_from=str(shared(LATEX)))
    writer.add_metadata({"/Title": "  Blind Text Sampler "})
    path = tmp_path / "x.pdf"
    writer.write(path)
    assert load_document(path).title == "Blind Text Sampler"


def test_pdf_loads_concurrently():
    data = shared(FED_REG).read_bytes()
    expected = load_bytes(data, FED_REG.name)
    with ThreadPoolExecutor(4) as pool:
        docs = list(pool.map(lambda _: load_bytes(data, FED_REG.name), range(8)))
    assert all(d == expected for d in docs)


# ---------------------------------------------------------------- EPUB

CONTAINER = """<?xml version="1.0"?>
<container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">
  <rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/></rootfiles>
</container>"""

OPF = """<?xml version="1.0" encoding="utf-8"?>
<package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="id">
  <metadata xmlns:dc="http://purl.org/dc/elements/1.1/">
    <dc:identifier id="id">test-book</dc:identifier><dc:title>The Spine Test</dc:title><dc:language>en</dc:language>
  </metadata>
  <manifest>
    <item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>
    <item id="css" href="style.css" media-type="text/css"/>
    <item id="first" href="text/zz%20first.xhtml" media-type="application/xhtml+xml"/>
    <item id="second" href="text/aa_second.xhtml" media-type="application/xhtml+xml"/>
  </manifest>
  <spine>{itemrefs}</spine>
</package>"""

CHAPTER = """<?xml version="1.0" encoding="utf-8"?>
<!DOCTYPE html>
<html xmlns="http://www.w3.org/1999/xhtml"><head><title>Head title</title><style>p {{ color: red }}</style></head>
<body><h1>{heading}</h1>
<p>{body} It&#8217;s
   wrapped in the source &amp; has an entity.</p><script>var hidden = 1;</script>
<p>Roses are red,<br/>violets are blue.</p></body></html>"""


def build_epub(path: Path, *, spine=("first", "second"), chapters=None, skip=()) -> Path:
    files = {
        "META-INF/container.xml": CONTAINER,
        "OEBPS/content.opf": OPF.format(itemrefs="".join(f'<itemref idref="{i}"/>' for i in spine)),
        "OEBPS/nav.xhtml": "<html><body><nav>Table of contents</nav></body></html>",
        "OEBPS/style.css": "p { margin: 0 }",
        "OEBPS/text/zz first.xhtml": CHAPTER.format(heading="Chapter One", body="It begins."),
        "OEBPS/text/aa_second.xhtml": CHAPTER.format(heading="Chapter Two", body="It ends."),
        **(chapters or {}),
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("mimetype", "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        for name, content in files.items():
            if name not in skip:
                zf.writestr(name, content)
    return path


def test_epub_in_spine_order(tmp_path):
    doc = load_document(build_epub(tmp_path / "book.epub"))
    assert (doc.kind, doc.title, doc.page_starts) == ("epub", "The Spine Test", None)
    chapter_one = ("Chapter One\n\nIt begins. It’s wrapped in the source & has an entity.\n\n"
                   "Roses are red,\nviolets are blue.")
    assert doc.text == chapter_one + "\n\n" + chapter_one.replace("One", "Two").replace("begins", "ends")
    for noise in ("Head title", "color", "hidden", "Table of contents", "margin"):
        assert noise not in doc.text


def test_epub_without_title_uses_file_name(tmp_path):
    path = build_epub(tmp_path / "Untitled Book.epub")
    with zipfile.ZipFile(path) as zf:
        opf = zf.read("OEBPS/content.opf").decode().replace("<dc:title>The Spine Test</dc:title>", "")
    build_epub(path, chapters={"OEBPS/content.opf": opf})
    assert load_document(path).title == "Untitled Book"


# ---------------------------------------------------------------- bad input

def _pdf_bytes(writer) -> bytes:
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def encrypted_pdf(tmp_path):
    pypdf = pytest.importorskip("pypdf")
    writer = pypdf.PdfWriter(clone_from=str(shared(LATEX)))
    writer.encrypt(user_password="secret", owner_password="owner")
    return _write(tmp_path / "locked.pdf", _pdf_bytes(writer))


def blank_pdf(tmp_path):
    pypdf = pytest.importorskip("pypdf")
    writer = pypdf.PdfWriter()
    for _ in range(3):
        writer.add_blank_page(width=612, height=792)
    return _write(tmp_path / "scan.pdf", _pdf_bytes(writer))


def half_pdf(tmp_path):
    data = shared(FED_REG).read_bytes()
    return _write(tmp_path / "half.pdf", data[:len(data) // 2])


def half_epub(tmp_path):
    data = build_epub(tmp_path / "whole.epub").read_bytes()
    return _write(tmp_path / "half.epub", data[:len(data) // 2])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _zip(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    return path


EMPTY_CHAPTER = "<html><head><title>x</title></head><body><p> </p><script>only code</script></body></html>"

BAD_FILES = {  # id: (build(tmp_path) -> Path, words the message must contain)
    "empty-txt": (lambda t: _write(t / "empty.txt", b""), "is empty"),
    "blank-md": (lambda t: _write(t / "blank.md", b" \n\t\r\n "), "is empty"),
    "bom-only-txt": (lambda t: _write(t / "bom.txt", "\ufeff\n\n".encode("utf-8")), "is empty"),
    "empty-pdf": (lambda t: _write(t / "empty.pdf", b""), "is empty"),
    "unsupported-type": (lambda t: _write(t / "report.docx", b"PK\x03\x04 whatever"), ".txt, .md, .pdf or .epub"),
    "no-extension": (lambda t: _write(t / "README", b"hello"), ".txt, .md, .pdf or .epub"),
    "binary-as-txt": (lambda t: _write(t / "photo.txt", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40),
                      "doesn't look like a text file"),
    "nul-padded-txt": (lambda t: _write(t / "nul.txt", b"hello\x00\x00\x00\x00world" * 100),
                       "doesn't look like a text file"),
    "half-pdf": (half_pdf, "damaged or incomplete"),
    "not-a-pdf": (lambda t: _write(t / "fake.pdf", b"<html>this is a web page</html>"), "damaged or incomplete"),
    "encrypted-pdf": (encrypted_pdf, "password-protected"),
    "image-only-pdf": (blank_pdf, "no text layer (it looks scanned)"),
    "epub-not-zip": (lambda t: _write(t / "book.epub", b"just some text, not a zip"), "isn't a valid EPUB"),
    "half-epub": (half_epub, "isn't a valid EPUB"),
    "zip-not-epub": (lambda t: _zip(t / "photos.epub", {"a.jpg": "not really"}), "isn't a valid EPUB"),
    "epub-missing-opf": (lambda t: build_epub(t / "b.epub", skip={"OEBPS/content.opf"}), "isn't a valid EPUB"),
    "epub-bad-xml": (lambda t: build_epub(t / "b.epub", chapters={"OEBPS/content.opf": "<package><oops"}),
                     "isn't a valid EPUB"),
    "epub-empty-spine": (lambda t: build_epub(t / "b.epub", spine=()), "no readable chapters"),
    "epub-blank-chapters": (lambda t: build_epub(t / "b.epub", chapters={
        "OEBPS/text/zz first.xhtml": EMPTY_CHAPTER, "OEBPS/text/aa_second.xhtml": EMPTY_CHAPTER}),
        "no readable chapters"),
    "epub-chapters-missing": (lambda t: build_epub(t / "b.epub", skip={"OEBPS/text/zz first.xhtml",
                                                                       "OEBPS/text/aa_second.xhtml"}),
                              "no readable chapters"),
    "epub-drm": (lambda t: build_epub(t / "b.epub", chapters={"META-INF/encryption.xml": (
        '<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
        'xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:EncryptedData><enc:CipherData>'
        '<enc:CipherReference URI="OEBPS/text/aa_second.xhtml"/></enc:CipherData></enc:EncryptedData>'
        '</encryption>')}), "DRM-protected"),
}


@pytest.mark.parametrize("build, words", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_files_raise_clear_errors(tmp_path, build, words):
    path = build(tmp_path)
    for load in (lambda: load_document(path), lambda: load_bytes(path.read_bytes(), path.name)):
        with pytest.raises(IngestError) as info:
            load()
        message = str(info.value)
        assert words in message
        assert "couldn't be read: it may be damaged" not in message  # the catch-all is for the unforeseen only
        assert path.name in message or "This PDF" in message


def test_file_over_size_limit(tmp_path):
    path = _write(tmp_path / "big.txt", b"word " * 300_000)  # 1.4 MB
    with pytest.raises(IngestError, match=r"is 1\.4 MB, which is over the 1 MB limit"):
        load_document(path, limits=Limits(file_bytes=2**20))
    with pytest.raises(IngestError, match="over the 50 MB limit"):
        load_bytes(b"x" * (50 * 2**20 + 1), "huge.pdf")
    assert load_document(path, limits=Limits(file_bytes=2 * 2**20)).kind == "txt"


def test_missing_file(tmp_path):
    with pytest.raises(IngestError, match="couldn't be opened"):
        load_document(tmp_path / "gone.pdf", name="upload.pdf")


@pytest.mark.parametrize("name", ["f.txt", "f.md", "f.pdf", "f.epub"])
def test_garbage_only_ever_raises_ingest_error(tmp_path, name):
    """Whatever the bytes, callers see a Document or an IngestError, never a parser's own exception."""
    seeds = [os.urandom(2000), b"%PDF-1.7\n" + os.urandom(2000), b"PK\x03\x04" + os.urandom(2000)]
    if LATEX.exists():
        data = LATEX.read_bytes()
        seeds += [data[:n] for n in range(0, len(data), len(data) // 7)]
    seeds.append(build_epub(tmp_path / "b.epub").read_bytes()[:-100])
    for data in seeds:
        try:
            assert isinstance(load_bytes(data, name), Document)
        except IngestError:
            pass
