"""Speed and memory of WiM against plain reading, the naive two-pass pattern and the reference implementation's
pattern, on one model, dtype and document per size. `python -m bench.speed [--quick] [--out DIR]`.

Each mode runs in its own worker process (one per mode and document size), so the peak RSS of one mode never
hides inside another's. The workers are loaded together, then driven one run at a time, the modes interleaved
and their order rotated each repetition: the CPU is shared, and a slow minute then lands on every mode alike
rather than on one. The microbenchmarks (matmul throughput, prefill FLOP/s, decode and truncation against
context) run in this process before the workers start.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .common import (RESULTS, book, fmt_bytes, load_engine, machine, md_table, median, n_tokens, peak_rss_bytes,
                     prose, reset_peak_rss, rss_bytes, segment_tokens_for, write_results)
from .flops import Shape, linear_gflops

# wim-forward: WiM again with transformers' forward for every pass (MARGINALIA_PREFILL_PASS=forward), untimed in
# the rows: the reference pattern computes its passes with that forward, so its margins and answer must equal
# this reading's (row 3's check); the engine's written-out pass rounds a few sums otherwise (bf16).
MODES = ("wim", "plain", "naive", "reference", "wim-forward")
QUERY = "Where is Walton's expedition going, and what does he hope to find there?"
FOLLOWUP = "Who is Margaret Saville?"
BOOK = "pg84.txt"  # Frankenstein: Walton's letters, then Victor's story
TARGETS = {  # (comparison, bound): the project's targets
    "wim_vs_plain": ("<=", 1.3), "naive_vs_wim": (">=", 1.5), "reference_vs_wim": (">=", 1.5),
    "prefill_efficiency": (">=", 0.85), "followup": ("<=", 0.10), "memory": ("<=", 1.25)}


@dataclass(frozen=True)
class Config:
    doc_tokens: tuple[int, ...]                 # document sizes
    reps: dict                                  # doc size -> mode -> repetitions
    segments: int = 8
    margin_tokens: int = 64
    answer_tokens: int = 32
    prefill: tuple = ((512, 3, True), (4096, 3, True), (8192, 3, False))  # (tokens, reps, also all-logits?)
    contexts: tuple[int, ...] = (512, 1024, 2048, 4096, 8000)              # decode / truncate at these lengths
    steps: int = 5                              # decode steps per context (median)
    margins: str = "extractive"                 # the engine's default; abstractive: free-form notes
    # The reading window: the embedded model's whole context. A model with a longer one reads the same documents
    # in the same window (and allocates the same KV cache), so that every model is measured on one shape.
    window: int = 8192


FULL = Config(
    doc_tokens=(4000, 7200),  # 7.2k: with 8 margins of 64 tokens and the answer, the 8,192-token window is full
    # Every figure is a median of 3 (the 8k naive and reference runs cost ~3 minutes each: ~50 minutes in all).
    reps={4000: dict(wim=3, plain=3, naive=3, reference=3, **{"wim-forward": 1}),
          7200: dict(wim=3, plain=3, naive=3, reference=3, **{"wim-forward": 1})})
QUICK = Config(doc_tokens=(400,), reps={400: dict(wim=1, plain=1, naive=1, reference=1, **{"wim-forward": 1})},
               segments=4,
               margin_tokens=8, answer_tokens=4, prefill=((128, 1, True), (256, 1, True), (512, 1, True)),
               contexts=(128, 256, 512), steps=2)


def document(tokenizer, tokens: int) -> str:
    text = book(BOOK)
    return prose(tokenizer, tokens, BOOK, start_char=text.index("_To Mrs. Saville, England._"))


def settings_for(tokenizer, text: str, cfg: Config) -> dict:
    """The engine's default settings sized for the benchmark, with copied notes judged by their own relevance
    (`margin`: the reference pattern judges notes with the model itself, so both sides judge alike; the default
    `combined` adds MiniLM's verdicts, which this benchmark does not time); or, with `margins="abstractive"`, the paper's
    free-form notes and a YES/NO classifier, every note decoded to its full length (what an earlier version of
    this benchmark measured)."""
    sized = dict(segment_tokens=segment_tokens_for(text, tokenizer, cfg.segments), margin_tokens=cfg.margin_tokens,
                 answer_tokens=cfg.answer_tokens, temperature=0.0, context_limit=cfg.window, classifier="margin")
    if cfg.margins == "abstractive":
        return sized | dict(margins="abstractive", classifier="llm")
    return sized


# ---- worker process: one mode, one document size ----------------------------------------------------------------
def worker(device: str | None, dtype: str | None, model: str) -> None:
    """Load the model, then answer JSON commands on stdin with JSON results on stdout (one line each)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (progress bars, warnings) goes to stderr, never into the protocol
    import torch
    from engine import Settings
    from engine.model import dtype_name
    from engine.packed import weights as packed_weights
    from .baselines import run_mode
    runtime_rss = rss_bytes()  # Python + torch + transformers, before the model
    engine = load_engine(device, dtype, model)
    cuda = engine.lm.device.type == "cuda"
    # The weights the model holds: its parameters and, beside them, the 4-bit decode packs (engine/packed.py).
    packs = (engine.lm.packs or {}).get("bytes", 0)
    weights = packed_weights(engine.lm.model)[1] + packs
    code = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(__file__).parents[1].glob("engine/*.py"))
                                   + [Path(__file__).with_name("baselines.py")])).hexdigest()[:12]
    out.write(json.dumps({"ready": True, "code": code, "runtime_rss": runtime_rss, "loaded_rss": rss_bytes(),
                          "weights_bytes": weights, "packs_bytes": packs,
                          "model": engine.lm.name, "dtype": dtype_name(engine.lm.dtype),
                          "device": str(engine.lm.device)}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        settings = Settings(**cmd["settings"])
        if cmd.get("warmup"):
            # First calls pay one-time costs (kernel selection, allocator growth): keep them out of the timings.
            run_mode(engine, cmd["mode"], cmd["text"], cmd["query"], settings)
            out.write(json.dumps({"warm": True}) + "\n")
            continue
        before = rss_bytes()
        exact_peak = reset_peak_rss()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        load = os.getloadavg()[0]
        run = run_mode(engine, cmd["mode"], cmd["text"], cmd["query"], settings, cmd.get("followup"))
        result = run.to_dict() | {"rss_before": before, "peak_rss": peak_rss_bytes(), "peak_is_run_only": exact_peak,
                                  "load_before": load, "load_after": os.getloadavg()[0]}
        if cuda:
            result["cuda_peak"] = int(torch.cuda.max_memory_allocated())
        out.write(json.dumps(result) + "\n")


class Worker:
    def __init__(self, mode: str, args, log_dir: Path):
        self.mode = mode
        self.log = log_dir / f"worker-{mode}-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "bench.speed", "--worker"]
        cmd += [f"--device={args.device}"] if args.device else []
        cmd += [f"--dtype={args.dtype}"] if args.dtype else []
        cmd += [f"--model={args.model}"]
        env = os.environ | ({"MARGINALIA_PREFILL_PASS": "forward"} if mode == "wim-forward" else {})
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     stderr=self.log.open("w"), text=True, bufsize=1, cwd=Path(__file__).parents[1])
        self.info: dict = {}

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the {self.mode} worker died:\n{tail}")
        return json.loads(line)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")

    def ask(self, **cmd) -> dict:
        self.send(**cmd)
        return self.receive()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ---- microbenchmarks (this process) ------------------------------------------------------------------------------
def _sync(device) -> None:
    import torch
    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def microbenchmarks(engine, cfg: Config, log) -> dict:
    import torch
    with torch.inference_mode():  # the cache's tensors are inference tensors: touch them only in this mode
        return _microbenchmarks(engine, cfg, log)


def _microbenchmarks(engine, cfg: Config, log) -> dict:
    import torch
    from transformers import DynamicCache
    from engine.cache import make_cache
    from engine.generate import PREFILL_CHUNK, Runner
    from engine.model import dtype_name
    lm = engine.lm
    model, device = lm.model, lm.device
    shape = Shape.of(model)
    longest = max(n for n, _, _ in cfg.prefill)
    ids = lm.tokenizer(document(lm.tokenizer, longest + 200), add_special_tokens=False)["input_ids"]
    ids = (ids * (longest // len(ids) + 1))[:longest]
    runner = Runner(model, lm.tokenizer, device)
    warm = make_cache(model, 64)
    list(runner.decode(warm, runner.prefill(ids[:32], warm), 4))  # first forward passes pay one-time costs
    del warm
    out = {"shape": asdict(shape), "weight_flops_per_token": shape.weight_flops(),
           "gemm": {"rows": PREFILL_CHUNK, "dtype": dtype_name(lm.dtype)}}

    @torch.inference_mode()
    def all_logits(n: int) -> float:
        cache = make_cache(model, n)
        t = time.perf_counter()
        model(input_ids=torch.tensor([ids[:n]], device=device),
              position_ids=torch.arange(n, device=device).unsqueeze(0), cache=cache, use_cache=True,
              logits_to_keep=0)
        _sync(device)
        return time.perf_counter() - t

    rows, gemms, cache = [], [], None
    for n, reps, compare in cfg.prefill:
        log(f"prefill {n} tokens x{reps}")
        last, every, local = [], [], []
        for _ in range(reps):
            # Measured right before each prefill: the model's own matmuls (bench/prefill.py), in the engine's dtype
            # and at this process's thread count, at that moment of a shared CPU.
            local.append(linear_gflops(model, lm.dtype, PREFILL_CHUNK)["gflops"])
            del cache
            cache = make_cache(model, max(n, max(cfg.contexts) + cfg.steps + 1))
            t = time.perf_counter()
            runner.prefill(ids[:n], cache)
            _sync(device)
            last.append(time.perf_counter() - t)
            if compare:
                every.append(all_logits(n))
        gemms += local
        flops = shape.prefill_flops(n)
        gflops = flops / median(last) / 1e9
        rows.append({"tokens": n, "n": reps, "seconds": median(last), "seconds_min": min(last), "gflop": flops / 1e9,
                     "attention_share": shape.attention_flops(0, n) / flops, "gflops": gflops,
                     "matmul_gflops": median(local), "ratio": gflops / median(local),
                     "all_logits_seconds": median(every) if every else None,
                     "all_logits_ratio": median(every) / median(last) if every else None,
                     "all_logits_extra_gflop": shape.head_flops(n - 1) / 1e9})
    out["gemm"]["linear_gflops"] = median(gemms)
    out["prefill"] = rows

    # `cache` now holds the longest prefill: decode and truncate at each context length inside it.
    log("decode and truncation against context length")
    token = ids[10]

    @torch.inference_mode()
    def dynamic_step(dyn) -> float:
        past = dyn.get_seq_length()
        t = time.perf_counter()
        model(input_ids=torch.tensor([[token]], device=device),
              attention_mask=torch.ones(1, past + 1, dtype=torch.long, device=device),
              position_ids=torch.tensor([[past]], device=device), cache=dyn, use_cache=True)
        _sync(device)
        return time.perf_counter() - t

    def restore(length: int) -> None:
        # Bench-only: the buffers still hold the prefilled keys/values past a truncation, so moving the length
        # back restores them exactly (nothing has overwritten those slots).
        for layer in cache.layers:
            layer.length = length

    def clone_dynamic(length: int) -> DynamicCache:
        return DynamicCache(ddp_cache_data=[(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone())
                                            for layer in cache.layers])

    cut = 64  # a margin's worth of tokens
    one = [torch.zeros_like(layer.keys[:, :, :1]) for layer in cache.layers]
    points = []
    for ctx in cfg.contexts:
        ours, theirs, trunc, crop, trunc_write, crop_write = [], [], [], [], [], []
        for _ in range(cfg.steps):
            restore(ctx)
            t = time.perf_counter()
            runner.forward([token], cache)
            _sync(device)
            ours.append(time.perf_counter() - t)
            dyn = clone_dynamic(ctx)
            theirs.append(dynamic_step(dyn))
            dyn.crop(-1)
            # Cut back by a margin, then write one token (what the next forward pass does first).
            restore(ctx)
            t = time.perf_counter()
            cache.truncate(ctx - cut)
            trunc.append(time.perf_counter() - t)
            for i, layer in enumerate(cache.layers):
                layer.update(one[i], one[i])
            trunc_write.append(time.perf_counter() - t)
            t = time.perf_counter()
            dyn.crop(-cut)
            crop.append(time.perf_counter() - t)
            for i, layer in enumerate(dyn.layers):
                layer.update(one[i], one[i])  # torch.cat: copies the whole remaining cache
            crop_write.append(time.perf_counter() - t)
            del dyn
        # Medians, and minima: on a shared CPU a multi-threaded op can wait a whole time slice for a core, so
        # the minimum is the better estimate of what an operation itself costs.
        point = {"context": ctx, "n": cfg.steps}
        for name, scale, values in (("decode_ms", 1e3, ours), ("decode_dynamic_ms", 1e3, theirs),
                                    ("truncate_us", 1e6, trunc), ("truncate_write_us", 1e6, trunc_write),
                                    ("crop_us", 1e6, crop), ("crop_write_us", 1e6, crop_write)):
            point[name], point[name + "_min"] = scale * median(values), scale * min(values)
        points.append(point)
    first, last = points[0], points[-1]
    out["context"] = {"points": points, "ratio": {
        "decode": last["decode_ms"] / first["decode_ms"],
        "decode_dynamic": last["decode_dynamic_ms"] / first["decode_dynamic_ms"],
        "truncate_write": last["truncate_write_us"] / first["truncate_write_us"],
        "crop_write": last["crop_write_us"] / first["crop_write_us"]}}
    del cache
    return out


# ---- the mode runs -----------------------------------------------------------------------------------------------
class Progress:
    """Each finished piece of a run (the microbenchmarks, one mode run) appended to a JSONL file as it finishes,
    so a run that is stopped resumes where it was: a full run takes long on a shared CPU. Pieces count only for
    the same configuration."""

    def __init__(self, path: Path, config: dict, fresh: bool):
        self.path = path
        self.key = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]
        self.done: dict[str, dict] = {}
        if path.exists() and not fresh:
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # cut off by the stop
                if record.get("key") == self.key:
                    self.done[record["id"]] = record["data"]
        elif path.exists():
            path.unlink()

    def get(self, piece: str) -> dict | None:
        return self.done.get(piece)

    def put(self, piece: str, data: dict) -> None:
        self.done[piece] = data
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"key": self.key, "id": piece, "data": data}, default=str) + "\n")


