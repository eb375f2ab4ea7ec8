"""Turn a document file (.txt, .md, .pdf, .epub) into the plain text and page starts the engine reads.

The one way in for every entry point: the app's uploads and `python -m engine read` both call load_document,
so a file gives the same text, pages and errors everywhere. Every problem with the *file* surfaces as
IngestError, whose message is shown to the user as is; anything else escaping from here is a bug in this module.
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

KINDS = {".txt": "txt", ".md": "md", ".pdf": "pdf", ".epub": "epub"}

# PDFium keeps global state and is not thread-safe; the app serves several users at once.
PDFIUM_LOCK = threading.Lock()


@dataclass(frozen=True)
class Limits:
    """What one upload may cost before any work is done on it. A hosted app takes files from anyone: each
    budget is checked before (or while) the work it bounds is done, never after."""
    file_bytes: int = 50 * 2**20            # the upload as sent (also Gradio's max_file_size, see app.py)
    unpacked_bytes: int = 32 * 2**20        # EPUB: bytes inflated from the zip, all entries read together
    zip_entries: int = 10_000               # EPUB: files in the zip (a real book has tens to hundreds)
    text_chars: int = 8_000_000             # extracted text (~11 novels; on a CPU that is days of reading)
    pdf_pages: int = 3_000


LIMITS = Limits()
# Tolerant decoding: a text file with at most this share of bytes that are not valid in its encoding is
# read with them replaced (and a notice); more than that, and it is not text.
BAD_BYTES_TOLERATED = 0.01


class IngestError(ValueError):
    """The file can't be read. The message is shown to the user verbatim: clear, non-technical, says what to do."""


@dataclass(frozen=True)
class Document:
    title: str
    kind: str  # "txt" | "md" | "pdf" | "epub"
    text: str = field(repr=False)
    page_starts: list[int] | None = field(repr=False)  # PDFs: offset in `text` where page i+1 begins
    sha256: str
    notices: tuple[str, ...] = ()  # what the reader should know about how the file was read (bytes replaced, ...)

    def page_of(self, char_offset: int) -> int | None:
        """1-based page holding `char_offset`; None for non-PDFs or offsets outside the text."""
        if self.page_starts is None or not 0 <= char_offset <= len(self.text):
            return None
        return bisect.bisect_right(self.page_starts, char_offset)


def load_document(path: str | os.PathLike, name: str | None = None, limits: Limits = LIMITS) -> Document:
    """Read a file from disk; `name` is what the user called it (upload temp files have other names)."""
    name = os.path.basename(name or os.fspath(path))
    _kind_of(name)  # refuse an unsupported type before reading anything
    try:
        _check_size(os.path.getsize(path), name, limits.file_bytes)  # before reading: not 2 GB into memory
        with open(path, "rb") as f:
            data = f.read(limits.file_bytes + 1)  # the file may grow between the check and the read
    except OSError as e:
        log.warning("reading %s failed: %s", path, e)
        raise IngestError(f"“{name}” couldn't be opened. Please upload it again.") from e
    return load_bytes(data, name, limits)


def load_bytes(data: bytes, name: str, limits: Limits = LIMITS) -> Document:
    name = os.path.basename(name)
    kind = _kind_of(name)
    _check_size(len(data), name, limits.file_bytes)
    if not data.strip():
        raise IngestError(f"“{name}” is empty. Please choose a file that contains text.")
    stem = os.path.splitext(name)[0]
    loader = {"txt": _load_txt, "md": _load_md, "pdf": _load_pdf, "epub": _load_epub}[kind]
    if kind in ("txt", "md"):  # a character is at most 4 bytes: refuse a sure excess before decoding it
        _check_text(len(data) // 4, name, limits.text_chars)
    notices: list[str] = []
    try:
        title, text, page_starts = loader(data, name, limits, notices)
    except IngestError:
        raise
    except MemoryError as e:  # past every budget, still too big for this machine: refuse, keep serving
        log.warning("out of memory reading %s", name)
        raise IngestError(f"“{name}” is too large to read here. Please upload a smaller file.") from e
    except Exception as e:  # a parser tripped over something we didn't foresee: still the file's fault
        log.exception("unexpected error reading %s", name)
        raise IngestError(f"Sorry, “{name}” couldn't be read: it may be damaged or in an unusual format. "
                          "Please try saving or exporting it again, or convert it to PDF or plain text.") from e
    _check_text(len(text), name, limits.text_chars)
    return Document(title=title or stem, kind=kind, text=text, page_starts=page_starts,
                    sha256=hashlib.sha256(data).hexdigest(), notices=tuple(notices))


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


def _check_text(chars: int, name: str, max_chars: int) -> None:
    if chars > max_chars:
        raise IngestError(f"“{name}” holds more than {max_chars:,} characters of text, the limit for one "
                          "document (reading that much would take days). Please upload one part of it.")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f}".removesuffix(".0")


