"""Which segments a reading reads, and in how many windows: whether the text fits one window, the room each window
keeps for notes and answers, the middle plain reading skips past the window, and the segments RAG retrieves."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .classify import embed


class DocumentTooLong(ValueError):
    """The text does not fit in the model's context window (or the configured budget)."""


@dataclass
class Plan:
    multiwindow: bool      # the text is read in several windows (wim), or its middle skipped (llm)
    margin_reserve: int    # room past the text for a margin's instruction and note
    answer_reserve: int    # room the last window of a multi-window reading leaves for the answer's notes and answer
    window_reserve: int    # room every window keeps free past its text
    skipped: list[int] = field(default_factory=list)  # plain reading past the window: the middle segments left out


def plan_windows(settings, doc, limit: int, prefix_tokens: int, instruction_tokens: int) -> Plan:
    """Decide whether the text fits one window of `limit` tokens after a prefix of `prefix_tokens`, with a margin's
    instruction of `instruction_tokens`. If not: `wim` reads it in several windows (earlier text is carried by its
    margins), `llm` keeps the beginning and the end (the middle is skipped, as LongBench truncates), `rag` is
    unaffected (it reads only its top-k segments). DocumentTooLong where a segment does not fit a window."""
    margin_reserve = instruction_tokens + 64 + settings.margin_tokens
    multiwindow = prefix_tokens + len(doc.token_ids) + margin_reserve > limit
    answer_reserve = settings.answer_tokens + limit // 8 + 64
    plan = Plan(multiwindow, margin_reserve, answer_reserve, max(margin_reserve, answer_reserve if multiwindow else 0))
    largest = max(seg.tokens for seg in doc.segments)
    if prefix_tokens + limit // 4 + largest + plan.window_reserve > limit:
        raise DocumentTooLong(
            f"Segments of {largest:,} tokens do not fit in a {limit:,}-token window next to the "
            "instructions and notes: choose a smaller segment size.")
    if multiwindow and settings.mode == "llm":
        budget = limit - prefix_tokens - answer_reserve
        n, keep, used = len(doc.segments), set(), 0
        for i in dict.fromkeys(j for pair in zip(range(n), reversed(range(n))) for j in pair):
            if used + doc.segments[i].tokens > budget:  # 0, n-1, 1, n-2, ...: both ends, inwards
                break
            keep.add(i)
            used += doc.segments[i].tokens
        plan.skipped = [i for i in range(n) if i not in keep]
    return plan


def document_note(settings, plan: Plan, doc, limit: int) -> str | None:
    """What the user should know about how this text will be read, if anything."""
    if settings.mode == "llm" and plan.skipped:
        return (f"Plain long-context reading: the text is {len(doc.token_ids):,} tokens but the window "
                f"holds {limit:,}; segments {plan.skipped[0] + 1}-{plan.skipped[-1] + 1} in the middle "
                "are skipped.")
    if plan.multiwindow and settings.mode == "wim":
        return (f"The text is {len(doc.token_ids):,} tokens, more than the {limit:,}-token window: it "
                "is read in several windows, and each new window carries the earlier parts as margin notes.")
    return None


def rag_choice(settings, doc, query: str, budget: int, device: torch.device) -> set[int]:
    """Indexes of the top-k segments by MiniLM similarity to the query (the RAG baseline), as many of the best as
    fit in `budget` tokens."""
    texts = [doc.segment_text(s) for s in doc.segments]
    vectors = embed([query, *texts], "cuda" if device.type == "cuda" else "cpu")
    scores = vectors[1:] @ vectors[0]
    k = min(settings.rag_top_k, len(texts))
    chosen, used = set(), 0
    for i in torch.argsort(scores, descending=True).tolist()[:k]:
        if used + doc.segments[i].tokens <= budget:
            chosen.add(i)
            used += doc.segments[i].tokens
    return chosen
