"""The lines a paginated text repeats at the top or bottom of its pages (running heads, print codes, "page 3 of
9"), found from the text and its page starts alone, so that a margin never copies them as a fact.

A line is running when, with its numbers read as any number, it opens or closes at least a third of the pages
(and at least three of them). A running line that PDF extraction glued onto the end of a body line ("...from
Soekarno-VerDate Sep<11>2014 16:21 ...") is found there too; the body text before it is not.
"""
from __future__ import annotations

import re

EDGE_LINES = 3  # lines at each end of a page where running heads and footers sit
MIN_PAGES = 3
MIN_SHARE = 1 / 3  # a quarter would take a chapter's repeated line; a half misses heads that alternate sides
MIN_LETTERS = 4  # a bare page number or a rule of dashes has nothing a note could copy anyway

_NUMBER = re.compile(r"\d+")
_LETTER = re.compile(r"[^\W\d_]")


def _shape(line: str) -> str:
    return _NUMBER.sub("#", " ".join(line.split()))


def _edge_lines(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) of the first and last EDGE_LINES non-blank lines of text[start:end]."""
    lines, pos = [], start
    for raw in text[start:end].split("\n"):
        a, b = pos, pos + len(raw)
        pos = b + 1
        if raw.strip():
            lines.append((a + len(raw) - len(raw.lstrip()), b - (len(raw) - len(raw.rstrip()))))
    if len(lines) <= 2 * EDGE_LINES:
        return lines
    return lines[:EDGE_LINES] + lines[-EDGE_LINES:]


def running_lines(text: str, page_starts: list[int] | None) -> list[tuple[int, int]]:
    """Character spans of `text` that are running lines, in order."""
    if not page_starts or len(page_starts) < MIN_PAGES:
        return []
    bounds = [*page_starts, len(text)]
    pages = [_edge_lines(text, a, b) for a, b in zip(bounds, bounds[1:])]
    seen: dict[str, set[int]] = {}
    for number, lines in enumerate(pages):
        for a, b in lines:
            shape = _shape(text[a:b])
            if len(_LETTER.findall(shape)) >= MIN_LETTERS:
                seen.setdefault(shape, set()).add(number)
    needed = max(MIN_PAGES, MIN_SHARE * len(pages))
    shapes = [shape for shape, on in seen.items() if len(on) >= needed]
    if not shapes:
        return []
    # A running line as a pattern: its words as they stand, any number where it had one, any run of spaces.
    patterns = [re.compile(r"\s+".join(r"\d+".join(re.escape(part) for part in word.split("#"))
                                       for word in shape.split(" ")) + r"$")
                for shape in sorted(shapes, key=len, reverse=True)]
    spans = []
    for lines in pages:
        for a, b in lines:
            for pattern in patterns:
                found = pattern.search(text, a, b)
                if found:
                    spans.append(found.span())
                    break
    return sorted(spans)