# ---------------------------------------------------------------- plain text and Markdown

def _decode(data: bytes, name: str, notices: list[str]) -> str:
    """Bytes of a text file -> str with \\n newlines. A few bad bytes are replaced (with a notice); binary
    data is refused."""
    not_text = IngestError(f"“{name}” doesn't look like a text file. If it's a Word document or another "
                           "format, please save it as plain text (.txt) or PDF and upload that.")
    encoding = _utf16_encoding(data)
    if encoding:
        text, bad = _decode_counting(data, encoding)
        if bad > BAD_BYTES_TOLERATED * len(data):
            raise not_text
    elif data.count(b"\x00") > len(data) // 1000:  # real text has (almost) no NUL bytes; binary files have many
        raise not_text
    else:
        try:
            text, bad = data.decode("utf-8-sig"), 0
        except UnicodeDecodeError:
            text, bad = _decode_counting(data, "utf-8-sig")
            # Mostly UTF-8 with a few bad bytes (a file cut mid-character, one stray byte): keep the UTF-8.
            # No valid multi-byte character at all: more likely a legacy code page (cp1252 "naïve").
            if not (bad <= BAD_BYTES_TOLERATED * len(data) and _has_multibyte_utf8(text)):
                legacy = _decode_legacy(data)
                if legacy is not None:
                    text, bad = legacy, 0
                elif bad > BAD_BYTES_TOLERATED * len(data):
                    raise not_text from None
    if bad:
        notices.append(f"{bad:,} byte{'s' if bad != 1 else ''} of “{name}” {'were' if bad != 1 else 'was'} "
                       "not valid text and replaced with “\ufffd”; the rest was read as it is.")
    return text.replace("\x00", "").replace("\r\n", "\n").replace("\r", "\n")


