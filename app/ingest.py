"""Turn an uploaded file (.txt, .md, .pdf, .epub) into plain text the engine can read.

Every problem with the *file* surfaces as IngestError, whose message is shown to the user as is;
anything else escaping from here is a bug in this module.
"""
from __future__ import annotations

import bisect
import codecs
import hashlib
import io
import logging
import os
import posixpath
import re
import threading
import zipfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from urllib.parse import unquote
from xml.etree import ElementTree as ET

import charset_normalizer
import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 50 * 1024 * 1024
KINDS = {".txt": "txt", ".md": "md", ".pdf": "pdf", ".epub": "epub"}

# PDFium keeps global state and is not thread-safe; the app serves several users at once.
_PDFIUM_LOCK = threading.Lock()


class IngestError(ValueError):
    """The file can't be read. The message is shown to the user verbatim: clear, non-technical, says what to do."""


@dataclass(frozen=True)
class Document:
    title: str
    kind: str  # "txt" | "md" | "pdf" | "epub"
    text: str = field(repr=False)
    page_starts: list[int] | None = field(repr=False)  # PDFs: offset in `text` where page i+1 begins
    sha256: str

    def page_of(self, char_offset: int) -> int | None:
        """1-based page holding `char_offset`; None for non-PDFs or offsets outside the text."""
        if self.page_starts is None or not 0 <= char_offset <= len(self.text):
            return None
        return bisect.bisect_right(self.page_starts, char_offset)


def load_document(path: str | os.PathLike, name: str | None = None, max_bytes: int = MAX_FILE_BYTES) -> Document:
    """Read a file from disk; `name` is what the user called it (upload temp files have other names)."""
    name = os.path.basename(name or os.fspath(path))
    _kind_of(name)  # refuse an unsupported type before reading anything
    try:
        _check_size(os.path.getsize(path), name, max_bytes)  # before reading: don't load a 2 GB file into memory
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        log.warning("reading %s failed: %s", path, e)
        raise IngestError(f"“{name}” couldn't be opened. Please upload it again.") from e
    return load_bytes(data, name, max_bytes)


def load_bytes(data: bytes, name: str, max_bytes: int = MAX_FILE_BYTES) -> Document:
    name = os.path.basename(name)
    kind = _kind_of(name)
    _check_size(len(data), name, max_bytes)
    if not data.strip():
        raise IngestError(f"“{name}” is empty. Please choose a file that contains text.")
    stem = os.path.splitext(name)[0]
    loader = {"txt": _load_txt, "md": _load_md, "pdf": _load_pdf, "epub": _load_epub}[kind]
    try:
        title, text, page_starts = loader(data, name, max_bytes)
    except IngestError:
        raise
    except Exception as e:  # a parser tripped over something we didn't foresee: still the file's fault
        log.exception("unexpected error reading %s", name)
        raise IngestError(f"Sorry, “{name}” couldn't be read: it may be damaged or in an unusual format. "
                          "Please try saving or exporting it again, or convert it to PDF or plain text.") from e
    return Document(title=title or stem, kind=kind, text=text, page_starts=page_starts,
                    sha256=hashlib.sha256(data).hexdigest())


def _kind_of(name: str) -> str:
    kind = KINDS.get(os.path.splitext(name)[1].lower())
    if kind is None:
        raise IngestError(f"“{name}” isn't a supported file type. "
                          "Please upload a .txt, .md, .pdf or .epub file.")
    return kind


def _check_size(size: int, name: str, max_bytes: int) -> None:
    if size > max_bytes:
        raise IngestError(f"“{name}” is {_mb(size)} MB, which is over the {_mb(max_bytes)} MB limit. "
                          "Please upload a smaller file, for example one part of the book.")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f}".removesuffix(".0")


# ---------------------------------------------------------------- plain text and Markdown

def _decode(data: bytes, name: str) -> str:
    """Bytes of a text file -> str with \\n newlines."""
    not_text = IngestError(f"“{name}” doesn't look like a text file. If it's a Word document or another "
                           "format, please save it as plain text (.txt) or PDF and upload that.")
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # Windows Notepad's "Unicode"
        text = data.decode("utf-16", errors="replace")
    elif data.count(b"\x00") > len(data) // 1000:  # real text has (almost) no NUL bytes; binary files have many
        raise not_text
    else:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = _decode_legacy(data)
            if text is None:
                raise not_text from None
    return text.replace("\x00", "").replace("\r\n", "\n").replace("\r", "\n")


