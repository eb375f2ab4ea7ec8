"""Sentences close to the question, by MiniLM's similarity (the embedding model the classifier loads already): the
second signal beside the model's own copy choice. A note gets every sentence of its segment that reaches
PROPOSE_SIMILARITY even where the model copied nothing (a segment of five ledger entries gives five), and a
question none of whose sentences comes near CLOSE_SIMILARITY, with no note kept, is declined on that evidence.

PROPOSE_SIMILARITY was chosen on the tuning seed (seed 1, 24k tokens in 8k windows, bench/results/proposals/): the
recorded notes completed at 0.35 / 0.4 / 0.45 / 0.5 found 90% / 90% / 87% / 71% of the gold sentences, 71% of what
they copied gold at 0.4 (the notes alone: 31%, 51%). CLOSE_SIMILARITY: every answerable tuning case had a sentence
at 0.6 or more.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .classify import embed
from .margins import sentences_of

PROPOSE_SIMILARITY = 0.4   # a sentence this similar to the question is copied into its segment's note
CLOSE_SIMILARITY = 0.4     # no sentence this similar and no note kept: the document does not say


@lru_cache(maxsize=8)
def _query_vector(query: str, device: str) -> torch.Tensor:
    return embed([query], device)[0]


def similarities(query: str, sentences: list[str], device: str = "cpu") -> list[float]:
    """Cosine similarity of each sentence to the question (MiniLM, normalised embeddings)."""
    if not sentences:
        return []
    q = _query_vector(query, device)
    return (embed([" ".join(s.split()) for s in sentences], device) @ q).tolist()


def proposed(query: str, sentences: list[str], device: str = "cpu") -> list[int]:
    """Indexes of the sentences similar enough to the question to be copied into a note."""
    return [i for i, x in enumerate(similarities(query, sentences, device)) if x >= PROPOSE_SIMILARITY]


def closest(query: str, text: str, device: str = "cpu") -> float:
    """The similarity of the text's sentence closest to the question (0 for a text without sentences)."""
    return max(similarities(query, sentences_of(text), device), default=0.0)


def declines(query: str, text: str, kept_notes: int, device: str = "cpu") -> bool:
    """Whether the evidence says the document does not answer the question: no note kept, and no sentence of the
    text close to the question."""
    return kept_notes == 0 and closest(query, text, device) < CLOSE_SIMILARITY