def _utf16_encoding(data: bytes) -> str | None:
    """"utf-16" for a file with a UTF-16 byte order mark (Windows Notepad's "Unicode"); "utf-16-le"/"-be" for
    one without, recognised by its zero high bytes (Latin text: every other byte is NUL, on one side)."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    sample = data[:4096]
    half = len(sample) // 2
    if half >= 8:
        for encoding, zeros in (("utf-16-le", sample[1::2]), ("utf-16-be", sample[0::2])):
            if zeros.count(0) >= 0.9 * half and sample[(encoding == "utf-16-be")::2].count(0) == 0:
                return encoding
    return None


def _decode_counting(data: bytes, encoding: str) -> tuple[str, int]:
    """Decode with bad bytes replaced by U+FFFD; also return how many bytes were bad."""
    _bad_bytes.n = 0
    text = data.decode(encoding, errors="marginalia-count")
    return text, _bad_bytes.n


_bad_bytes = threading.local()  # each thread counts its own decode


def _count_and_replace(error: UnicodeDecodeError) -> tuple[str, int]:
    _bad_bytes.n += error.end - error.start
    return "\ufffd", error.end


codecs.register_error("marginalia-count", _count_and_replace)


def _has_multibyte_utf8(text: str) -> bool:
    return re.search("[^\x00-\x7f\ufffd]", text) is not None


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


def _load_txt(data: bytes, name: str, limits: Limits, notices: list[str]):
    text = _decode(data, name, notices)
    title = _PG_TITLE.search(text[:5000])  # the PG header is short; later "Title:" lines are story text
    body = _strip_gutenberg(text).strip()
    if not body:
        raise IngestError(f"“{name}” is empty. Please choose a file that contains text.")
    return (" ".join(title[1].split()) if title else None), body, None


def _load_md(data: bytes, name: str, limits: Limits, notices: list[str]):
    text = _decode(data, name, notices).strip()
    if not text:
        raise IngestError(f"“{name}” is empty. Please choose a file that contains text.")
    heading = re.search(r"^#[ \t]+(.+?)[ \t#]*$", text, re.MULTILINE)
    return (heading[1] if heading else None), text, None


# ---------------------------------------------------------------- PDF

def _load_pdf(data: bytes, name: str, limits: Limits, notices: list[str]):
    with PDFIUM_LOCK:
        try:
            pdf = pdfium.PdfDocument(data)
        except pdfium.PdfiumError as e:
            if getattr(e, "err_code", None) in (pdfium_c.FPDF_ERR_PASSWORD, pdfium_c.FPDF_ERR_SECURITY):
                raise IngestError(f"“{name}” is password-protected. Please remove the password (for example, "
                                  "open it and print it to a new PDF) and upload it again.") from e
            raise IngestError(f"“{name}” couldn't be opened as a PDF: it may be damaged or incomplete. "
                              "Please download or export it again and retry.") from e
        try:
            if len(pdf) > limits.pdf_pages:  # the page count is in the header: no page is parsed yet
                raise IngestError(f"“{name}” has {len(pdf):,} pages, over the limit of {limits.pdf_pages:,} "
                                  "pages for one document. Please upload a part of it.")
            title = pdf.get_metadata_dict().get("Title", "").strip()
            pages, chars = [], 0
            for i in range(len(pdf)):
                page = pdf[i]
                textpage = page.get_textpage()
                pages.append(textpage.get_text_range())
                textpage.close()  # close explicitly: finalizers could run later, on another thread, unlocked
                page.close()
                chars += len(pages[-1])
                _check_text(chars, name, limits.text_chars)  # stop at the page that passes the budget
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

def _load_epub(data: bytes, name: str, limits: Limits, notices: list[str]):
    broken = IngestError(f"“{name}” isn't a valid EPUB: it may be damaged or incomplete. "
                         "Please download or export it again and retry.")
    entries = _zip_entry_count(data)
    if entries is not None and entries > limits.zip_entries:  # before zipfile builds an object per entry
        raise IngestError(f"“{name}” holds {entries:,} files, over the limit of {limits.zip_entries:,} for an "
                          "EPUB. Please upload a smaller book.")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        raise broken from e
    with zf:
        budget = _Unpacked(name, limits.unpacked_bytes)
        try:
            container = _parse_xml(budget.read(zf, "META-INF/container.xml"), name)
            opf_path = container.find(".//{*}rootfile").get("full-path")
            opf = _parse_xml(budget.read(zf, opf_path), name)
        except (KeyError, AttributeError, TypeError, ET.ParseError, zipfile.BadZipFile) as e:
            raise broken from e  # a missing file or element, bad XML, a damaged entry
        title = (opf.findtext(".//{http://purl.org/dc/elements/1.1/}title") or "").strip()
        manifest = {item.get("id"): item for item in opf.iterfind(".//{*}manifest/{*}item")}
        names = set(zf.namelist())
        paths = []
        for ref in opf.iterfind(".//{*}spine/{*}itemref"):
            item = manifest.get(ref.get("idref"))
            if item is None or "html" not in (item.get("media-type") or ""):
                continue
            # Only ever a name inside the zip: an href like "../../etc/passwd" names nothing there. Nothing
            # is extracted to disk, so no path can escape.
            path = posixpath.normpath(posixpath.join(posixpath.dirname(opf_path), unquote(item.get("href") or "")))
            if path in names:
                paths.append(path)
            else:
                log.warning("%s: spine item %s is missing", name, path)
        if paths and set(paths) & _encrypted_paths(zf, names, budget):
            raise IngestError(f"“{name}” is DRM-protected, so its text can't be read. "
                              "Please upload a DRM-free copy of the book.")
        chapters, chars, not_text = [], 0, 0
        for path in paths:
            try:
                text = _html_to_text(budget.read(zf, path))
            except zipfile.BadZipFile as e:  # CRC mismatch, bad compressed data, a size that lies
                raise broken from e
            not_text += text is None
            if text:
                chapters.append(text)
                chars += len(text)
                _check_text(chars, name, limits.text_chars)
    if not chapters:
        raise IngestError(f"“{name}” contains no readable chapters. "
                          "Please check that the book opens in an e-book reader, or try a PDF or .txt version.")
    if not_text:
        notices.append(f"{not_text} chapter{'s' if not_text != 1 else ''} of “{name}” {'were' if not_text != 1 else 'was'}"
                       " not text and skipped.")
    return title, "\n\n".join(chapters), None


class _Unpacked:
    """The EPUB's budget of inflated bytes, shared by every entry read. A small zip can inflate to gigabytes
    (a "zip bomb"), and its headers may lie about sizes: the declared size is checked before an entry is
    opened, and the bytes actually inflated are counted as they stream, so no more than the budget (plus one
    chunk) is ever held."""

    CHUNK = 1 << 16

    def __init__(self, name: str, limit: int):
        self.name, self.limit, self.used = name, limit, 0

    def read(self, zf: zipfile.ZipFile, path: str) -> bytes:
        info = zf.getinfo(path)  # KeyError when missing
        if self.used + info.file_size > self.limit:
            self._refuse()
        out = bytearray()
        with zf.open(info) as f:
            while chunk := f.read(self.CHUNK):
                self.used += len(chunk)
                if self.used > self.limit:
                    self._refuse()
                out += chunk
        return bytes(out)

    def _refuse(self):
        raise IngestError(f"“{self.name}” unpacks to more than {_mb(self.limit)} MB of text and markup, the "
                          "limit for one EPUB. Please upload a smaller book, or one part of it.")


def _zip_entry_count(data: bytes) -> int | None:
    """Entries named by the zip's end-of-central-directory record (None if there is none: zipfile will say).
    0xFFFF means a Zip64 archive, with 65,535 entries or more: no book has that many."""
    eocd = data.rfind(b"PK\x05\x06", max(0, len(data) - 65_557))  # 22-byte record + up to 64 KiB of comment
    if eocd < 0 or eocd + 12 > len(data):
        return None
    return int.from_bytes(data[eocd + 10:eocd + 12], "little")


def _parse_xml(raw: bytes, name: str) -> ET.Element:
    """Parse an EPUB's XML (container, package, encryption), refusing entity declarations: they are how
    "billion laughs" expansion and external entities (files, URLs) get in, and no EPUB needs them."""
    if b"<!ENTITY" in raw or b"<\x00!\x00E\x00N\x00T\x00I\x00T\x00Y" in raw:
        raise IngestError(f"“{name}” contains XML entity declarations, which e-books don't use and which can be "
                          "used to attack the reader. Please upload a clean copy of the book.")
    return ET.fromstring(raw)


def _encrypted_paths(zf: zipfile.ZipFile, names: set[str], budget: _Unpacked) -> set[str]:
    """Files listed in META-INF/encryption.xml (DRM; font obfuscation lists only fonts)."""
    if "META-INF/encryption.xml" not in names:
        return set()
    root = _parse_xml(budget.read(zf, "META-INF/encryption.xml"), budget.name)
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


# A document type declaration, internal subset included: HTMLParser would leak the subset's end as text.
# Entities declared there are never expanded (HTMLParser knows only HTML's own), so no "billion laughs".
_DOCTYPE = re.compile(r"<!DOCTYPE[^\[>]*(?:\[.*?\][ \t\r\n]*)?>", re.IGNORECASE | re.DOTALL)


def _html_to_text(raw: bytes) -> str | None:
    """XHTML chapter -> paragraphs separated by blank lines (EPUB requires UTF-8 or UTF-16); None when the
    chapter is not text at all (an image or a binary blob listed as XHTML)."""
    is_utf16 = raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
    markup, bad = _decode_counting(raw, "utf-16" if is_utf16 else "utf-8-sig")
    if bad > BAD_BYTES_TOLERATED * len(raw) or markup.count("\x00") > len(markup) // 1000:
        return None
    parser = _TextExtractor()
    parser.feed(_DOCTYPE.sub("", markup, count=1))
    parser.close()
    paragraphs = ("\n".join(line.strip() for line in p.split("\n") if line.strip())
                  for p in re.split(r"\n[ ]*\n", "".join(parser.parts)))
    return "\n\n".join(p for p in paragraphs if p)
