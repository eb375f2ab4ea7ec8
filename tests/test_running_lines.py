"""Running lines (a paginated text's heads, footers and print codes) are found from the text and its page starts,
so that notes never copy them; body text, and any text without pages, is left alone."""
from engine.documents import load_document
from engine.running_lines import running_lines

from conftest import shared


def _pages(lines_per_page: list[list[str]]) -> tuple[str, list[int]]:
    pages = ["\n".join(lines) for lines in lines_per_page]
    starts, offset = [], 0
    for p in pages:
        starts.append(offset)
        offset += len(p) + 2
    return "\n\n".join(pages), starts


def test_the_federal_register_running_lines_are_found_on_every_page():
    doc = load_document(shared("pdf", "federal-register-2020-17221.pdf"))
    spans = running_lines(doc.text, doc.page_starts)
    texts = [doc.text[a:b] for a, b in spans]
    pages = len(doc.page_starts)
    assert sum(t.startswith("VerDate Sep<11>2014") for t in texts) == pages
    assert sum(t == "jbell on DSKJLSW7X2PROD with PROPOSALS" for t in texts) == pages
    # The page head alternates sides ("Federal Register / ... 47699", "47700 Federal Register / ..."); page 1
    # has none.
    assert sum("Federal Register / Vol. 85, No. 152" in t for t in texts) == pages - 1
    # On page 1 the print code is glued to a body line: only the code is running, the sentence is not.
    glued = next(a for a, b in spans if a < doc.page_starts[1] and doc.text.startswith("VerDate", a))
    assert doc.text[glued - len("from Soekarno-"):glued] == "from Soekarno-"
    body = doc.text.index("The FAA must receive comments")
    assert not any(a <= body < b for a, b in spans)


def test_lines_repeated_on_few_pages_or_without_pages_are_not_running():
    refrain = "And the bells rang out over the water."
    words = "harbour lantern meadow pebble quarry ribbon saddle thimble velvet willow".split()
    body = [[f"The {words[p]} lay by the {words[(p + i) % 10]} and the {words[i]}." for i in range(8)]
            for p in range(10)]
    for p in (2, 5):  # a refrain that closes two of ten pages: body text
        body[p].append(refrain)
    for p in range(10):  # a footer with the page's number on every page
        body[p].append(f"Annual Report 2020 — page {p + 1} of 10")
    text, starts = _pages(body)
    texts = [text[a:b] for a, b in running_lines(text, starts)]
    assert texts == [f"Annual Report 2020 — page {p + 1} of 10" for p in range(10)]
    assert running_lines(text, None) == [] and running_lines(text, starts[:2]) == []
