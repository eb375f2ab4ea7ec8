"""The settings of one reading: how the text is segmented and read, how its margins are written and kept, and how
long its answers may be; the app, the command line and the benchmarks hand the engine one of these."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .margins import COPY_CHOICES, MARGIN_STYLES

MODES = ("wim", "llm", "rag")
WINDOWS = ("new", "sliding")


@dataclass(frozen=True)
class Settings:
    mode: str = "wim"                  # wim | llm (plain long-context) | rag (top-k segments)
    segment_tokens: int = 1024         # target segment size, in the model's tokens
    margins: str = "extractive"        # extractive (copied sentences, constrained) | scored | abstractive
    margin_tokens: int = 96            # longest margin note
    answer_tokens: int = 128           # longest answer
    # An answer that begins to loop (a list come round to its first item again) is taken back to where the loop
    # began and goes on with the next-best token there, at most this many times; then it ends before the loop.
    answer_retries: int = 3
    # Which notes are kept: combined (MiniLM, or a note sure of itself) | margin (relevance from the note itself) |
    # llm | embedding | none. combined by measurement: on the tuning seed it answered better than margin at 16k
    # (0.646 against 0.468, 12 cases) and as well in three 8k windows; docs/quality.md.
    classifier: str = "combined"
    # An extractive note copies only where P(start a copy) / (P(copy) + P(NONE)) at its first step reaches this.
    copy_threshold: float = 0.5
    # Which sentence an extractive note copies: opening (every candidate's first tokens scored, the likeliest
    # copied) | token (token by token through the sentences' trie: drawn to common first words). docs/margins.md.
    copy_choice: str = "opening"
    embedding_threshold: float = 0.3
    rag_top_k: int = 3
    temperature: float = 0.0           # 0: greedy
    seed: int = 0
    context_limit: int | None = None   # tokens the cache may hold; default: the model's context window
    window: str = "new"                # past the window: new (fresh cache + margins) | sliding (evict, re-rotate)
    # A multi-window reading keeps each window's cache for follow-up questions: in memory up to this many
    # bytes, then on disk (safetensors, in a temporary folder removed with the reading) unless told not to.
    window_cache_budget_bytes: int = 512 * 2**20
    window_cache_disk: bool = True
    keep_windows: bool = True          # keep each window's cache for follow-ups (remargin); off: none kept

    def validate(self) -> "Settings":
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if self.window not in WINDOWS:
            raise ValueError(f"window must be one of {', '.join(WINDOWS)}")
        if self.margins not in MARGIN_STYLES:
            raise ValueError(f"margins must be one of {', '.join(MARGIN_STYLES)}")
        if self.copy_choice not in COPY_CHOICES:
            raise ValueError(f"copy_choice must be one of {', '.join(COPY_CHOICES)}")
        if self.window_cache_budget_bytes < 0:
            raise ValueError("window_cache_budget_bytes must be ≥ 0")
        if self.segment_tokens < 32 or self.margin_tokens < 1 or self.answer_tokens < 1:
            raise ValueError("segment_tokens must be ≥ 32, margin_tokens and answer_tokens ≥ 1")
        if self.answer_retries < 0:
            raise ValueError("answer_retries must be ≥ 0")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def margin_prompt(self) -> str:
        """The instruction after each segment (engine/prompts/): copying asks for sentences or NONE."""
        return "margin" if self.margins == "abstractive" else "margin_extractive"