def _reading(mode: str) -> str:
    """The reading pattern a mode's worker runs (wim-forward is WiM; its worker's environment differs)."""
    return "wim" if mode == "wim-forward" else mode


def mode_runs(cfg: Config, args, tokenizer, progress: Progress, log) -> tuple[dict, dict, dict]:
    runs: dict = {}
    workers_info: dict = {}
    docs: dict = {}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-speed-"))
    for size in cfg.doc_tokens:
        text = document(tokenizer, size)
        settings = settings_for(tokenizer, text, cfg)
        docs[size] = {"tokens": n_tokens(tokenizer, text), "chars": len(text), "settings": settings,
                      "query": QUERY, "followup": FOLLOWUP}
        reps = cfg.reps[size] if args.reps is None else dict.fromkeys(MODES, args.reps) | {"wim-forward": 1}
        plan = [(rep, m) for rep in range(max(reps.values()))
                for m in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]  # rotated: no mode always first
                if rep < reps[m]]
        todo = [(rep, m) for rep, m in plan if progress.get(f"run/{size}/{m}/{rep}") is None]
        log(f"document {size}: {docs[size]['tokens']} tokens, segments of <= {settings['segment_tokens']}; "
            f"{len(plan) - len(todo)} of {len(plan)} runs already done")
        # Each mode in a process of its own, loaded one after the other (a load's transient peak is well above
        # what the model then holds: ~10 GiB for the 1.5B model's 3.5 GB); nothing is timed while they load.
        workers = {}
        for m in [m for m in MODES if any(m == mode for _, mode in todo)]:
            workers[m] = Worker(m, args, log_dir)
            workers[m].info = workers[m].receive()
        warm_text = document(tokenizer, 160)
        warm = dict(settings_for(tokenizer, warm_text, cfg), segment_tokens=96, margin_tokens=2, answer_tokens=2)
        for m, w in workers.items():
            # One at a time: two multi-threaded processes on the same cores slow each other far more than 2x.
            w.ask(mode=_reading(m), text=warm_text, query=QUERY, settings=warm, warmup=True)
        for rep, m in todo:
            t = time.perf_counter()
            result = workers[m].ask(mode=_reading(m), text=text, query=QUERY, settings=settings,
                                    followup=FOLLOWUP if m == "wim" else None)
            progress.put(f"run/{size}/{m}/{rep}", result | {"worker": workers[m].info})
            log(f"  {size} rep {rep + 1} {m:9s} {result['seconds']:7.1f} s  (wall {time.perf_counter() - t:.0f} s)")
        for w in workers.values():
            w.close()
        runs[size] = {m: [] for m in MODES}
        for rep, m in plan:
            result = progress.get(f"run/{size}/{m}/{rep}")
            runs[size][m].append(result)
            workers_info.setdefault(size, {})[m] = result["worker"]
    return runs, workers_info, docs


