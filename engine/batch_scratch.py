"""A new question's margins at many boundaries of one window, written together: one forward pass per step
for all of them, so the weights are read once per step instead of once per margin.

Each boundary gets a row of scratch tokens after the document, positioned after that boundary and masked to
see the cache up to it and its own earlier scratch tokens (engine/margins.py's `Scratch`, one row per
boundary instead of one at a time). The margin writers stay as they are: each runs in a thread of its own
whose `feed` parks until the coordinator has fed every row's request in one pass. Only one writer runs at a
time (the coordinator hands control to each in turn), so they race on nothing and run in a fixed order.
"""
from __future__ import annotations

import threading
import time

import torch

from .generate import Stopped
from .margins import score_continuations

PASS_TOKENS = 512  # tokens per masked pass (the instructions' pass): bounds its [tokens x context] mask


class RowScratch:
    """What a margin writer sees of its row: the `Scratch` interface (feed, visible, cache, runner, stop)."""

    def __init__(self, batch: "BatchScratch", visible: int):
        self.batch, self.visible = batch, visible
        self.runner, self.cache, self.stop = batch.runner, batch.cache, batch.stop
        self.slots: list[int] = []          # cache slots holding this row's tokens
        self.request: list[int] | None = None
        self.scoring: tuple[list[list[int]], torch.Tensor] | None = None   # rows to score, the logits before them
        self.result: torch.Tensor | None = None
        self.abort = False
        self.resume, self.parked = threading.Event(), threading.Event()
        self.pieces: list[str] = []
        self.note = None
        self.error: BaseException | None = None
        self.finished = False

    @property
    def position(self) -> int:
        return self.visible + len(self.slots)

    def feed(self, ids: list[int], candidates: set[int] | None = None) -> torch.Tensor:
        """Park until the coordinator has fed `ids` (with every other row's request); their log-probabilities."""
        self.request = list(ids)
        return self._wait()

    def score_rows(self, rows: list[list[int]], first: torch.Tensor) -> list[float]:
        """As margins.Scratch.score_rows: park until the coordinator has scored `rows` (with every other row's
        rows to score, in as few passes as the room allows); their log-probabilities."""
        self.scoring = (rows, first)
        return self._wait()

    def _wait(self):
        """Park until the coordinator has served this row's request; its result."""
        self.parked.set()
        self.resume.wait()
        self.resume.clear()
        if self.abort:
            raise Stopped()
        return self.result

    def run(self, writer, instruction: list[int], pieces) -> None:
        self.resume.wait()
        self.resume.clear()
        try:
            if self.abort:  # the batch failed before this row's first turn: never start the writer
                raise Stopped()
            gen = writer.write(self, instruction, pieces)
            while True:
                try:
                    self.pieces.append(next(gen))
                except StopIteration as done:
                    self.note = done.value
                    break
        except BaseException as exc:  # handed to the coordinator, which raises it in the reading's thread
            self.error = exc
        finally:
            self.finished = True
            self.parked.set()


