"""An answer's citations: read from its text ("[segment 12]"), and written by the notes' words: each sentence or
list item of an answer that cites nothing is followed by the tag of the kept note (or two, when tied) that holds
the most of its words beyond the question's.

Why not ask the model to cite: told to cite "like [segment 3]", the 1.5B answered with the example's segment, or
with the note it cited instead of the fact asked for, and a list answer came out as a list of citations (seed 1,
16,000 tokens: docs/quality.md). Answered without that instruction and cited afterwards, the answer's words are
the model's own and its citations name notes that hold them. The notes are mostly copied sentences, so a shared
word is strong evidence of where an answer came from; a piece that shares no word with any note (a year the notes
do not hold, say) stays uncited rather than cited at random. An answer no piece of which could be cited ("Yes", a
name the notes spell otherwise) is cited, after its last piece, by the notes that share the most words with the
question and the answer together: the notes it was given on the question's subject (`fallback`; off for an answer
that says the document does not say). An answer the model cited itself is left as it is.

An answer whose words no kept note holds came from the text in the cache: inside one window the whole document, past
it the re-read passages. It is cited by the passages (`passages`) that hold the most of its words beyond the
question's, before any fallback: a citation to a segment whose note was not kept, which the app shows as such.
On the long-document records (seed 0, 16,000 tokens), 3 of 56 default answers with a kept note cited none without
this: the notes kept were about other things and the answer's words were in the document.
"""
from __future__ import annotations

import re
from typing import Callable

_STOP = frozenset(
    "a an the of in on at to for from by with and or but nor is are was were be been being am it its this that these "
    "those as which who whom whose what where when why how does did do done has have had not no yes he she they his "
    "her hers their theirs them him i me my you your we our us there here into onto over under after before than "
    "then so such also only just very too can could would should will shall may might must about up down out off "
    "one all any each some most more other same answer question document note notes segment segments page".split())
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
# Pieces of an answer: sentences (a stop followed by a space) and list items (a comma, semicolon or line break),
# but not the comma of a date ("August 3, 2020"): a year cut off as a piece of its own was cited by any note that
# held the year.
PIECE_END = re.compile(r"(?<=[.!?])\s+|(?<=[,;])\s+(?!\d)|\n+")
_TRAILING = re.compile(r"[\s.,;:!?\"'”’)]*$")
# "[segment 12]", "[segments 3 and 5]", "[segment 3, page 2]", "[segments 4-6]": one citation each.
CITATION = re.compile(r"\[\s*(?:segments?|parts?)\s+([0-9][0-9,;\s\-–and]*)(?:,?\s*pages?\s+[0-9\-–]+)?\s*\]",
                      re.IGNORECASE)


def cited(text: str, segments: int) -> list[int]:
    """The segment indexes (0-based, in order of first citation) that `text` cites, among `segments`."""
    found: list[int] = []
    for match in CITATION.finditer(text):
        for a, b in re.findall(r"(\d+)\s*(?:[-–]\s*(\d+))?", match.group(1)):
            lo, hi = int(a), int(b or a)
            for n in range(lo, min(hi, lo + 50) + 1):
                if 1 <= n <= segments and n - 1 not in found:
                    found.append(n - 1)
    return found


def without_citations(text: str) -> str:
    """The answer's words with its citations taken out (what a score compares)."""
    words = re.sub(r"[ \t]{2,}", " ", CITATION.sub("", text))
    return re.sub(r"\s+([.,;:!?])", r"\1", words).strip()


def content_words(text: str) -> set[str]:
    """Lower-cased words that carry meaning (no stop words; a plural's s dropped, so 'keys' meets 'key')."""
    out = set()
    for w in _WORD.findall(text.lower()):
        if w in _STOP or (len(w) < 3 and not w.isdigit()):
            continue
        out.add(w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w)
    return out


def best_notes(piece: str, notes: dict[int, set[str]], asked: set[str], most: int = 2) -> list[int]:
    """The notes (segment indexes) sharing the most of `piece`'s words that the question does not hold, at least
    one; at most `most` tied, the later ones in reading order (a later note is the newer state of a fact)."""
    words = content_words(piece) - asked
    if not words:
        return []
    # Numbers alone (a year, a day) do not tie a piece that has words to a note: "August 3, 2020" is not in a
    # note that holds only "2020" (the Federal Register answer was cited by two such notes).
    needs_word = any(not w.isdigit() for w in words)

    def overlap_with(note: set[str]) -> int:
        shared = words & note
        return len(shared) if not needs_word or any(not w.isdigit() for w in shared) else 0

    overlap = {i: overlap_with(w) for i, w in notes.items()}
    top = max(overlap.values(), default=0)
    if top == 0:
        return []
    return sorted(i for i, n in overlap.items() if n == top)[-most:]


def attributed(text: str, notes: dict[int, str], query: str, label: Callable[[int], str],
               fallback: bool = True, passages: dict[int, str] | None = None) -> str:
    """`text` with a citation ("[segment 3]", named by `label`) after each piece whose words a note holds; an
    answer none of whose pieces a note holds, cited by the `passages` (segment index: text in the cache) that hold
    its pieces' words; with `fallback`, an answer still uncited is cited by the notes closest to question and
    answer together."""
    if not (notes or passages) or not text.strip() or CITATION.search(text):
        return text
    note_words = {i: content_words(t) for i, t in notes.items() if t}
    asked = content_words(query)
    cited_text = _cite_pieces(text, note_words, asked, label)
    if cited_text == text and passages:
        cited_text = _cite_pieces(text, {i: content_words(t) for i, t in passages.items() if t}, asked, label)
    if cited_text != text or not fallback:
        return cited_text
    found = best_notes(f"{query} {text}", note_words, set())
    if not found:
        return text
    tail = _TRAILING.search(text).start()
    return text[:tail] + "".join(f" [{label(i)}]" for i in found) + text[tail:]


def _cite_pieces(text: str, words: dict[int, set[str]], asked: set[str], label: Callable[[int], str]) -> str:
    out, start = [], 0
    for end in [m.start() for m in PIECE_END.finditer(text)] + [len(text)]:
        out.append(_cite(text[start:end], words, asked, label))
        out.append(text[end:_next_start(text, end)])
        start = _next_start(text, end)
    return "".join(out)


def _next_start(text: str, end: int) -> int:
    m = PIECE_END.match(text, end)
    return m.end() if m else end


def _cite(piece: str, note_words: dict[int, set[str]], asked: set[str], label: Callable[[int], str]) -> str:
    if not piece.strip():
        return piece
    found = best_notes(piece, note_words, asked)
    if not found:
        return piece
    tail = _TRAILING.search(piece).start()
    return piece[:tail] + "".join(f" [{label(i)}]" for i in found) + piece[tail:]
