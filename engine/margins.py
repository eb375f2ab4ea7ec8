"""Margin writers: the note written from the cache after each segment, then cut off again.

- `extractive` (the default): the note is either nothing ("nothing relevant here") or one to three sentences
  copied verbatim from the segment just read. The model chooses them from the cache, but under a constraint:
  at each step only the tokens that continue a copy of one of the segment's sentences (a trie over their token
  ids), or that end the note, may be chosen. Faithful by construction; and fast, because a step is needed only
  where the trie branches: once the choice is unique, the rest of the sentence is fed in one forward pass.
  Which sentence to copy is chosen by its opening (`choice="opening"`, the default): the first OPENING_TOKENS
  tokens of every candidate scored as continuations in one masked pass, the likeliest copied whole. Chosen token
  by token (`choice="token"`), a 1.5B model put its first token on "The" (how it begins an answer of its own)
  and then had to copy whichever sentence began with "The": 380 of 510 notes at 16k did.
- `scored`: the same kind of note, chosen another way: every sentence of the segment is a scratch row after the
  instruction, all scored in masked forward passes (length-normalised log-probability); the best ones that
  beat the "nothing" marker are copied. No token-by-token choice at all, but it prefills the segment again.
- `abstractive`: free generation (the paper's margins), stopped on a repeated n-gram.

Relevance costs no second prompt: at the note's first step the model puts some probability on the "nothing"
marker and the rest on starting a copy; the latter is the margin's relevance score (classifier `margin`).

The tokens of a note live in scratch room after the document: `Scratch` feeds them there (for a new question's
margins, positioned after an earlier boundary and masked to see only the cache up to it) and cuts them off.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .classify import says_nothing
from .generate import DecodeResult, Stopped, pick_token

MARGIN_STYLES = ("extractive", "scored", "abstractive")
MARKER = "NONE"                                   # what the prompts ask for when a part has nothing relevant
MARKER_WORDS = ("NONE", "None", "NO", "No", "Nothing", "NOTHING")  # first tokens that mean the same
MAX_PIECES = 3                                    # sentences in one extractive note
OPENING_TOKENS = 4                                # tokens of each candidate sentence scored to choose a copy
OPENING_FLOOR = 1e-3                              # candidates whose first token is this far below the likeliest one's
COPY_CHOICES = ("opening", "token")
ROW_CHUNK = 384                                   # scratch tokens per scoring pass (bounds the logits' memory)

# Where a sentence ends (as engine/segment.py cuts), plus single line breaks for long pieces (tables, lists).
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)|\n[ \t]*\n")
_LINE_BREAK = re.compile(r"\n")
# A field label at the start of a line ("DATES:", "SUMMARY:", "FOR FURTHER INFORMATION CONTACT:" in notices,
# forms and reports): the sentence after it is a piece of its own, so a note can copy the sentence without
# having to begin with the label (a model asked for sentences rarely starts one with "DATES").
_LABEL = re.compile(r"(?m)^[ \t]*[A-Z][A-Z&/ \-]{1,40}:(?=\s)")
_WORD_CHAR = re.compile(r"\w")


class Scratch:
    """Tokens fed after the document for one note (instruction, then the note) and cut off afterwards.

    While reading, they follow the document in the cache under plain causal attention. For a new question's
    margins (`visible` set) they sit in spare room after the document, positioned after boundary `visible`, with
    a mask that lets them see the cache up to there and the scratch tokens before them."""

    def __init__(self, runner, cache, doc_end: int, visible: int | None, stop,
                 fed: tuple[list[int], torch.Tensor] | None = None):
        """`fed`: (ids, logits) of tokens already in the cache after `doc_end` (the instruction, fed with its
        segment's last pass): the first feed of those ids returns their logits without a pass."""
        self.runner, self.cache, self.doc_end, self.stop = runner, cache, doc_end, stop
        self.visible = visible
        self.dtype = runner.model.dtype
        self.fed_ahead = fed

    @property
    def fed(self) -> int:
        return self.cache.length - self.doc_end

    @property
    def position(self) -> int:
        """The position the next scratch token takes."""
        return (self.doc_end if self.visible is None else self.visible) + self.fed

    def _mask(self, rows: list[int]) -> torch.Tensor | None:
        """[1, 1, q, kv] additive mask for `rows` (token counts) fed as independent continuations of the scratch
        so far, each seeing the visible document, the scratch and its own earlier tokens. None where plain causal
        attention already says that (one row, no hidden document part)."""
        if self.visible is None and len(rows) == 1:
            return None
        q = sum(rows)
        kv = self.cache.length + q
        mask = torch.full((q, kv), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.runner.device)
        mask[:, :self.doc_end if self.visible is None else self.visible] = 0
        mask[:, self.doc_end:self.cache.length] = 0
        start = 0
        for n in rows:
            block = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
            mask[start:start + n, self.cache.length + start:self.cache.length + start + n].masked_fill_(block, 0)
            start += n
        return mask[None, None]

    def feed(self, ids: list[int], candidates: set[int] | None = None) -> torch.Tensor:
        """Append `ids` to the scratch; the log-probabilities of the next token (`candidates`: the tokens the
        writer may choose; a server backend's scratch needs them, this one computes every token's). Several
        tokens are metered as prefill; the time of one token goes to decoding (who chose it counts it:
        Runner.decode, or the extractive writer)."""
        if self.fed_ahead is not None:
            ahead, logits = self.fed_ahead
            self.fed_ahead = None
            if ids != ahead or self.fed != len(ahead):
                raise ValueError("the scratch's first feed must be the tokens fed ahead")
            if self.stop is not None and self.stop.is_set():
                raise Stopped()
            return torch.log_softmax(logits.float(), dim=-1)  # metered as prefill when they were fed
        t = time.perf_counter()
        logits = self._pass(ids)
        meter = self.runner.meter
        if len(ids) == 1:
            meter.decode_seconds += time.perf_counter() - t
        else:
            meter.prefill_tokens += len(ids)
            meter.prefill_seconds += time.perf_counter() - t
        return torch.log_softmax(logits.float(), dim=-1)

    def _pass(self, ids: list[int]) -> torch.Tensor:
        """One forward pass of `ids` after the scratch so far; the logits after the last one."""
        return self.runner.forward(ids, self.cache, self.stop, attention_mask=self._mask([len(ids)]),
                                   position_start=self.position)

    def score_rows(self, rows: list[list[int]], first: torch.Tensor) -> list[float]:
        """The log-probability of each row of tokens as the continuation of the scratch so far (`first`: the
        log-probabilities after it)."""
        items = [(row, first, self.position) for row in rows]
        return score_continuations(self.runner, self.cache, self.stop, items,
                                   lambda fed: self._mask([n for _, n in fed]))


def score_continuations(runner, cache, stop, items: list[tuple[list[int], torch.Tensor, int]], mask_for,
                        room: int = ROW_CHUNK) -> list[float]:
    """The log-probability of each item's row of tokens as a continuation of its scratch. An item: (row, the
    log-probabilities before it, the position its first token takes). Each row but its last token is fed (the
    last one's logits predict nothing scored) in masked passes of up to `room` tokens or the room the cache has
    left (`mask_for([(item index, tokens fed)])`: each row sees what its scratch sees and its own earlier
    tokens), and cut off again."""
    base = cache.length
    # A preallocated cache has the reading's margin reserve left at least (engine/wim.py): passes fit in it.
    chunk = min(room, getattr(cache, "capacity", base + room) - base)
    normalised: dict[int, torch.Tensor] = {}  # once per scratch, not per row: a scratch's rows share its logits
    scores = []
    for row, first, _ in items:
        if id(first) not in normalised:
            normalised[id(first)] = torch.log_softmax(first.float(), dim=-1)
        scores.append(float(normalised[id(first)][row[0]]))
    order = [i for i, (row, _, _) in enumerate(items) if len(row) > 1]
    while order:
        batch, size = [], 0
        while order and (not batch or size + len(items[order[0]][0]) - 1 <= chunk):
            batch.append(order.pop(0))
            size += len(items[batch[-1]][0]) - 1
        ids = [t for i in batch for t in items[i][0][:-1]]
        positions = [items[i][2] + j for i in batch for j in range(len(items[i][0]) - 1)]
        t = time.perf_counter()
        try:
            mask = mask_for([(i, len(items[i][0]) - 1) for i in batch])
            logits = runner.forward(ids, cache, stop, attention_mask=mask, positions=positions, all_logits=True)
        finally:
            cache.truncate(base)
        runner.meter.prefill_tokens += len(ids)
        runner.meter.prefill_seconds += time.perf_counter() - t
        lp = torch.log_softmax(logits.float(), dim=-1)
        start = 0
        for i in batch:
            row = items[i][0]
            scores[i] += sum(float(lp[start + j - 1, row[j]]) for j in range(1, len(row)))
            start += len(row) - 1
    return scores


@dataclass(frozen=True)
class Piece:
    """A sentence of the segment a note may copy: its text, where it is, and its tokens at the start of a note
    (`ids`) and after another piece and a space (`ids_after`)."""
    text: str
    span: tuple[int, int]
    ids: tuple[int, ...]
    ids_after: tuple[int, ...]


def sentence_spans(text: str, start: int = 0, end: int | None = None,
                   skip: tuple[tuple[int, int], ...] = ()) -> list[tuple[int, int]]:
    """text[start:end] cut where a note's pieces are cut: at sentence ends, paragraph breaks, and around field
    labels (the labels themselves left out). `skip`: spans never copied (a paginated text's running lines), cut
    out of the sentences they sit in. The spans are not stripped and may hold no word."""
    end = len(text) if end is None else end
    cuts = {m.end() for m in _SENTENCE_END.finditer(text, start, end)}
    found = [m.span() for m in _LABEL.finditer(text, start, end)]
    labels = {b for _, b in found}
    skipped = [(a, b) for a, b in skip if a < end and b > start]
    cuts |= labels | {a for a, _ in found} | {x for span in skipped for x in span}
    edges = [start, *sorted(c for c in cuts if start < c < end), end]
    return [(a, b) for a, b in zip(edges, edges[1:])
            if b not in labels  # the labels themselves: not copied
            and not any(x <= a and b <= y for x, y in skipped)]


def sentences_of(text: str) -> list[str]:
    """The sentences a note's pieces are cut into, stripped, those with a word in them."""
    return [text[a:b].strip() for a, b in sentence_spans(text) if _WORD_CHAR.search(text, a, b)]


def pieces_of(text: str, start: int, end: int, tokenizer, max_tokens: int,
              skip: tuple[tuple[int, int], ...] = ()) -> list[Piece]:
    """The segment text[start:end] cut into sentences (`sentence_spans`) of at most `max_tokens` tokens (a longer
    one is cut at line breaks, then between words), stripped of surrounding white space; only pieces with a word
    in them."""
    spans = sentence_spans(text, start, end, skip)
    out: list[Piece] = []

    def add(a: int, b: int, depth: int = 0) -> None:
        raw = text[a:b]
        a += len(raw) - len(raw.lstrip())
        b -= len(raw) - len(raw.rstrip())
        if a >= b or not _WORD_CHAR.search(text, a, b):
            return
        piece = text[a:b]
        ids = tokenizer.encode(piece, add_special_tokens=False)
        if len(ids) > max_tokens:
            if depth == 0 and "\n" in piece:
                edges = [a, *(a + m.end() for m in _LINE_BREAK.finditer(piece)), b]
            else:  # between words, about `max_tokens` tokens apart (a token is at least one character)
                words = [a + m.start() for m in re.finditer(r"\s\S", piece)]
                step = max(1, len(words) * max_tokens // (2 * len(ids)))
                edges = [a, *words[step::step], b]
                if len(edges) == 2:
                    edges = [a, (a + b) // 2, b]
            for x, y in zip(edges, edges[1:]):
                add(x, y, depth + 1)
            return
        after = tokenizer.encode(" " + piece, add_special_tokens=False)
        if tokenizer.decode(ids) != piece or tokenizer.decode(after) != " " + piece:
            return  # a tokenizer that does not give the text back (normalising ones): not copyable exactly
        out.append(Piece(piece, (a, b), tuple(ids), tuple(after)))

    for a, b in spans:
        add(a, b)
    return out


@dataclass
class _Node:
    children: dict[int, "_Node"] = field(default_factory=dict)
    ends: list[int] = field(default_factory=list)     # pieces whose tokens end here
    below: set[int] = field(default_factory=set)      # pieces whose tokens pass through here


def _trie(pieces: list[Piece], after: bool) -> _Node:
    root = _Node()
    for i, p in enumerate(pieces):
        node = root
        node.below.add(i)
        for t in (p.ids_after if after else p.ids):
            node = node.children.setdefault(t, _Node())
            node.below.add(i)
        node.ends.append(i)
    return root


def marker_ids(tokenizer) -> set[int]:
    """The first tokens of the ways a note says "nothing relevant" (NONE, None, No, ...)."""
    return {tokenizer.encode(w, add_special_tokens=False)[0] for w in MARKER_WORDS}


def first_step_relevance(logprobs: torch.Tensor, marker: set[int], starts: set[int] | None = None) -> float:
    """The note's relevance from its first step: P(write) / (P(write) + P(say nothing)). `starts`: the tokens a
    note can begin with (a copy's first tokens); None: any token but the marker's (a free-form note)."""
    probs = logprobs.exp()
    nothing = float(probs[sorted(marker - (starts or set()))].sum())
    write = 1.0 - nothing if starts is None else float(probs[sorted(starts)].sum()) if starts else 0.0
    return write / (write + nothing) if write + nothing > 0 else 0.0


@dataclass
class Note:
    """A finished margin: its text, the spans it copied, relevance from the note itself, and how it ended."""
    text: str
    spans: tuple[tuple[int, int], ...] = ()
    relevance: float | None = None      # P(copy) / (P(copy) + P(nothing)) at the first step
    steps: int = 0                      # forward passes after the instruction
    tokens: int = 0                     # tokens of the note
    ending: str = "end"                 # end | nothing | limit | repeat | proposed (the evidence's copies only)
    proposed: int = 0                   # sentences the evidence added to the model's copy (engine/evidence.py)


class Extractive:
    """Constrained copying (see the module's docstring)."""

    def __init__(self, tokenizer, stop_ids: set[int], max_tokens: int, temperature: float = 0.0, generator=None,
                 threshold: float = 0.5, choice: str = "opening"):
        if choice not in COPY_CHOICES:
            raise ValueError(f"unknown copy choice {choice!r}; one of {', '.join(COPY_CHOICES)}")
        self.tokenizer, self.max_tokens, self.threshold = tokenizer, max_tokens, threshold
        self.end_ids = set(stop_ids)
        self.temperature, self.generator = temperature, generator
        self.marker_ids = marker_ids(tokenizer)
        self.choice = choice

    def _choose(self, logits: torch.Tensor, allowed: set[int]) -> int:
        index = torch.tensor(sorted(allowed), dtype=torch.long, device=logits.device)
        return int(index[pick_token(logits[index], self.temperature, self.generator)])

    def write(self, scratch: Scratch, instruction: list[int], pieces: list[Piece]) -> Iterator[str]:
        """Yield the note's text as each piece is chosen; return the Note."""
        first, after = _trie(pieces, False), _trie(pieces, True)
        used: list[int] = []
        budget = self.max_tokens
        # By opening: the piece being copied, chosen whole; the trie walk follows only it. A scratch that cannot
        # score rows (a server's) chooses token by token.
        by_opening = self.choice == "opening" and hasattr(scratch, "score_rows")
        chosen: int | None = None

        def fits(i: int, room: int) -> bool:
            return i not in used and len(pieces[i].ids_after) <= room

        def open_children(node: _Node) -> dict[int, _Node]:
            if chosen is not None:
                return {t: c for t, c in node.children.items() if chosen in c.below}
            return {t: c for t, c in node.children.items() if any(fits(i, budget) for i in c.below)}

        starts = open_children(first)
        logits = scratch.feed(instruction, set(starts) | self.marker_ids)
        relevance = first_step_relevance(logits, self.marker_ids, set(starts))
        # Copy or say nothing: decided on the whole probability of starting a copy against that of the marker
        # (spread over many first tokens, a copy would lose a token-by-token argmax it should win).
        if not starts or relevance < self.threshold:
            return Note("", (), relevance, 0, 0, "nothing")
        if by_opening:
            chosen, _ = self._opening(scratch, logits, pieces, [i for i in range(len(pieces)) if fits(i, budget)],
                                      after=False)
            token = pieces[chosen].ids[0]
        else:
            token = self._choose(logits, set(starts))
        node, pending, steps, tokens = first, [], 0, 0
        while True:
            node = node.children[token]
            pending.append(token)
            while True:  # follow the trie while the choice is forced: those tokens need no step of their own
                kids = open_children(node)
                done = [i for i in node.ends if i not in used and chosen in (None, i)]
                if done or len(kids) != 1:
                    break
                token, node = next(iter(kids.items()))
                pending.append(token)
            tokens += len(pending)
            if done and chosen is not None:
                chosen, kids = None, {}  # copied whole: what follows is the end or another piece
            if done and not kids and (len(used) + 1 >= MAX_PIECES or not open_children(after)):
                # nothing left to choose: the note ends without another pass
                return (yield from self._last(done[0], pieces, used, relevance, steps, tokens))
            options = set(kids)
            nxt: set[int] = set()
            if done:
                options |= self.end_ids
                if len(used) + 1 < MAX_PIECES:
                    budget_after = budget - len(pieces[done[0]].ids_after)
                    nxt = {t for t, c in after.children.items()
                           if any(i != done[0] and fits(i, budget_after) for i in c.below)}
                    options |= nxt - set(kids)
            if not options:  # a finished piece with no way to go on or to end (no end tokens: fixed-length runs)
                return (yield from self._last(done[0], pieces, used, relevance, steps, tokens))
            logits = scratch.feed(pending, options)
            steps += 1
            if len(pending) == 1:  # a choice the model made token by token: a decode step
                scratch.runner.meter.decode_tokens += 1
            pending = []
            if by_opening and done:
                chosen = self._go_on(scratch, logits, pieces, nxt, done[0], budget, fits) if nxt else None
                token = (self._choose(logits, self.end_ids or options) if chosen is None
                         else pieces[chosen].ids_after[0])
            else:
                token = self._choose(logits, options)
            if token in kids:
                continue
            used.append(done[0])
            budget -= len(pieces[done[0]].ids_after)
            yield self._streamed(pieces, used)
            if token in self.end_ids:
                return self._note(pieces, used, relevance, steps, tokens)
            node = after

    def _go_on(self, scratch, logits: torch.Tensor, pieces: list[Piece], nxt: set[int], finished: int,
               budget: int, fits) -> int | None:
        """After a copied piece: the piece to copy next, or None to end the note. Ending wins unless some
        piece's opening is likelier than the end token (sequence against sequence; the whole probability of
        every next first token bounds them all, so a clear end costs no scoring pass)."""
        end = torch.logsumexp(logits[sorted(self.end_ids)], 0) if self.end_ids else torch.tensor(-math.inf)
        if self.end_ids and torch.logsumexp(logits[sorted(nxt)], 0) <= end:
            return None
        room = budget - len(pieces[finished].ids_after)
        best, score = self._opening(scratch, logits, pieces,
                                    [i for i in range(len(pieces)) if i != finished and fits(i, room)], after=True)
        return best if score > end else None

    def _opening(self, scratch, logits: torch.Tensor, pieces: list[Piece], candidates: list[int],
                 after: bool) -> tuple[int, float]:
        """(piece, log-probability of its opening): of the candidates, the one whose first OPENING_TOKENS tokens
        the model finds likeliest after the scratch so far (sampled from them when the temperature is above
        0). Candidates whose first token is OPENING_FLOOR times less likely than the likeliest first token are
        not scored."""
        opening = [list((pieces[i].ids_after if after else pieces[i].ids)[:OPENING_TOKENS]) for i in candidates]
        firsts = torch.tensor([float(logits[row[0]]) for row in opening])
        keep = [k for k in range(len(candidates)) if firsts[k] >= firsts.max() + math.log(OPENING_FLOOR)]
        if len(keep) == 1 and not after:  # the only choice, and no end to weigh it against: no pass
            return candidates[keep[0]], float(firsts[keep[0]])
        scores = torch.tensor(scratch.score_rows([opening[k] for k in keep], logits))
        k = pick_token(scores, self.temperature, self.generator)
        return candidates[keep[k]], float(scores[k])

    def _last(self, piece: int, pieces: list[Piece], used: list[int], relevance: float, steps: int,
              tokens: int) -> Iterator[str]:
        """Stream the note's last piece; return the Note."""
        used.append(piece)
        yield self._streamed(pieces, used)
        return self._note(pieces, used, relevance, steps, tokens)

    @staticmethod
    def _note(pieces: list[Piece], used: list[int], relevance: float, steps: int, tokens: int) -> Note:
        return Note(" ".join(pieces[i].text for i in used), tuple(pieces[i].span for i in used), relevance, steps,
                    tokens)

    @staticmethod
    def _streamed(pieces: list[Piece], used: list[int]) -> str:
        """The text the last chosen piece adds to the note."""
        return (" " if len(used) > 1 else "") + pieces[used[-1]].text


class Scored:
    """Every sentence scored as a continuation of the instruction; the best that beat the marker are copied."""

    def __init__(self, tokenizer, max_tokens: int, threshold: float = 0.5):
        self.tokenizer, self.max_tokens, self.threshold = tokenizer, max_tokens, threshold
        self.marker = tokenizer.encode(MARKER, add_special_tokens=False)
        self.marker_ids = marker_ids(tokenizer)

    def write(self, scratch: Scratch, instruction: list[int], pieces: list[Piece]) -> Iterator[str]:
        if not hasattr(scratch, "score_rows"):
            raise RuntimeError("scored margins need the local engine; use --margins extractive with a server")
        starts = {p.ids[0] for p in pieces}
        logits = scratch.feed(instruction, starts | self.marker_ids)
        relevance = first_step_relevance(logits, self.marker_ids, starts)
        if not pieces or relevance < self.threshold:
            return Note("", (), relevance, 0, 0, "nothing")
        rows = [list(p.ids) for p in pieces] + [self.marker]
        scores = [total / len(row) for total, row in zip(scratch.score_rows(rows, logits), rows)]  # per token
        bar = scores[-1]
        best = sorted((i for i in range(len(pieces)) if scores[i] > bar), key=lambda i: -scores[i])
        used, budget = [], self.max_tokens
        for i in best:
            if len(used) < MAX_PIECES and len(pieces[i].ids_after) <= budget:
                used.append(i)
                budget -= len(pieces[i].ids_after)
        used.sort()  # in the order of the text
        if used:
            yield " ".join(pieces[i].text for i in used)
        return Note(" ".join(pieces[i].text for i in used), tuple(pieces[i].span for i in used), relevance,
                    -(-sum(len(p.ids) for p in pieces) // ROW_CHUNK), sum(len(pieces[i].ids) for i in used),
                    "end" if used else "nothing")


class Abstractive:
    """Free generation, stopped at the end of the turn, on a repeated n-gram, or at the token limit."""

    def __init__(self, runner, max_tokens: int, temperature: float = 0.0, generator=None):
        self.runner, self.max_tokens = runner, max_tokens
        self.temperature, self.generator = temperature, generator
        self.marker_ids = marker_ids(runner.tokenizer)

    def write(self, scratch: Scratch, instruction: list[int], pieces: list[Piece]) -> Iterator[str]:
        logits = scratch.feed(instruction, self.marker_ids)
        relevance = first_step_relevance(logits, self.marker_ids)
        # Reading: the note follows the cache's end, fed the plain way; a new question's margins (masked
        # scratch) feed each token through the scratch.
        step = None if scratch.visible is None else (lambda t: scratch.feed([t]))
        result, decoded = DecodeResult(), 0
        for _, piece in self.runner.decode(scratch.cache, logits, self.max_tokens, scratch.stop, self.temperature,
                                           self.generator, step=step, result=result):
            decoded += 1
            if piece:
                yield piece
        text = result.text.strip()
        if says_nothing(text):
            return Note("", (), relevance, decoded, decoded, "nothing")
        return Note(text, (), relevance, decoded, decoded, result.reason)

