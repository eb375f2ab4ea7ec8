"""The server backend: the WiM loop over any OpenAI-compatible completions server (vLLM, SGLang, ...).

WiM's trick is that every step extends the previous one's prefix: "prefix + segments so far + margin
instruction". A server with automatic prefix caching (vLLM `--enable-prefix-caching`, SGLang's radix cache)
reuses the KV blocks of any prefix it has seen, so the same loop runs there at the same cost, on as many GPUs
and nodes as the server spans. Here the "cache" is only the list of token ids a reading has laid down:

- prefill appends ids to the list and sends nothing;
- truncate cuts the list (the note is gone from the next request's prompt);
- decode sends ONE completions request whose prompt is the list of token ids and streams its tokens;
- the LLM classifier's P(YES) is one `max_tokens=1` request with log-probabilities of the first token.

The chat template is applied here, with the model's own tokenizer loaded from its folder, and the prompt is
sent as token ids: the server sees exactly the tokens of the previous request followed by new ones, with no
re-tokenization that could shift a boundary. Every request records its prompt tokens and the tokens the server
reports as cached (`usage.prompt_tokens_details.cached_tokens`; vLLM needs `--enable-prompt-tokens-details`);
a request that shared a long prefix with the previous one but found it evicted is flagged.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .cache import CacheFull
from .events import Notice, ServerRequest
from .generate import DecodeResult, Ending, Meter, Stopped

REMOTE_KIND = "server prefix cache (token ids sent)"
# vLLM returns at most this many log-probabilities per token unless started with a larger --max-logprobs.
TOP_LOGPROBS = 20


class TokenListCache:
    """What a reading has laid down on a server backend: token ids, not tensors. Same interface as the
    local caches where the WiM loop uses it (length, truncate, state/save for kept windows)."""
    kind = REMOTE_KIND

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.ids: list[int] = []
        self.hidden: tuple[int, int] | None = None   # ids left out of the prompt (new-question margins)
        self.last_prompt: list[int] = []             # the previous request's prompt from this cache

    @property
    def length(self) -> int:
        return len(self.ids)

    def append(self, ids: list[int]) -> None:
        if self.length + len(ids) > self.capacity:
            raise CacheFull(f"context full: {self.length + len(ids)} tokens > capacity {self.capacity}")
        self.ids.extend(ids)

    def truncate(self, length: int) -> None:
        """Cut back to the first `length` ids (drops the tail only; the kept ids are not copied)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        del self.ids[length:]
        if self.hidden and length <= self.hidden[1]:
            self.hidden = None

    def hide(self, start: int, end: int) -> None:
        """Leave ids [start, end) out of the prompt until the cache is cut back to `end` or less: the scratch
        tokens after `end` are then read as if they followed position `start` (a new question's margin at an
        earlier segment boundary: the local engine does this with an attention mask)."""
        self.hidden = (start, end)

    def prompt(self) -> list[int]:
        if self.hidden is None:
            return list(self.ids)
        start, end = self.hidden
        return self.ids[:start] + self.ids[end:]

    def nbytes(self) -> int:
        return 8 * self.length

    def state(self) -> dict[str, torch.Tensor]:
        return {"ids": torch.tensor(self.ids, dtype=torch.int64)}

    def load_state(self, tensors: dict[str, torch.Tensor], device=None) -> None:
        self.ids = [int(t) for t in tensors["ids"].tolist()]
        self.hidden = None

    def save(self, path) -> None:
        from safetensors.torch import save_file
        save_file(self.state(), str(path))


class ServerError(RuntimeError):
    """The server could not be reached or refused a request; the message says which and why."""


