"""A battery of hostile uploads, generated here (no binaries committed), and a probe that reads each one with
engine.documents in a fresh measurement and reports what happened and the peak memory it took.

    python tests/hostile.py write DIR         # write every case's file into DIR
    python tests/hostile.py probe OUT DIR/*   # one JSON line per file: outcome, message, peak RSS; texts in OUT

Used by tests/test_ingest_hostile.py (every case, in-process ingest in a subprocess) and
tests/test_app_reliability.py (a subset uploaded through the running app).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
LATEX = SHARED / "pdf" / "pdflatex-4-pages.pdf"

MiB = 2**20
# The bound every case must stay under: peak resident memory of the probe while reading one file, over what
# it held before. The largest legal input is a 50 MB upload; its text (up to 8M characters) is held as bytes,
# as str and as the few copies decoding and cleaning make.
PEAK_RSS_BOUND_MIB = 256


@dataclass(frozen=True)
class Case:
    name: str                       # the file name, extension included
    build: Callable[[], bytes]
    refused: str | None = None      # words the message must contain; None: the file must be read
    text_has: tuple[str, ...] = ()  # read: phrases the text must contain
    text_lacks: tuple[str, ...] = ()  # read: phrases it must not contain
    notice: str | None = None       # read: words a notice must contain
    either: bool = False            # damaged input: a clear message or a text are both right
    needs: Path | None = None       # a shared fixture the case is built from


# ---------------------------------------------------------------- EPUB pieces

CONTAINER = ('<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
             '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
             '</rootfiles></container>')


def opf(items: dict[str, str], doctype: str = "", title: str = "Hostile Book") -> str:
    """A package document; `items` maps href -> media type, all of them in the spine in this order."""
    manifest = "".join(f'<item id="i{n}" href="{href}" media-type="{kind}"/>' for n, (href, kind) in
                       enumerate(items.items()))
    spine = "".join(f'<itemref idref="i{n}"/>' for n in range(len(items)))
    return (f'<?xml version="1.0" encoding="utf-8"?>{doctype}<package xmlns="http://www.idpf.org/2007/opf" '
            f'version="3.0" unique-identifier="id"><metadata xmlns:dc="http://purl.org/dc/elements/1.1/">'
            f'<dc:identifier id="id">x</dc:identifier><dc:title>{title}</dc:title></metadata>'
            f'<manifest>{manifest}</manifest><spine>{spine}</spine></package>')


def chapter(body: str, doctype: str = "<!DOCTYPE html>") -> str:
    return (f'<?xml version="1.0" encoding="utf-8"?>{doctype}<html xmlns="http://www.w3.org/1999/xhtml">'
            f'<head><title>t</title></head><body>{body}</body></html>')


XHTML = "application/xhtml+xml"
PLAIN_CHAPTER = chapter("<h1>Chapter One</h1><p>The keeper climbed the stairs at dusk.</p>")


def epub(files: dict[str, str | bytes], *, container: bool = True, compress=zipfile.ZIP_DEFLATED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compress) as zf:
        zf.writestr("mimetype", "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        if container:
            zf.writestr("META-INF/container.xml", CONTAINER)
        for name, content in files.items():
            zf.writestr(name, content)
    return out.getvalue()


def book(chapters: dict[str, str | bytes], extra: dict[str, str | bytes] | None = None, **opf_kw) -> bytes:
    files = {"OEBPS/content.opf": opf({name: XHTML for name in chapters}, **opf_kw)}
    files.update({f"OEBPS/{name}": body for name, body in chapters.items()})
    files.update(extra or {})
    return epub(files)


def deflate_bomb() -> bytes:
    """One chapter that inflates to 200 MiB (of one repeated paragraph): ~200 KB on disk."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("META-INF/container.xml", CONTAINER)
        zf.writestr("OEBPS/content.opf", opf({"big.xhtml": XHTML}))
        with zf.open("OEBPS/big.xhtml", "w", force_zip64=True) as f:
            f.write(b'<html xmlns="http://www.w3.org/1999/xhtml"><body>')
            block = b"<p>" + b"all work and no play " * 50 + b"</p>\n"
            for _ in range(200 * MiB // len(block)):
                f.write(block)
            f.write(b"</body></html>")
    return out.getvalue()


def lying_sizes() -> bytes:
    """A chapter inflating to 64 MiB whose headers claim 1,000 bytes: the declared size lies."""
    data = bytearray(book({"big.xhtml": "<html><body><p>" + "lie " * (16 * MiB) + "</p></body></html>"}))
    real = (16 * MiB * 4 + len("<html><body><p></p></body></html>")).to_bytes(4, "little")
    fake = (1000).to_bytes(4, "little")
    # Local header (size at +22) and central directory entry (size at +24) of OEBPS/big.xhtml.
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = 0
        while (at := data.find(signature, at)) >= 0:
            if data[at + offset:at + offset + 4] == real:
                data[at + offset:at + offset + 4] = fake
            at += 4
    return bytes(data)


def nested_bomb() -> bytes:
    """A book that also carries zips of zips of 32 MiB of zeros (42.zip style): never to be opened."""
    def zipped(name: str, content: bytes) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(name, content)
        return out.getvalue()
    layer = zipped("zeros.bin", bytes(32 * MiB))
    for depth in range(3):
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
            for i in range(8):
                zf.writestr(f"layer{depth}-{i}.zip", layer)
        layer = out.getvalue()
    files = {"OEBPS/content.opf": opf({"one.xhtml": XHTML, "bomb.zip": "application/zip"}),
             "OEBPS/one.xhtml": PLAIN_CHAPTER, "OEBPS/bomb.zip": layer}
    return epub(files)


def many_entries() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("META-INF/container.xml", CONTAINER)
        zf.writestr("OEBPS/content.opf", opf({"one.xhtml": XHTML}))
        zf.writestr("OEBPS/one.xhtml", PLAIN_CHAPTER)
        for i in range(12_000):
            zf.writestr(f"OEBPS/x/{i}", b"")
    return out.getvalue()


LAUGHS = ('<!DOCTYPE lolz [<!ENTITY lol "lol">'
          + "".join(f'<!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">' for i in range(1, 10))
          + "]>")
XXE = '<!DOCTYPE foo [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>'
DRM = ('<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
       'xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:EncryptedData><enc:CipherData>'
       '<enc:CipherReference URI="OEBPS/one.xhtml"/></enc:CipherData></enc:EncryptedData></encryption>')
MARKUP = ('<script>alert("x")</script><iframe src="javascript:alert(1)"></iframe>'
          '<img src=x onerror="alert(2)"><a href="javascript:alert(3)" onclick="alert(4)">click</a>'
          '<svg onload=alert(5)></svg>')


# ---------------------------------------------------------------- PDF pieces

def encrypted_pdf() -> bytes:
    import pypdf
    writer = pypdf.PdfWriter(clone_from=str(LATEX))
    writer.encrypt(user_password="secret", owner_password="owner")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def many_pages() -> bytes:
    import pypdf
    writer = pypdf.PdfWriter()
    for _ in range(3_001):
        writer.add_blank_page(width=200, height=200)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def bit_flipped(data: bytes, share: float, seed: int) -> bytes:
    rng = random.Random(seed)
    out = bytearray(data)
    for _ in range(int(len(out) * share)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4"
       b"\x89\x00\x00\x00\rIDATx\x9cc\xf8\xcf\xc0\xf0\x1f\x00\x05\x00\x01\xff\x89\x99=\x1d\x00\x00\x00\x00IEND"
       b"\xaeB`\x82")

# ---------------------------------------------------------------- text pieces

PROSE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. “Café au lait,” he said, naïvely. "
         "He trimmed the wick and wrote the weather in a small leather book.\n")