# ---- assembling the rows -----------------------------------------------------------------------------------------
def _tokens(run: dict) -> dict:
    return {"prefill": run["prefill_tokens"], "decode": run["decode_tokens"]}


def assemble(cfg: Config, micro: dict, runs: dict, workers_info: dict, docs: dict) -> dict:
    from engine.attribution import without_citations
    rows: dict = {k: [] for k in ("1_wim_vs_plain", "2_naive_vs_wim", "3_reference_vs_wim", "4_prefill_efficiency",
                                  "5_decode_and_truncate", "6_followup", "7_memory")}
    for size, by_mode in runs.items():
        sec = {m: median([r["seconds"] for r in rs]) for m, rs in by_mode.items()}
        n = {m: len(rs) for m, rs in by_mode.items()}
        tok = {m: _tokens(rs[0]) for m, rs in by_mode.items()}
        label = f"{docs[size]['tokens']:,}-token doc"
        rows["1_wim_vs_plain"].append({"doc": label, "wim_s": sec["wim"], "plain_s": sec["plain"],
                                       "ratio": sec["wim"] / sec["plain"], "n": [n["wim"], n["plain"]],
                                       "tokens": {"wim": tok["wim"], "plain": tok["plain"]}})
        rows["2_naive_vs_wim"].append({"doc": label, "naive_s": sec["naive"], "wim_s": sec["wim"],
                                       "ratio": sec["naive"] / sec["wim"], "n": [n["naive"], n["wim"]],
                                       "tokens": {"naive": tok["naive"], "wim": tok["wim"]}})
        wim0 = by_mode["wim"][0]
        same = by_mode["wim-forward"][0] if by_mode.get("wim-forward") else wim0  # the reference's numerics
        # The answers' words: the engine cites its notes after an answer ("[segment 3]"), the public code does not.
        identical = all(r["margins"] == same["margins"]
                        and without_citations(r["answer"]) == without_citations(same["answer"])
                        for r in by_mode["reference"] + by_mode.get("wim-forward", []))
        rows["3_reference_vs_wim"].append({
            "doc": label, "reference_s": sec["reference"], "wim_s": sec["wim"],
            "ratio": sec["reference"] / sec["wim"], "n": [n["reference"], n["wim"]],
            "tokens": {"reference": tok["reference"], "wim": tok["wim"]}, "identical": identical,
            "written_out_same_text": same["margins"] == wim0["margins"] and same["answer"] == wim0["answer"],
            "margins": [m[1] for m in wim0["margins"]], "kept": [m[2] for m in wim0["margins"]],
            "answer": wim0["answer"], "reference_answer": by_mode["reference"][0]["answer"]})
        first = sec["wim"]
        follow = median([r["followup_seconds"] for r in by_mode["wim"]])
        rows["6_followup"].append({"doc": label, "first_read_s": first, "followup_s": follow,
                                   "ratio": follow / first, "n": n["wim"],
                                   "followup_tokens": {"prefill": wim0["followup_prefill_tokens"],
                                                       "decode": wim0["followup_decode_tokens"]}})
        for m, rs in by_mode.items():
            if m == "wim-forward":  # a check's reading, not a reading pattern
                continue
            info = workers_info[size][m]
            peak = max(r.get("cuda_peak", r["peak_rss"]) for r in rs)
            kv = max(r["kv_bytes"] for r in rs)
            rows["7_memory"].append({
                "doc": label, "mode": m, "n": len(rs), "measure": "cuda peak" if "cuda_peak" in rs[0] else "peak RSS",
                "peak_bytes": peak, "weights_bytes": info["weights_bytes"], "kv_bytes": kv,
                "packs_bytes": info.get("packs_bytes", 0), "runtime_rss": info["runtime_rss"], "loaded_rss": info["loaded_rss"],
                "rss_before_run": min(r["rss_before"] for r in rs),
                "ratio": peak / (info["weights_bytes"] + kv),
                # Without the ~240 MiB that Python, torch and transformers take before any model is loaded.
                "ratio_without_runtime": (peak - info["runtime_rss"]) / (info["weights_bytes"] + kv)})
    rows["4_prefill_efficiency"] = micro["prefill"]
    rows["5_decode_and_truncate"] = micro["context"]
    return rows


