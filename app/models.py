"""The loaded model: its warm-up, the speeds it measures for reading-time estimates, and the model picker."""
from __future__ import annotations

import json
import os

from engine.events import Stats
from engine import Settings

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
    """Service's part that loads, switches and times the model (state: engine, rates, measured, load_engine)."""

    def warm_up(self) -> dict:
        """Measure this machine's speed for the reading-time estimates: a plain read of a few hundred tokens
        (the text's prefill rate, in passes as long as a document's) and a one-segment reading with its margin
        and a short answer (what a margin costs beyond its text, and the decode rate). Twice: the first round
        pays what only the first passes pay (weights paged in, kernels built). Measured on the first round of
        the one-segment reading alone, the 1.5B on a busy 2-core Xeon gave 3 prefill tokens/s, and a 15-page
        PDF that then read in 11 minutes was announced at over two hours."""
        for _ in range(2):
            text = self._tiny_reading("llm", WARMUP_TEXT * 4)[0]
            read, answer, tokens, segments = self._tiny_reading("wim", WARMUP_TEXT)
        if text.prefill_seconds <= 0:
            return self.rates
        prefill = text.prefill_tokens / text.prefill_seconds
        # Copied notes may take no decode step at all: the answer's few tokens measure writing.
        decode_tokens = read.decode_tokens + answer.decode_tokens
        decode_seconds = read.decode_seconds + answer.decode_seconds
        self.rates = {"prefill": prefill,
                      "decode": decode_tokens / decode_seconds if decode_seconds > 0 else self.rates["decode"],
                      "margin": max(read.seconds - tokens / prefill, 0.0) / segments}
        self.measured[self.engine.lm.spec] = dict(self.rates)
        return self.rates

    def _tiny_reading(self, mode: str, text: str) -> tuple:
        """Read `text` in `mode` and answer one question; the read's and the answer's Stats, the text's tokens
        and its segments."""
        reading = self.engine.open(text, Settings(mode=mode, segment_tokens=160 if mode == "wim" else 1024,
                                                  margin_tokens=6, answer_tokens=4, context_limit=2048))
        question = "Who keeps the light?"
        read = [ev for ev in reading.read(question) if isinstance(ev, Stats)][-1]
        answer = [ev for ev in reading.answer(question) if isinstance(ev, Stats)][-1]
        return read, answer, len(reading.doc.token_ids), len(reading.segments)

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
            engine = self.load_engine(spec)
        except (ValueError, RuntimeError, OSError) as e:
            raise UserError(f"Could not load {spec}: {e}") from e
        old, self.engine = self.engine, engine
        self.model = engine.lm.name
        worker.set_engine(engine)  # drops the readings cached for the old model
        self.layouts.use(engine)  # segments are measured in the old model's tokens
        del old
        import gc
        gc.collect()
        self.rates = dict(self.measured.get(spec) or {"prefill": 400.0, "decode": 8.0})
        if warm_up:
            self.warm_up()
        return True

    def learn_rates(self, stats: Stats, estimated_s: float, took_s: float) -> None:
        """After a finished reading: the decode rate it measured, and how far its time was from the estimate
        (a scale on every later estimate, moved halfway, in ratio, toward what this reading took)."""
        if stats.stopped or estimated_s <= 0 or took_s <= 1:
            return
        if stats.decode_seconds > 0.2:
            self.rates["decode"] = 0.5 * self.rates["decode"] + 0.5 * stats.decode_tokens / stats.decode_seconds
        scale = self.rates.get("scale", 1.0)
        self.rates["scale"] = min(max(scale * (took_s / estimated_s) ** 0.5, 0.1), 10.0)

    def _reach(self) -> float | None:
        """Tokens of context at which attention costs a token as much as the weights do: a token costs its
        weights (2 FLOPs each) plus 4 * layers * width FLOPs per token of context before it. None for a model
        server (its costs are not ours to weigh)."""
        lm = self.engine.lm
        config = getattr(getattr(lm, "model", None), "config", None)
        if config is None or not lm.serial:
            return None
        if getattr(self, "_reach_of", (None,))[0] != lm.spec:
            from engine.packed import weights as packed_weights
            weights = packed_weights(lm.model)[0]
            self._reach_of = (lm.spec, weights / (2 * config.num_hidden_layers * config.hidden_size))
        return self._reach_of[1]

    def _context_factor(self, tokens: int, window: int) -> float:
        """How much more a token of a `tokens`-long reading costs than one over an empty cache: each window
        starts afresh, so a token attends on average to half a window (or half the text)."""
        reach = self._reach()
        return 1.0 if reach is None else 1 + min(tokens, window) / 2 / reach

    def _window(self, settings: Settings) -> int:
        lm = self.engine.lm
        return min(settings.context_limit or lm.context_length, lm.context_length)

    def segment_work(self, segments: list, settings: Settings) -> list[float]:
        """How much each segment costs to read, relative to the others: its tokens, each weighed by the
        context it attends to (see _reach). Without this the ETA after segment 1 (read over an almost empty
        cache) is far too short for a long document, whose later segments attend to thousands of tokens.
        (A model server: tokens alone.)"""
        reach = self._reach()
        if reach is None:
            return [float(s.tokens) for s in segments]
        window = self._window(settings)
        # A long document is read in windows, each starting afresh (beside the margins it carries).
        return [s.tokens * (reach + (s.token_start + s.tokens / 2) % window) for s in segments]

    def estimate_seconds(self, tokens: int, segments: int, settings: Settings) -> float:
        """What reading `tokens` in `segments` segments should take here, before it starts: the text's prefill
        at the measured rate, each token weighed by the context it attends to as segment_work does (the
        warm-up's cache was nearly empty), plus what each margin costs, scaled by how the last readings here
        kept to their estimates."""
        rates = self.rates
        seconds = tokens * self._context_factor(tokens, self._window(settings)) / rates["prefill"]
        # A copied note is mostly prefill (the instruction, its sentence fed back) with a step or two to choose
        # it: 16k-token readings of the 1.5B took 0-20 decode steps for 16 notes. Without a measured cost:
        # ~60 tokens and 2 steps. A free-form note decodes most of its budget.
        margin = rates.get("margin", 60 / rates["prefill"] + 2 / max(rates["decode"], 0.1))
        if settings.margins == "abstractive":
            margin += settings.margin_tokens * 0.8 / max(rates["decode"], 0.1)
        if settings.classifier == "llm":  # its YES/NO question after each note
            margin += 120 / rates["prefill"]
        return (seconds + segments * margin) * rates.get("scale", 1.0)
