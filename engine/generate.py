"""The two primitive operations on a cache: prefill tokens, decode tokens. Everything else is built on these.

Every forward pass checks the stop flag first, so a Stop takes effect within one forward pass.
Prefill asks the model for the logits of the last position only (`logits_to_keep=1`): the LM head over a
49k vocabulary for every prefilled token would cost more than a transformer layer and be thrown away.
"""
from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch


class Stopped(Exception):
    """The caller's stop flag was set; the cache is left at a consistent length."""


@dataclass
class Meter:
    """Token and time accounting for one phase of work."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Runner:
    """Drives one model over caches. Holds no document state."""

    def __init__(self, model, tokenizer, device: torch.device, meter: Meter | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.meter = meter or Meter()
        self.stop_ids = self._stop_ids()

    def _stop_ids(self) -> set[int]:
        ids = set()
        eos = self.model.generation_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        for token in (self.tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
            tid = self.tokenizer.convert_tokens_to_ids(token) if token else None
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return ids

    @torch.inference_mode()
    def forward(self, ids: list[int], cache, stop: threading.Event | None = None,
                attention_mask: torch.Tensor | None = None, position_start: int | None = None) -> torch.Tensor:
        """Append `ids` to `cache` at the next positions; return the logits of the last position."""
        if stop is not None and stop.is_set():
            raise Stopped()
        start = cache.length if position_start is None else position_start
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        out = self.model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True,
                         attention_mask=attention_mask, logits_to_keep=1)
        return out.logits[0, -1].float()

    def prefill(self, ids: list[int], cache, stop: threading.Event | None = None) -> torch.Tensor:
        t = time.perf_counter()
        logits = self.forward(ids, cache, stop)
        self.meter.prefill_seconds += time.perf_counter() - t
        self.meter.prefill_tokens += len(ids)
        return logits

    def decode(self, cache, logits: torch.Tensor, max_tokens: int, stop: threading.Event | None = None,
               temperature: float = 0.0, generator: torch.Generator | None = None,
               step=None) -> Iterator[tuple[int, str]]:
        """Generate up to `max_tokens` tokens after `logits`; yield (token_id, new_text) as each is chosen.

        The chosen tokens are written into `cache` (the last one is not: it was never fed back), so the caller
        cuts the cache back to where it started once done. `step` overrides how a token is fed (masked scratch)."""
        ids: list[int] = []
        text = ""
        for i in range(max_tokens):
            token = pick_token(logits, temperature, generator)
            if token in self.stop_ids:
                return
            ids.append(token)
            full = self.tokenizer.decode(ids, skip_special_tokens=True)
            if not full.endswith("\ufffd"):  # hold back a half-decoded multi-byte character
                yield token, full[len(text):]
                text = full
            if i + 1 == max_tokens:
                return
            t = time.perf_counter()
            logits = step(token) if step else self.forward([token], cache, stop)
            self.meter.decode_seconds += time.perf_counter() - t
            self.meter.decode_tokens += 1


def pick_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
