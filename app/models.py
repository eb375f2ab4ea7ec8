"""The loaded model: its warm-up, the speeds it measures for reading-time estimates, and the model picker."""
from __future__ import annotations

import json
import os

from engine.events import Stats
from engine.wim import Settings

from . import worker
from .errors import UserError

WARMUP_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens and wrote the weather in a small leather book. Ships passed far out at sea; none of "
    "them knew his name. In winter the storms came from the north and the tower shook, but the light never "
    "failed. When he grew old, his daughter took over the work, and she kept the same book, adding a line "
    "each night in her own hand.")


def benchmarked_rates(path: str | None = None) -> dict[str, dict]:
    """Model spec -> {"prefill", "decode"} tokens/s from bench/results/models.json (`python -m bench.models`),
    for the dtype the engine picks on this CPU; the picker shows them until a model's own warm-up measures it here."""
    from engine.model import cpu_has_bf16_matrix_units

    path = path or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results",
                                "models.json")
    try:
        with open(path, encoding="utf-8") as f:
            runs = json.load(f)["runs"]
    except (OSError, ValueError, KeyError):
        return {}
    source = "cache-bf16" if cpu_has_bf16_matrix_units() else "cache-fp32"
    return {r["model"]: {"prefill": r["prefill_tps"], "decode": r["decode_tps"]} for r in runs
            if r.get("source") == source}


class Models:
    """Service's part that loads, switches and times the model (state: engine, rates, measured, _load)."""

    def warm_up(self) -> dict:
        """One tiny reading: the first forward passes are slow, and it measures this machine's speed for
        the reading-time estimates."""
        reading = self.engine.open(WARMUP_TEXT, Settings(segment_tokens=160, margin_tokens=6, answer_tokens=4,
                                                         classifier=self.defaults.classifier,
                                                         context_limit=1024))
        question = "Who keeps the light?"
        read = [ev for ev in reading.read(question) if isinstance(ev, Stats)][-1]
        # Copied notes may take no decode step at all: the answer's few tokens measure writing.
        answer = [ev for ev in reading.answer(question) if isinstance(ev, Stats)][-1]
        decode_tokens = read.decode_tokens + answer.decode_tokens
        decode_seconds = read.decode_seconds + answer.decode_seconds
        if read.prefill_seconds > 0 and decode_seconds > 0:
            self.rates = {"prefill": read.prefill_tokens / read.prefill_seconds,
                          "decode": decode_tokens / decode_seconds}
            self.measured[self.engine.lm.spec] = dict(self.rates)
        return self.rates

    def models(self, extra: str | None = None) -> list[dict]:
        """The models this machine can load (the loaded one marked), with what the picker shows of each."""
        from engine.model import available_models

        current = self.engine.lm.spec
        if not self.engine.lm.serial:  # a model server: it serves one model, and switching is done there
            lm = self.engine.lm
            return [{"spec": current, "name": lm.name, "parameters": None, "context_length": lm.context_length,
                     "file_bytes": None, "rates": self.measured.get(current), "loaded": True}]
        reference = benchmarked_rates()
        out = []
        for choice in available_models(extra or current):
            out.append({"spec": choice.spec, "name": choice.name, "parameters": choice.parameters,
                        "context_length": choice.context_length, "file_bytes": choice.file_bytes,
                        "rates": self.measured.get(choice.spec) or reference.get(choice.spec),
                        "loaded": choice.spec == current})
        return out

    def switch_model(self, spec: str, warm_up: bool = True) -> bool:
        """Load another model in place of the current one (False if it is already loaded).

        Runs in the engine slot (web.py gives it the engine's concurrency id), so no reading or answer is in
        flight: they finish first, and jobs queued later run on the new model. One model is loaded at a
        time; if the new one cannot be loaded the old one stays. UserError with the reason."""
        if spec == self.engine.lm.spec:
            return False
        if not self.engine.lm.serial:  # hence a switch only ever runs alone in the engine's one slot
            raise UserError("This app reads through a model server (--backend openai): switch the model there.")
        if self.jobs.any_running():
            raise UserError("A reading or an answer is running: stop it (or wait) before switching models.")
        try:
            engine = self._load(spec)
        except (ValueError, RuntimeError, OSError) as e:
            raise UserError(f"Could not load {spec}: {e}") from e
        old, self.engine = self.engine, engine
        self.model = engine.lm.name
        worker.set_engine(engine)  # drops the readings cached for the old model
        with self._lock:
            self._segments.clear()  # segments are measured in the old model's tokens
        del old
        import gc
        gc.collect()
        self.rates = dict(self.measured.get(spec) or {"prefill": 400.0, "decode": 8.0})
        if warm_up:
            self.warm_up()
        return True

    def _learn_rates(self, stats: Stats) -> None:
        if stats.stopped or stats.prefill_seconds <= 0.2 or stats.decode_seconds <= 0.2:
            return
        prefill = stats.prefill_tokens / stats.prefill_seconds
        decode = stats.decode_tokens / stats.decode_seconds
        self.rates = {"prefill": 0.5 * self.rates["prefill"] + 0.5 * prefill,
                      "decode": 0.5 * self.rates["decode"] + 0.5 * decode}

    def segment_work(self, segments: list, settings: Settings) -> list[float]:
        """How much each segment costs to read, relative to the others: its tokens, each weighed by the
        context it attends to. A token costs its weights (2 FLOPs each) plus 4 * layers * width FLOPs per
        token of context before it: at `reach` tokens of context, attention costs as much as the weights.
        Without this the ETA after segment 1 (read over an almost empty cache) is far too short for a long
        document, whose later segments attend to thousands of tokens. (A model server: tokens alone.)"""
        lm = self.engine.lm
        config = getattr(getattr(lm, "model", None), "config", None)
        if config is None or not lm.serial:
            return [float(s.tokens) for s in segments]
        if getattr(self, "_reach", (None,))[0] != lm.spec:
            weights = sum(p.numel() for p in lm.model.parameters())
            self._reach = (lm.spec, weights / (2 * config.num_hidden_layers * config.hidden_size))
        reach = self._reach[1]
        window = min(settings.context_limit or lm.context_length, lm.context_length)
        # A long document is read in windows, each starting afresh (beside the margins it carries).
        return [s.tokens * (reach + (s.token_start + s.tokens / 2) % window) for s in segments]

    def estimate_seconds(self, tokens: int, segments: int, settings: Settings) -> float:
        prefill = tokens + segments * 60
        if settings.classifier == "llm":
            prefill += segments * 120
        decode = segments * settings.margin_tokens * 0.8
        return prefill / self.rates["prefill"] + decode / max(self.rates["decode"], 0.1)