class BatchScratch:
    """Rows of scratch after `doc_end` in `cache`, one per boundary, fed together."""

    def __init__(self, runner, cache, doc_end: int, stop):
        self.runner, self.cache, self.doc_end, self.stop = runner, cache, doc_end, stop
        self.dtype = runner.model.dtype

    def write(self, jobs: list[tuple[int, object, list[int], list]]) -> list[RowScratch]:
        """jobs: (visible, writer, instruction, pieces) per boundary. Runs every writer to its end; returns
        the rows (their `note` and streamed `pieces`) in the order of `jobs`. The cache is cut back after."""
        rows = [RowScratch(self, visible) for visible, *_ in jobs]
        threads = [threading.Thread(target=row.run, args=job[1:], daemon=True) for row, job in zip(rows, jobs)]
        for thread in threads:
            thread.start()
        try:
            for row in rows:
                self._hand_over(row)
            while True:
                waiting = [row for row in rows if not row.finished]
                if not waiting:
                    break
                self._feed_all(waiting)
                for row in waiting:
                    self._hand_over(row)
            for row in rows:
                if row.error is not None:
                    raise row.error
            return rows
        except BaseException:
            for row in rows:
                if not row.finished:
                    row.abort = True
                    self._hand_over(row)
            raise
        finally:
            for thread in threads:
                thread.join()
            self.cache.truncate(self.doc_end)

    @staticmethod
    def _hand_over(row: RowScratch) -> None:
        """Let `row`'s writer run until it asks for its next pass or ends."""
        row.parked.clear()
        row.resume.set()
        row.parked.wait()

    def _feed_all(self, rows: list[RowScratch]) -> None:
        """Every row's request, in as few masked passes as PASS_TOKENS allows (one, for single tokens); then
        every row's rows to score."""
        group: list[RowScratch] = []
        for row in (r for r in rows if r.request is not None):
            if group and sum(len(r.request) for r in group) + len(row.request) > PASS_TOKENS:
                self._pass(group)
                group = []
            group.append(row)
        if group:
            self._pass(group)
        scoring = [row for row in rows if row.scoring is not None]
        if scoring:
            self._score(scoring)

    def _score(self, rows: list[RowScratch]) -> None:
        """Every row's rows to score, together (margins.score_continuations), each masked to see its scratch
        row's view and its own earlier tokens, in passes of at most PASS_TOKENS."""
        items = [(r, row.scoring[1], row.position) for row in rows for r in row.scoring[0]]
        owners = [row for row in rows for _ in row.scoring[0]]

        def mask_for(fed: list[tuple[int, int]]) -> torch.Tensor:
            base, q = self.cache.length, sum(n for _, n in fed)
            mask = torch.full((q, base + q), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.runner.device)
            start = 0
            for i, n in fed:
                _let_see(mask, owners[i], start, n, base)
                start += n
            return mask[None, None]

        scores = score_continuations(self.runner, self.cache, self.stop, items, mask_for, PASS_TOKENS)
        start = 0
        for row in rows:
            count = len(row.scoring[0])
            row.result, row.scoring = scores[start:start + count], None
            start += count

    def _pass(self, rows: list[RowScratch]) -> None:
        t = time.perf_counter()
        base = self.cache.length
        ids = [tok for row in rows for tok in row.request]
        positions = [row.position + j for row in rows for j in range(len(row.request))]
        q = len(ids)
        mask = torch.full((q, base + q), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.runner.device)
        start = 0
        for row in rows:
            _let_see(mask, row, start, len(row.request), base)
            start += len(row.request)
        counts = [len(row.request) for row in rows]
        ends = [sum(counts[:i + 1]) - 1 for i in range(len(rows))]  # each row's last token: its next-token logits
        logits = self.runner.forward(ids, self.cache, self.stop, attention_mask=mask[None, None],
                                     positions=positions, keep=ends)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        start = 0
        for i, (row, n) in enumerate(zip(rows, counts)):
            row.slots.extend(range(base + start, base + start + n))
            row.result = logprobs[i]
            row.request = None
            start += n
        # Metered as Scratch.feed meters: requests of several tokens are prefill; a pass of single chosen
        # tokens is decoding time (the writers count those tokens themselves).
        meter, seconds = self.runner.meter, time.perf_counter() - t
        prefill = sum(n for n in counts if n > 1)
        meter.prefill_tokens += prefill
        if prefill:
            meter.prefill_seconds += seconds
        else:
            meter.decode_seconds += seconds


def _let_see(mask: torch.Tensor, row: RowScratch, start: int, n: int, base: int) -> None:
    """Open `mask` for the n tokens fed from `start` in a pass after `base`: they see the document up to their
    row's boundary, the row's scratch tokens, and their own earlier tokens."""
    block = slice(start, start + n)
    mask[block, :row.visible] = 0
    if row.slots:
        mask[block, torch.tensor(row.slots, device=mask.device)] = 0
    causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    mask[block, base + start:base + start + n].masked_fill_(causal, 0)