def summary(rows: dict) -> list[list]:
    """One line per measured figure: row, what, where, value, target, met, n."""
    def line(row, what, where, value, key, n):
        op, bound = TARGETS[key] if key else ("", None)
        met = "" if bound is None else ("yes" if (value <= bound if op == "<=" else value >= bound) else "NO")
        shown = f"{value:.0%}" if key in ("prefill_efficiency", "followup") else f"{value:.2f}x"
        target = "" if bound is None else (f"{op} {bound:.0%}" if key in ("prefill_efficiency", "followup")
                                            else f"{op} {bound}x")
        return [row, what, where, shown, target, met, n]

    out = []
    for r in rows["1_wim_vs_plain"]:
        out.append(line(1, "WiM / plain wall time", r["doc"], r["ratio"], "wim_vs_plain", r["n"]))
    for r in rows["2_naive_vs_wim"]:
        out.append(line(2, "naive two-pass / WiM", r["doc"], r["ratio"], "naive_vs_wim", r["n"]))
    for r in rows["3_reference_vs_wim"]:
        out.append(line(3, f"reference / WiM (identical to WiM on transformers' forward: "
                           f"{'yes' if r['identical'] else 'NO'})", r["doc"],
                        r["ratio"], "reference_vs_wim", r["n"]))
    for r in rows["4_prefill_efficiency"]:
        out.append(line(4, "prefill FLOP/s / matmul FLOP/s", f"{r['tokens']:,} tokens", r["ratio"],
                        "prefill_efficiency", r["n"]))
        if r["all_logits_ratio"]:
            out.append(line(4, "all-position logits / last-only, time", f"{r['tokens']:,} tokens",
                            r["all_logits_ratio"], None, r["n"]))
    ctx = rows["5_decode_and_truncate"]
    span = f"{ctx['points'][0]['context']:,} -> {ctx['points'][-1]['context']:,}"
    n = ctx["points"][0]["n"]
    out.append(line(5, "decode step growth (ours)", span, ctx["ratio"]["decode"], None, n))
    out.append(line(5, "decode step growth (DynamicCache)", span, ctx["ratio"]["decode_dynamic"], None, n))
    out.append(line(5, "truncate + write growth (ours)", span, ctx["ratio"]["truncate_write"], None, n))
    out.append(line(5, "crop + write growth (DynamicCache)", span, ctx["ratio"]["crop_write"], None, n))
    for r in rows["6_followup"]:
        out.append(line(6, "follow-up / first read", r["doc"], r["ratio"], "followup", r["n"]))
    for r in rows["7_memory"]:
        out.append(line(7, f"peak / (weights + KV), {r['mode']}", r["doc"], r["ratio"],
                        "memory" if r["mode"] == "wim" else None, r["n"]))
        if r["mode"] == "wim":
            out.append(line(7, "same, less the runtime's own RSS, wim", r["doc"], r["ratio_without_runtime"],
                            "memory", r["n"]))
    return out