def _decode_legacy(data: bytes) -> str | None:
    # charset_normalizer alone is unreliable between the Latin code pages: it reads a cp1252 "naïve" as
    # cp1257 "naļve" and a whole cp1252 novel as cp852. So take cp1252, by far the commonest legacy
    # encoding, whenever the detector finds it plausible at all; it rejects cp1252 for Polish, Czech,
    # Cyrillic, Greek and CJK bytes, which then get the detector's best guess.
    best = (charset_normalizer.from_bytes(data, cp_isolation=["cp1252"]).best()
            or charset_normalizer.from_bytes(data).best())
    return None if best is None else str(best)


# Project Gutenberg boilerplate: the header ends with a START line (or, in 1990s files, the end of the
# "small print"); the footer starts with an END line or the "End of (the) Project Gutenberg ..." line before it.
_PG_START = re.compile(r"^[ \t]*\*{3}[ \t]*START OF (?:THE |THIS )?PROJECT GUTENBERG.*$"
                       r"|^\*END\*THE SMALL PRINT.*$", re.IGNORECASE | re.MULTILINE)
_PG_END = re.compile(r"^[ \t]*(?:\*{3}[ \t]*)?END OF (?:THE |THIS )?PROJECT GUTENBERG.*$",
                     re.IGNORECASE | re.MULTILINE)
_PG_TITLE = re.compile(r"^Title:[ \t]*(\S.*(?:\n[ \t]+\S.*)*)", re.MULTILINE)  # may wrap onto indented lines


def _strip_gutenberg(text: str) -> str:
    end = _PG_END.search(text)
    body_end = end.start() if end else len(text)
    starts = list(_PG_START.finditer(text, 0, body_end))  # only the header's markers, never the license's
    body = text[starts[-1].end() if starts else 0:body_end]
    return body if body.strip() else text  # markers in odd places: better all the text than none


def _load_txt(data: bytes, name: str, max_bytes: int):
    text = _decode(data, name)
    title = _PG_TITLE.search(text[:5000])  # the PG header is short; later "Title:" lines are story text
    body = _strip_gutenberg(text).strip()
    if not body:
        raise IngestError(f"“{name}” is empty. Please choose a file that contains text.")
    return (" ".join(title[1].split()) if title else None), body, None


def _load_md(data: bytes, name: str, max_bytes: int):
    text = _decode(data, name).strip()
    if not text:
        raise IngestError(f"“{name}” is empty. Please choose a file that contains text.")
    heading = re.search(r"^#[ \t]+(.+?)[ \t#]*$", text, re.MULTILINE)
    return (heading[1] if heading else None), text, None


# ---------------------------------------------------------------- PDF

def _load_pdf(data: bytes, name: str, max_bytes: int):
    with _PDFIUM_LOCK:
        try:
            pdf = pdfium.PdfDocument(data)
        except pdfium.PdfiumError as e:
            if getattr(e, "err_code", None) in (pdfium_c.FPDF_ERR_PASSWORD, pdfium_c.FPDF_ERR_SECURITY):
                raise IngestError(f"“{name}” is password-protected. Please remove the password (for example, "
                                  "open it and print it to a new PDF) and upload it again.") from e
            raise IngestError(f"“{name}” couldn't be opened as a PDF: it may be damaged or incomplete. "
                              "Please download or export it again and retry.") from e
        try:
            title = pdf.get_metadata_dict().get("Title", "").strip()
            pages = []
            for i in range(len(pdf)):
                page = pdf[i]
                textpage = page.get_textpage()
                pages.append(textpage.get_text_range())
                textpage.close()  # close explicitly: finalizers could run later, on another thread, unlocked
                page.close()
        finally:
            pdf.close()
    pages = [_clean_pdf_text(p) for p in pages]
    if not any(pages):
        raise IngestError("This PDF has no text layer (it looks scanned), so there is nothing to read. "
                          "Please run it through OCR (text recognition) first, or upload a version "
                          "whose text you can select.")
    page_starts, offset = [], 0
    for p in pages:
        page_starts.append(offset)
        offset += len(p) + 2  # the "\n\n" joining pages
    return title, "\n\n".join(pages), page_starts


