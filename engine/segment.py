"""Sentence-aware, lossless segmentation measured in the model's own tokens.

The whole text is tokenized once; segments are ranges of that one token sequence, cut only where a token starts
right after a sentence end (or paragraph break). So reading the segments one after another feeds the model exactly
the tokens of a single pass over the document, and the segments' character spans tile the text with no gap and no
overlap: joining them gives the input back.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from .running_lines import running_lines

# A sentence ends at . ! ? … (possibly followed by closing quotes/brackets), or at a paragraph break.
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)|\n[ \t]*\n")


@dataclass(frozen=True)
class Segment:
    index: int
    char_start: int
    char_end: int
    token_start: int
    token_end: int
    pages: tuple[int, int] | None = None

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class SegmentedText:
    text: str
    token_ids: list[int]
    segments: list[Segment]
    running: tuple[tuple[int, int], ...] = ()  # spans of the pages' running lines (engine/running_lines.py)

    def segment_ids(self, segment: Segment) -> list[int]:
        return self.token_ids[segment.token_start:segment.token_end]

    def segment_text(self, segment: Segment) -> str:
        return self.text[segment.char_start:segment.char_end]


def _cut_points(starts: list[int], text: str) -> list[int]:
    """Token indexes at which a new sentence's first token begins (never 0)."""
    cuts = []
    for match in _SENTENCE_END.finditer(text):
        i = bisect.bisect_left(starts, match.end())  # first token starting at or after the sentence end
        if 0 < i < len(starts) and (not cuts or cuts[-1] < i):
            cuts.append(i)
    return cuts


def _split_long(start: int, end: int, budget: int, starts: list[int], text: str) -> list[int]:
    """Cut points inside one over-long sentence: at most `budget` tokens apart, preferring tokens that begin
    with whitespace and never inside a multi-token character (two tokens with the same start offset)."""
    cuts, pos = [], start
    while end - pos > budget:
        best = None
        for i in range(pos + budget, pos + max(1, budget // 2), -1):
            if starts[i] > starts[i - 1]:
                if text[starts[i]:starts[i] + 1].isspace():
                    best = i
                    break
                best = best or i
        if best is None:  # pathological: no character boundary in the window; take the next one after it
            best = next((i for i in range(pos + budget, end) if starts[i] > starts[i - 1]), end)
            if best == end:
                break
        cuts.append(best)
        pos = best
    return cuts


def segment(text: str, tokenizer, target_tokens: int, page_starts: list[int] | None = None) -> SegmentedText:
    """Split `text` into segments of at most `target_tokens` tokens (a sentence longer than that is split on
    its own). `page_starts[i]` is the character offset where page i+1 begins, when the caller has pages."""
    if target_tokens < 8:
        raise ValueError("segment size must be at least 8 tokens")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    starts = [s for s, _ in enc["offset_mapping"]]
    if not ids:
        return SegmentedText(text, ids, [])
    sentence_starts = [0, *_cut_points(starts, text), len(ids)]

    # Greedy packing of whole sentences; a sentence longer than the budget is split alone.
    bounds, seg_start = [0], 0
    for s_start, s_end in zip(sentence_starts, sentence_starts[1:]):
        if s_end - s_start > target_tokens:
            if s_start > seg_start:
                bounds.append(s_start)
            bounds.extend(_split_long(s_start, s_end, target_tokens, starts, text))
            seg_start = bounds[-1]
        elif s_end - seg_start > target_tokens:
            bounds.append(s_start)
            seg_start = s_start
    bounds.append(len(ids))

    segments = []
    for index, (t0, t1) in enumerate(zip(bounds, bounds[1:])):
        c0 = 0 if t0 == 0 else starts[t0]
        c1 = len(text) if t1 == len(ids) else starts[t1]
        pages = None
        if page_starts:
            # Pages of the first and last visible characters: whitespace at a page turn belongs to no page.
            body = text[c0:c1]
            first = c0 + len(body) - len(body.lstrip())
            last = max(first, c0 + len(body.rstrip()) - 1)
            pages = (bisect.bisect_right(page_starts, first), bisect.bisect_right(page_starts, last))
        segments.append(Segment(index, c0, c1, t0, t1, pages))
    return SegmentedText(text, ids, segments, tuple(running_lines(text, page_starts)))
