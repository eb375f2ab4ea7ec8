"""Typed events the engine streams while it reads and answers.

The engine knows nothing of its consumers: a CLI prints these, the app renders and stores them,
tests assert on them. Every event is a frozen dataclass with a `kind` tag and `to_dict()` for JSON.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "event"

    def to_dict(self) -> dict:
        return {"event": self.kind, **asdict(self)}


@dataclass(frozen=True)
class WindowStart(Event):
    """A new context window begins (long documents): text before `first_segment` lives on only in margins."""
    kind: ClassVar[str] = "window"
    window: int
    first_segment: int
    carried_margins: int
    reason: str


@dataclass(frozen=True)
class SegmentRead(Event):
    """Segment `index` has been prefilled into the KV cache."""
    kind: ClassVar[str] = "segment"
    index: int
    total: int
    tokens: int
    char_span: tuple[int, int]
    pages: tuple[int, int] | None = None
    window: int = 0
    cache_tokens: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class MarginToken(Event):
    """A piece of text appended to margin `index` as it is decoded."""
    kind: ClassVar[str] = "margin_token"
    index: int
    text: str


@dataclass(frozen=True)
class Margin(Event):
    """A finished margin note, with the classifier's verdict (None when classifier is `none`).

    `spans`: for an extractive margin, the (start, end) character offsets in the document text of each piece
    it copied, in order (the note is those pieces joined); empty for a free-form margin or "nothing relevant"."""
    kind: ClassVar[str] = "margin"
    index: int
    text: str
    relevant: bool | None
    score: float | None
    tokens: int = 0
    seconds: float = 0.0
    pages: tuple[int, int] | None = None
    spans: tuple[tuple[int, int], ...] = ()
    ending: str = ""          # end | nothing | limit | repeat | proposed: how the note ended (limit: cut at its
                              # token cap; proposed: the model copied nothing, the evidence did)


@dataclass(frozen=True)
class AnswerToken(Event):
    """The answer's next piece of text; with `restart`, the whole text kept so far, replacing what was shown (a
    loop was taken back: engine/generate.Runner.decode)."""
    kind: ClassVar[str] = "answer_token"
    text: str
    restart: bool = False


@dataclass(frozen=True)
class Answer(Event):
    kind: ClassVar[str] = "answer"
    text: str
    margins_used: list[int] = field(default_factory=list)
    query: str = ""
    ending: str = ""          # end | paragraph | repeat | limit (cut at the answer's token cap) | declined (no note
                              # kept and no sentence near the question: engine/evidence.py)
    citations: list[int] = field(default_factory=list)  # segments the answer cites ("[segment 12]"), 0-based
    passages: list[int] = field(default_factory=list)   # past the window: segments re-read for the answer
    retried: int = 0          # loops taken back on the way (Settings.answer_retries)
    reasoning: str = ""       # what the answer said before "Answer:" (where Settings.reasoning_tokens asks for it)


@dataclass(frozen=True)
class Stats(Event):
    """Work done by one call (a read, an answer, or both). `peak_memory` is in bytes (RSS; CUDA peak on GPU)."""
    kind: ClassVar[str] = "stats"
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    tokens_per_s: float
    peak_memory: int
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    phase: str = "read"
    cache: str = ""
    stopped: bool = False
    # Server backend only (engine/remote.py): requests sent, their prompt tokens, the tokens the server found
    # in its prefix cache, and reuse = cached / prompt (None when nothing was sent: the local engine).
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reuse: float | None = None


@dataclass(frozen=True)
class ServerRequest(Event):
    """One completions request to a server backend, and what the server said of its prefix cache.

    `shared_prefix`: tokens this prompt shares with the previous request made from the same cache (what the
    server should find cached); `computed` = prompt_tokens - cached_tokens. `evicted`: the server computed
    more than the new tokens plus one KV block (`block_tokens`), i.e. the shared prefix had left its cache."""
    kind: ClassVar[str] = "server_request"
    purpose: str                 # generate | yes/no (the LLM classifier)
    prompt_tokens: int
    cached_tokens: int | None    # None: the server reported no cached tokens (vLLM: --enable-prompt-tokens-details)
    shared_prefix: int
    computed: int
    completion_tokens: int
    seconds: float
    evicted: bool = False
    block_tokens: int = 0


@dataclass(frozen=True)
class Notice(Event):
    """Something the user should know that is not an error (a fallback taken, a limit reached)."""
    kind: ClassVar[str] = "notice"
    text: str