def markdown(data: dict) -> str:
    meta, rows = data["meta"], data["rows"]
    notes = ("the engine's default settings: copied (extractive) notes judged by their own relevance, each ending "
             "where the model ends it, every answer decoded to its full length"
             if meta.get("margins", "abstractive") == "extractive" else
             "free-form (abstractive) notes and a YES/NO classifier, every margin and answer decoded to its full "
             "length")
    parts = [f"# Speed and memory\n\n{meta['model']}, {meta['dtype']} on {meta['device']} ({meta['machine']['cpu']}, "
             f"{meta['machine']['torch_threads']} threads); {meta['segments']} segments, {meta['margin_tokens']}-token "
             f"margin cap, {meta['answer_tokens']}-token answers; {notes}; "
             f"medians of n runs. Wall time {meta['wall_seconds'] / 60:.1f} min; CPU load average during the runs "
             f"{meta['load']['median']:.1f} (min {meta['load']['min']:.1f}, max {meta['load']['max']:.1f}) on "
             f"{meta['machine']['cores']} cores: the CPU was shared, so compare ratios, not seconds.\n",
             md_table(["row", "measure", "where", "value", "target", "met", "n"], summary(rows)), ""]
    t = []
    for key, other in (("1_wim_vs_plain", "plain"), ("2_naive_vs_wim", "naive"), ("3_reference_vs_wim", "reference")):
        for r in rows[key]:
            t.append([key[0], r["doc"], f"{r['wim_s']:.1f}", f"{r[other + '_s']:.1f} ({other})",
                      f"{r['tokens']['wim']['prefill']:,} / {r['tokens']['wim']['decode']:,}",
                      f"{r['tokens'][other]['prefill']:,} / {r['tokens'][other]['decode']:,}"])
    parts += ["## Wall time and token accounting (prefill / decode tokens)\n",
              md_table(["row", "doc", "WiM s", "other s", "WiM tokens", "other tokens"], t), ""]
    parts += ["## Prefill against the model's own matmuls\n",
              f"One layer's seven linears at {meta['gemm']['rows']} rows in {meta['gemm']['dtype']}: "
              f"{meta['gemm']['linear_gflops']:.1f} GFLOP/s (median, measured before each prefill; bench/prefill.py). "
              f"Model matmul FLOPs per token: {meta['weight_flops_per_token'] / 1e6:.1f} M in the layers, plus "
              "attention (causal) and the LM head for the kept logits.\n",
              md_table(["tokens", "s", "GFLOP", "attention share", "GFLOP/s", "of matmul", "all-logits s", "ratio",
                        "n"],
                       [[f"{r['tokens']:,}", f"{r['seconds']:.2f}", f"{r['gflop']:.0f}", f"{r['attention_share']:.0%}",
                         f"{r['gflops']:.1f}", f"{r['ratio']:.0%}",
                         f"{r['all_logits_seconds']:.2f}" if r["all_logits_seconds"] else "-",
                         f"{r['all_logits_ratio']:.2f}x" if r["all_logits_ratio"] else "-", r["n"]]
                        for r in rows["4_prefill_efficiency"]]), ""]
    parts += ["## Decode step and truncation against context length\n",
              "Truncate/crop: cut back 64 tokens; '+ write' adds writing one token, which for DynamicCache is a "
              "torch.cat of the whole cache. Each cell: median (minimum) of n.\n",
              md_table(["context", "decode ms (ours)", "decode ms (DynamicCache)", "truncate us", "truncate+write us",
                        "crop us", "crop+write us"],
                       [[f"{p['context']:,}"] + [f"{p[k]:,.0f} ({p.get(k + '_min', p[k]):,.0f})" for k in
                         ("decode_ms", "decode_dynamic_ms", "truncate_us", "truncate_write_us", "crop_us",
                          "crop_write_us")] for p in rows["5_decode_and_truncate"]["points"]]), ""]
    parts += ["## Memory\n",
              "Peak: RSS of the mode's own process during its runs (CUDA: max allocated). Runtime: RSS after "
              "importing Python, torch and transformers, before the model; loaded: after loading it. Weights: "
              "the parameters plus the 4-bit decode packs beside them (engine/packed.py)"
              + (f", {fmt_bytes(rows['7_memory'][0]['packs_bytes'])} of them"
                 if rows["7_memory"] and rows["7_memory"][0].get("packs_bytes") else ": none") + ".\n",
              md_table(["doc", "mode", "peak", "weights", "KV cache", "runtime", "loaded", "before run", "ratio",
                        "ratio less runtime", "n"],
                       [[r["doc"], r["mode"], fmt_bytes(r["peak_bytes"]), fmt_bytes(r["weights_bytes"]),
                         fmt_bytes(r["kv_bytes"]), fmt_bytes(r["runtime_rss"]), fmt_bytes(r["loaded_rss"]),
                         fmt_bytes(r["rss_before_run"]), f"{r['ratio']:.2f}x", f"{r['ratio_without_runtime']:.2f}x",
                         r["n"]] for r in rows["7_memory"]]), ""]
    for r in rows["3_reference_vs_wim"]:
        parts += [f"## Margins and answer, {r['doc']} (the reference pattern's equal WiM's on transformers' forward: "
                  f"{'yes' if r['identical'] else 'NO'}; the engine's written-out pass gave the same text: "
                  f"{'yes' if r.get('written_out_same_text', True) else 'no'})\n"]
        parts += [f"{i + 1}. [{'kept' if k else 'dropped'}] {m!r}"
                  for i, (m, k) in enumerate(zip(r["margins"], r["kept"]))]
        parts += ["", f"Answer: {r['answer']!r}", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: one small document, one repetition")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results; "
                                                                "--quick requires it)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions for every mode (default: per config)")
    parser.add_argument("--model", default="embedded",
                        help="the model to measure (anything the engine's --model takes; default: the embedded "
                             "SmolLM2-135M; qwen2.5-1.5b: the app's default). Results: speed.md for the embedded "
                             "model, speed_<model>.md for another")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="default: the engine's choice (fp32 on this CPU)")
    parser.add_argument("--margins", choices=("extractive", "abstractive"), default="extractive",
                        help="extractive: the engine's defaults (results: speed.md); abstractive: free-form notes "
                             "decoded to full length (speed_abstractive.md)")
    parser.add_argument("--fresh", action="store_true", help="start over instead of resuming a stopped run")
    parser.add_argument("--redo", action="append", default=[], metavar="PIECE",
                        help="measure again the finished pieces whose id starts with PIECE (micro, run/4000, ...)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.device, args.dtype, args.model)
        return 0
    if args.quick and args.out is None:
        parser.error("--quick writes only to a folder given by --out (never over bench/results)")
    cfg = replace(QUICK if args.quick else FULL, margins=args.margins)
    name = "speed" + ("" if args.model == "embedded" else f"_{args.model}") + \
        ("" if args.margins == "extractive" else f"_{args.margins}")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)

    out = args.out or RESULTS
    progress = Progress(out / f"{name}_progress.jsonl", {"config": asdict(cfg), "reps": args.reps,
                                                       "device": args.device, "dtype": args.dtype,
                                                       "model": args.model}, args.fresh)
    engine = load_engine(args.device, args.dtype, args.model)
    lm = engine.lm
    log(f"{lm.name}, {lm.dtype} on {lm.device}")
    for piece in [p for p in progress.done if any(p.startswith(prefix) for prefix in args.redo)]:
        del progress.done[piece]
    micro = progress.get("micro")
    if micro is None:
        micro = microbenchmarks(engine, cfg, log)
        progress.put("micro", micro)
    tokenizer = lm.tokenizer
    from engine.model import dtype_name
    from engine.model_files import release_freed_memory
    meta = {"model": lm.name, "dtype": dtype_name(lm.dtype), "device": str(lm.device),
            "machine": machine(), "quick": args.quick, "segments": cfg.segments, "margin_tokens": cfg.margin_tokens,
            "answer_tokens": cfg.answer_tokens, "margins": cfg.margins, "config": asdict(cfg), "gemm": micro["gemm"],
            "shape": micro["shape"], "weight_flops_per_token": micro["weight_flops_per_token"]}
    del engine, lm
    release_freed_memory()  # the workers load their own copies: give this process's back first
    runs, workers_info, docs = mode_runs(cfg, args, tokenizer, progress, log)
    meta["documents"] = docs
    loads = [r[k] for size in runs.values() for rs in size.values() for r in rs for k in ("load_before", "load_after")]
    meta["load"] = {"median": median(loads), "min": min(loads), "max": max(loads)}
    meta["wall_seconds"] = time.perf_counter() - started
    rows = assemble(cfg, micro, runs, workers_info, docs)
    data = {"meta": meta, "targets": TARGETS, "rows": rows, "runs": runs}
    md = markdown(data)
    meta["code_versions"] = sorted({w["code"] for size in workers_info.values() for w in size.values()})
    paths = write_results(out, name, data, md)
    progress.path.unlink()  # everything is in speed.json now; the next run starts afresh
    print()
    print(md_table(["row", "measure", "where", "value", "target", "met", "n"], summary(rows)))
    for r in rows["3_reference_vs_wim"]:
        print(f"\nreference pattern vs WiM, {r['doc']}: margins and answer identical: {r['identical']}")
        print(f"  answer (WiM): {r['answer']!r}\n  answer (reference): {r['reference_answer']!r}")
    print(f"\nwrote {paths[0]} and {paths[1]} in {meta['wall_seconds'] / 60:.1f} min")
    assert all(r["identical"] for r in rows["3_reference_vs_wim"]), \
        "the reference pattern's margins or answer differ from WiM's on transformers' forward under greedy decoding"
    return 0


if __name__ == "__main__":
    sys.exit(main())