ASCII_PROSE = "The keeper trimmed the wick and wrote the weather in a small book.\n"


def _rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


CASES: list[Case] = [
    # EPUB: zip bombs and sizes
    Case("deflate-bomb.epub", deflate_bomb, refused="unpacks to more than 32 MB"),
    Case("lying-sizes.epub", lying_sizes, refused="isn't a valid EPUB"),
    Case("nested-bomb.epub", nested_bomb, text_has=("keeper climbed",)),
    Case("many-entries.epub", many_entries, refused="12,003 files, over the limit"),
    # EPUB: hostile XML
    Case("laughs-opf.epub", lambda: book({"one.xhtml": PLAIN_CHAPTER}, doctype=LAUGHS, title="&lol9;"),
         refused="entity declarations"),
    Case("laughs-content.epub", lambda: book({"one.xhtml": chapter("<p>&lol9; keeper</p>", doctype=LAUGHS)}),
         text_has=("keeper",), text_lacks=("lollol", "ENTITY")),
    Case("xxe-opf.epub", lambda: book({"one.xhtml": PLAIN_CHAPTER}, doctype=XXE, title="&xxe;"),
         refused="entity declarations"),
    Case("xxe-content.epub", lambda: book({"one.xhtml": chapter("<p>&xxe; keeper</p>", doctype=XXE)}),
         text_has=("keeper",), text_lacks=("root:", "ENTITY")),
    Case("xxe-container.epub", lambda: epub({"META-INF/container.xml": CONTAINER.replace(
        "<container", XXE + "<container", 1), "OEBPS/content.opf": opf({"one.xhtml": XHTML}),
        "OEBPS/one.xhtml": PLAIN_CHAPTER}, container=False), refused="entity declarations"),
    # EPUB: structure
    Case("path-traversal.epub", lambda: epub({
        "OEBPS/content.opf": opf({"../../../../../../etc/passwd": XHTML, "%2e%2e/%2e%2e/etc/hostname": XHTML,
                                  "/etc/passwd": XHTML, "one.xhtml": XHTML}),
        "OEBPS/one.xhtml": PLAIN_CHAPTER}), text_has=("keeper climbed",), text_lacks=("root:",)),
    Case("drm.epub", lambda: book({"one.xhtml": PLAIN_CHAPTER}, extra={"META-INF/encryption.xml": DRM}),
         refused="DRM-protected"),
    Case("no-container.epub", lambda: epub({"OEBPS/content.opf": opf({"one.xhtml": XHTML}),
                                            "OEBPS/one.xhtml": PLAIN_CHAPTER}, container=False),
         refused="isn't a valid EPUB"),
    Case("binary-chapter.epub", lambda: book({"one.xhtml": PLAIN_CHAPTER, "two.xhtml": _rand(20_000, 7)}),
         text_has=("keeper climbed",), text_lacks=("\ufffd",), notice="1 chapter of"),
    Case("markup.epub", lambda: book({"one.xhtml": chapter(f"<p>Before {MARKUP} after.</p>")}),
         text_has=("Before", "click", "after."), text_lacks=("alert(\"x\")", "<script", "<iframe")),
    # random bytes with each extension
    *[Case(f"random.{ext}", lambda ext=ext: _rand(64_000, sum(map(ord, ext))), refused=words) for ext, words in
      (("txt", "doesn't look like a text file"), ("md", "doesn't look like a text file"),
       ("pdf", "couldn't be opened as a PDF"), ("epub", "isn't a valid EPUB"))],
    Case("random-zip.epub", lambda: b"PK\x03\x04" + _rand(64_000, 3), refused="isn't a valid EPUB"),
    # PDF
    Case("truncated.pdf", lambda: LATEX.read_bytes()[:len(LATEX.read_bytes()) // 3], needs=LATEX, either=True),
    Case("bit-flipped.pdf", lambda: bit_flipped(LATEX.read_bytes(), 0.01, 1), needs=LATEX, either=True),
    Case("header-only.pdf", lambda: b"%PDF-1.7\n", refused="couldn't be opened as a PDF"),
    Case("png-named.pdf", lambda: PNG, refused="couldn't be opened as a PDF"),
    Case("encrypted.pdf", encrypted_pdf, needs=LATEX, refused="password-protected"),
    Case("many-pages.pdf", many_pages, refused="3,001 pages, over the limit of 3,000"),
    # empty and whitespace
    Case("zero-bytes.txt", lambda: b"", refused="is empty"),
    Case("zero-bytes.epub", lambda: b"", refused="is empty"),
    Case("whitespace.md", lambda: b" \n\t\r\n  \n", refused="is empty"),
    # encodings
    Case("utf16-bom.txt", lambda: PROSE.encode("utf-16"), text_has=("“Café au lait,”",)),
    Case("utf16-no-bom.txt", lambda: PROSE.encode("utf-16-le"), text_has=("“Café au lait,”",)),
    Case("cp1252.txt", lambda: (PROSE * 20).encode("cp1252"), text_has=("“Café au lait,” he said, naïvely",)),
    Case("mixed-encodings.txt", lambda: (PROSE * 40).encode() + "Zoë’s résumé.\n".encode("cp1252"),
         text_has=("“Café au lait,”", "Zo\ufffd"), notice="replaced"),
    Case("one-bad-byte.txt", lambda: (PROSE * 2000).encode() + b"\xff", text_has=("naïvely",),
         notice="1 byte of"),
    Case("nul-bytes.txt", lambda: (ASCII_PROSE * 200).encode() + b"\x00", text_has=("small book.",),
         text_lacks=("\x00",)),
    Case("nul-heavy.txt", lambda: b"word\x00" * 5000, refused="doesn't look like a text file"),
    # size and shape
    Case("single-line-5mb.txt", lambda: b"word " * (1024 * 1024), text_has=("word word",)),
    Case("too-much-text.txt", lambda: (ASCII_PROSE * 140_000).encode(), refused="more than 8,000,000 characters"),
    Case("rtl-override.txt", lambda: ("Invoice \u202egpj.exe\u202c and \u2067isolated\u2069 text.\n" * 5).encode(),
         text_has=("\u202egpj.exe",)),
    # markup in text: kept as text (the app escapes it when it shows it)
    Case("markup.txt", lambda: (MARKUP + "\n\n" + ASCII_PROSE).encode(), text_has=("<script>alert", "onerror=")),
    Case("markup.md", lambda: ("# Title <script>alert(1)</script>\n\n" + MARKUP + "\n\n[x](javascript:alert(6))\n"
                               ).encode(), text_has=("<iframe", "javascript:alert(6)")),
]


def available() -> list[Case]:
    return [c for c in CASES if c.needs is None or c.needs.exists()]


def write(folder: Path, cases: list[Case] | None = None) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for case in cases or available():
        path = folder / case.name
        path.write_bytes(case.build())
        paths[case.name] = path
    return paths


# ---------------------------------------------------------------- the probe (runs in its own process)

def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def _vm_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def probe(out: str, paths: list[str]) -> None:
    """Read each file with engine.documents; print one JSON line each and write the text read to OUT/<name>.text.
    The peak RSS is the kernel's high-water mark, reset before every file (writing 5 to
    /proc/self/clear_refs), less the resident size before it: each case is measured on its own."""
    import gc
    sys.path.insert(0, str(ROOT))
    from engine.documents import IngestError, load_document
    from app.render import segment_html
    for path in paths:
        gc.collect()
        before = _vm_rss_kib()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        record = {"name": os.path.basename(path), "bytes": os.path.getsize(path)}
        try:
            doc = load_document(path)
            record.update(ok=True, chars=len(doc.text), notices=list(doc.notices),
                          text_sha256=hashlib.sha256(doc.text.encode("utf-8", "surrogatepass")).hexdigest())
            # What the app shows of the text: markup in it must arrive escaped.
            record["rendered"] = segment_html(doc.text[:2000], 0, min(len(doc.text), 2000), 0, 1, None, 1)
        except IngestError as e:
            record.update(ok=False, message=str(e))
        record["peak_rss_mib"] = round((_vm_hwm_kib() - before) / 1024, 1)
        if record["ok"]:  # after the measurement: writing the text out is the probe's cost, not ingest's
            with open(os.path.join(out, record["name"] + ".text"), "w", encoding="utf-8",
                      errors="surrogatepass") as f:
                f.write(doc.text)
            del doc
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "write":
        for name, path in write(Path(args[0])).items():
            print(path)
    elif command == "probe":
        probe(args[0], args[1:])
    else:
        raise SystemExit(__doc__)