@dataclass
class RemoteModel:
    """A model served elsewhere, with the same fields as model.LoadedModel that the WiM loop reads."""
    base_url: str
    served_name: str          # the name the server knows the model by
    tokenizer: object
    name: str
    context_length: int
    block_tokens: int         # the server's KV block size: a request may recompute up to one block it shares
    timeout: float = 600.0
    load_seconds: float = 0.0
    model: object = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: str = "server"
    attention: str = "server"
    serial: bool = False      # the server batches concurrent requests: readings need not wait for each other
    spec: str = ""            # what the model was asked for (`embedded`, a folder, a hub id), as model.LoadedModel
    stop_ids: set = field(default_factory=set)
    _client: object = None

    @property
    def info(self) -> dict:
        return {"name": self.name, "device": f"server {self.base_url}", "dtype": self.dtype,
                "attention": self.attention, "context_length": self.context_length, "parameters": None,
                "layers": None, "load_seconds": round(self.load_seconds, 2)}

    def runner(self, meter: Meter) -> "RemoteRunner":
        return RemoteRunner(self, meter)

    @property
    def client(self):
        if self._client is None:
            import httpx
            # One pooled client for all readings: httpx.Client is thread-safe.
            self._client = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(self.timeout, connect=10.0),
                                        limits=httpx.Limits(max_connections=64))
        return self._client

    def post(self, path: str, body: dict):
        import httpx
        try:
            response = self.client.post(path, json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach the server at {self.base_url}: {e}") from e
        if response.status_code != 200:
            raise ServerError(f"the server at {self.base_url} refused the request ({response.status_code}): "
                              f"{response.text[:500]}")
        return response.json()


def _stop_ids(tokenizer, folder: str | None) -> set[int]:
    """End-of-turn tokens: the generation config's eos ids plus the usual chat end markers."""
    ids: set[int] = set()
    if folder and os.path.isfile(os.path.join(folder, "generation_config.json")):
        with open(os.path.join(folder, "generation_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for token in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(token) if token else None
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return ids


def load_remote(spec: str, base_url: str, block_tokens: int | None = None,
                timeout: float = 600.0) -> RemoteModel:
    """Connect to a completions server serving the model whose tokenizer is at `spec` (`embedded`, a local
    folder or a hub id): the server's model list gives the name to send and the context length."""
    from transformers import AutoTokenizer

    from .model import EMBEDDED, EMBEDDED_NAME, convert_embedded

    start = time.perf_counter()
    if spec == EMBEDDED:
        folder, label = str(convert_embedded()), EMBEDDED_NAME
    else:
        folder, label = spec, spec
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        raise RuntimeError(f"{label} has no chat template: Marginalia needs an instruction-tuned chat model.")
    base_url = base_url.rstrip("/")
    if not base_url.endswith("/v1"):
        base_url += "/v1"
    block = block_tokens or int(os.environ.get("MARGINALIA_SERVER_BLOCK_TOKENS", "128"))
    server = RemoteModel(base_url, "", tokenizer, "", 0, block, timeout)
    import httpx
    try:
        listing = server.client.get("/models").json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ServerError(f"cannot reach the server at {base_url}: {e}") from e
    if not listing:
        raise ServerError(f"the server at {base_url} lists no model")
    names = [m.get("id") for m in listing]
    match = [m for m in listing if m.get("id") in (spec, folder, label)] or (listing if len(listing) == 1 else [])
    if not match:
        raise ServerError(f"the server at {base_url} serves {', '.join(names)}, not {spec}: start it with this "
                          "model, or pass the served model's folder as the model")
    served = match[0]
    server.served_name = served["id"]
    server.context_length = int(served.get("max_model_len") or tokenizer.model_max_length)
    server.name = f"{label} via {base_url}"
    server.spec = spec
    server.stop_ids = _stop_ids(tokenizer, folder if os.path.isdir(folder) else None)
    server.load_seconds = time.perf_counter() - start
    return server


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RemoteRunner:
    """Runner's interface over a server: prefill lays ids down, decode and token_probabilities send requests."""
    early_stops = True  # as Runner's
    takes_back = False  # a streamed request cannot be taken back to where its text began

    def __init__(self, server: RemoteModel, meter: Meter | None = None):
        self.server = server
        self.tokenizer = server.tokenizer
        self.device = server.device
        self.model = None
        self.meter = meter or Meter()
        self.stop_ids = server.stop_ids
        self._events: list = []
        self._events_lock = threading.Lock()

    def new_cache(self, capacity: int) -> TokenListCache:
        return TokenListCache(capacity)

    def drain(self) -> list:
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def prefill(self, ids: list[int], cache: TokenListCache, stop: threading.Event | None = None,
                then: list[int] = ()) -> None:
        """Lay ids (and `then` after them) down; the server sees them with the next request. Returns no logits
        (there are none here)."""
        if stop is not None and stop.is_set():
            raise Stopped()
        cache.append([*ids, *then])
        self.meter.prefill_tokens += len(ids) + len(then)
        return None

    def forward(self, *args, **kwargs):
        raise RuntimeError("a server backend has no single forward pass: use prefill and decode")

    def decode(self, cache: TokenListCache, logits, max_tokens: int, stop: threading.Event | None = None,
               temperature: float = 0.0, generator: torch.Generator | None = None,
               step=None, result: DecodeResult | None = None, paragraph: bool = False,
               retries: int = 0, barred_first: set[int] | frozenset = frozenset(), answer_after: str | None = None
               ) -> Iterator[tuple[int, str]]:
        """One streamed completions request for the whole note; yields (token_id, new_text) as they arrive.
        It ends where the local decode would (generate.Ending: a loop, the end of a paragraph): leaving the
        stream early closes it, and the server aborts the request. A loop is not taken back (`retries` and
        `barred_first` are the local runner's: takes_back): the server's stream has no way back to where the
        loop began, and its logit bias would bar a token everywhere, not only first."""
        if step is not None:
            raise RuntimeError("masked scratch decoding is local-only: a server backend hides ids instead")
        if barred_first:
            raise RuntimeError("barring a first token is local-only (RemoteRunner.takes_back is False)")
        if stop is not None and stop.is_set():
            raise Stopped()
        prompt = cache.prompt()
        body = {"model": self.server.served_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": max(temperature, 0.0), "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, "skip_special_tokens": True, "stop_token_ids": sorted(self.stop_ids),
                # No stop ids (bench.common.fixed_length): decode to full length, as the local runner does.
                "ignore_eos": not self.stop_ids}
        if temperature > 0:
            body["seed"] = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        result = result if result is not None else DecodeResult()
        ending = Ending(self.tokenizer, result, paragraph and self.early_stops, self.early_stops, answer_after)
        usage: dict = {}
        started = time.perf_counter()
        first_token_at = None
        sent, over = 0, False
        import httpx
        try:
            with self.server.client.stream("POST", "/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise ServerError(f"the server at {self.server.base_url} refused the request "
                                      f"({response.status_code}): {response.text[:500]}")
                for line in response.iter_lines():
                    if stop is not None and stop.is_set():
                        raise Stopped()  # leaving the block closes the stream: the server aborts the request
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason") == "stop":
                            result.reason = "end"
                        new = choice.get("token_ids")
                        if new is None and choice.get("text"):  # a server without return_token_ids
                            new = self.tokenizer.encode(choice["text"], add_special_tokens=False)
                        for token in new or []:
                            if over or token in self.stop_ids or sent >= max_tokens:
                                continue
                            first_token_at = first_token_at or time.perf_counter()
                            piece = ending.add(token)
                            if piece is None:
                                # The text is over (a loop, a paragraph): the rest of the stream is read but
                                # not used, for the usage (cached tokens) that comes with its last chunk.
                                over = True
                                continue
                            sent += 1
                            self.meter.decode_tokens += 1
                            yield token, piece
        except httpx.HTTPError as e:
            raise ServerError(f"the server at {self.server.base_url} failed mid-request: {e}") from e
        finally:
            ending.close()
            if result.reason == "limit" and sent < max_tokens and not over:
                result.reason = "end"
            ended = time.perf_counter()
            first = first_token_at or ended
            self.meter.prefill_seconds += first - started
            self.meter.decode_seconds += ended - first
            ids = result.ids
            if ids[:-1]:
                cache.append(ids[:-1])  # as the local decode leaves them: every token but the last fed back
            self._record("generate", cache, prompt, usage, len(ids), ended - started)

    def scratch(self, cache: TokenListCache, doc_end: int, stop: threading.Event | None = None) -> "ServerScratch":
        return ServerScratch(self, cache, doc_end, stop)

    def token_probabilities(self, ids: list[int], cache: TokenListCache, candidates: set[int],
                            stop: threading.Event | None = None, purpose: str = "yes/no") -> dict[int, float]:
        """P(next token) for each candidate from one `max_tokens=1` request. vLLM returns the candidates'
        log-probabilities exactly (`logprob_token_ids`); elsewhere the top-20 stand in (a candidate outside
        them counts as 0)."""
        self.prefill(ids, cache, stop)
        prompt = cache.prompt()
        body = {"model": self.server.served_name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "logprobs": TOP_LOGPROBS, "logprob_token_ids": sorted(candidates),
                "return_tokens_as_token_ids": True}
        started = time.perf_counter()
        reply = self.server.post("/completions", body)
        seconds = time.perf_counter() - started
        self.meter.prefill_seconds += seconds
        self._record(purpose, cache, prompt, reply.get("usage") or {}, 1, seconds)
        logprobs = ((reply.get("choices") or [{}])[0].get("logprobs") or {}).get("top_logprobs") or [{}]
        found: dict[int, float] = {}
        for token, logprob in (logprobs[0] or {}).items():
            tid = int(token.split(":", 1)[1]) if token.startswith("token_id:") else \
                self.tokenizer.convert_tokens_to_ids(token)
            if tid in candidates and logprob is not None and logprob > -math.inf:
                found[tid] = math.exp(logprob)
        return {t: found.get(t, 0.0) for t in candidates}

    def _record(self, purpose: str, cache: TokenListCache, prompt: list[int], usage: dict, completion: int,
                seconds: float) -> None:
        shared = shared_prefix(cache.last_prompt, prompt)
        cache.last_prompt = prompt
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        sent = int(usage.get("prompt_tokens") or len(prompt))
        computed = sent - (cached or 0)
        block = self.server.block_tokens
        evicted = cached is not None and shared >= block and computed > (sent - shared) + block
        self.meter.requests += 1
        self.meter.prompt_tokens += sent
        self.meter.cached_tokens += cached or 0
        events: list = [ServerRequest(purpose, sent, cached, shared, computed, completion, round(seconds, 4),
                                      evicted, block)]
        if evicted:
            events.append(Notice(
                f"The server had evicted this reading's prefix: a {purpose} request recomputed {computed:,} of "
                f"{sent:,} prompt tokens where {sent - shared:,} were new (its prefix cache is too small for "
                "the readings it serves, or the server restarted)."))
        with self._events_lock:
            self._events.extend(events)


class ServerScratch:
    """engine/margins.py's Scratch over a server: fed ids are laid down in the token list, and the log-probability
    of each token the margin writer may choose next comes from one `max_tokens=1` request (a constrained copy
    costs a request where its trie branches, none for the forced run). Other tokens get -inf. It scores no rows:
    a copy is chosen token by token here, and scored margins need the local engine."""
    visible = None

    def __init__(self, runner: RemoteRunner, cache: TokenListCache, doc_end: int, stop):
        self.runner, self.cache, self.doc_end, self.stop = runner, cache, doc_end, stop

    def feed(self, ids: list[int], candidates: set[int] | None = None) -> torch.Tensor:
        if not candidates:
            raise RuntimeError("a server scratch needs the tokens the writer may choose next")
        probs = self.runner.token_probabilities(ids, self.cache, candidates, self.stop, purpose="margin step")
        out = torch.full((len(self.runner.tokenizer),), -math.inf)
        for token, p in probs.items():
            if p > 0:
                out[token] = math.log(p)
        return out