def _clean_pdf_text(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("\ufffe", "-")  # PDFium marks a hyphen where it joined a line break ("non-\nnormal")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)  # stray control codes from odd font encodings
    return re.sub(r"[ \t]+\n", "\n", text).strip()


# ---------------------------------------------------------------- EPUB (standard library only)

def _load_epub(data: bytes, name: str, max_bytes: int):
    broken = IngestError(f"“{name}” isn't a valid EPUB: it may be damaged or incomplete. "
                         "Please download or export it again and retry.")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise broken from e
    with zf:
        try:
            container = ET.fromstring(zf.read("META-INF/container.xml"))
            opf_path = container.find(".//{*}rootfile").get("full-path")
            opf = ET.fromstring(zf.read(opf_path))
        except (KeyError, AttributeError, TypeError, ET.ParseError) as e:  # missing file/element, bad XML
            raise broken from e
        title = (opf.findtext(".//{http://purl.org/dc/elements/1.1/}title") or "").strip()
        manifest = {item.get("id"): item for item in opf.iterfind(".//{*}manifest/{*}item")}
        names = set(zf.namelist())
        paths = []
        for ref in opf.iterfind(".//{*}spine/{*}itemref"):
            item = manifest.get(ref.get("idref"))
            if item is None or "html" not in (item.get("media-type") or ""):
                continue
            path = posixpath.normpath(posixpath.join(posixpath.dirname(opf_path), unquote(item.get("href") or "")))
            if path in names:
                paths.append(path)
            else:
                log.warning("%s: spine item %s is missing", name, path)
        if paths and set(paths) & _encrypted_paths(zf, names):
            raise IngestError(f"“{name}” is DRM-protected, so its text can't be read. "
                              "Please upload a DRM-free copy of the book.")
        # A small zip can unpack to gigabytes ("zip bomb"); text compresses ~4x, so allow 10x the upload limit.
        if sum(zf.getinfo(p).file_size for p in paths) > 10 * max_bytes:
            raise IngestError(f"“{name}” is too large once unpacked. Please upload a smaller book.")
        chapters = [t for t in (_html_to_text(zf.read(p)) for p in paths) if t]
    if not chapters:
        raise IngestError(f"“{name}” contains no readable chapters. "
                          "Please check that the book opens in an e-book reader, or try a PDF or .txt version.")
    return title, "\n\n".join(chapters), None


def _encrypted_paths(zf: zipfile.ZipFile, names: set[str]) -> set[str]:
    """Files listed in META-INF/encryption.xml (DRM; font obfuscation lists only fonts)."""
    if "META-INF/encryption.xml" not in names:
        return set()
    root = ET.fromstring(zf.read("META-INF/encryption.xml"))
    return {unquote(ref.get("URI", "")) for ref in root.iterfind(".//{*}CipherReference")}


_BLOCK_TAGS = {"address", "article", "aside", "blockquote", "dd", "div", "dl", "dt", "figcaption", "figure",
               "footer", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "nav", "ol", "p", "pre",
               "section", "table", "td", "th", "tr", "ul"}
_SKIP_TAGS = {"head", "script", "style"}  # <head> holds <title>, which would repeat as stray text


class _TextExtractor(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP_TAGS:
            self.skipping += 1
        elif tag == "br":
            self.parts.append("\n")
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in _SKIP_TAGS:
            self.skipping = max(0, self.skipping - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(re.sub(r"\s+", " ", data))  # source line breaks are not paragraph breaks


def _html_to_text(raw: bytes) -> str:
    """XHTML chapter -> paragraphs separated by blank lines (EPUB requires UTF-8 or UTF-16)."""
    is_utf16 = raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
    parser = _TextExtractor()
    parser.feed(raw.decode("utf-16" if is_utf16 else "utf-8-sig", errors="replace"))
    parser.close()
    paragraphs = ("\n".join(line.strip() for line in p.split("\n") if line.strip())
                  for p in re.split(r"\n[ ]*\n", "".join(parser.parts)))
    return "\n\n".join(p for p in paragraphs if p)
