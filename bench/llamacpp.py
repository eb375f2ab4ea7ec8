"""Our prefill and decode tokens/s against llama.cpp's, on the same GGUF file and CPU: `make bench-llamacpp`
(= `python -m bench.llamacpp [--models embedded,qwen2.5-1.5b] [--threads 1] [--dtype fp32]`).

llama.cpp (llama-cpp-python, built from source into .venv-llama by the Makefile) runs the GGUF file as it is,
quantized; the engine runs the same file de-quantized (engine/model.py) in its dtype. Both get the same
number of threads and the same number of tokens of the same book text (each tokenized by its own tokenizer).
The two sides alternate within each repetition, so a busy minute on a shared CPU lands on both. Decode steps
are measured at the context the prefill left. Results: bench/results/llamacpp.{md,json}; the goal is
ours / llama.cpp >= 1.5 for prefill and >= 0.8 for decode.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import RESULTS, ROOT, load_engine, machine, md_table, median, prose, write_results

LLAMA_PYTHON = ROOT / ".venv-llama" / "bin" / "python"
GOALS = {"prefill": 1.5, "decode": 0.8}


def gguf_of(spec: str) -> Path:
    from engine.model import EMBEDDED, QWEN, assemble_qwen, embedded_gguf
    return {EMBEDDED: embedded_gguf, QWEN: assemble_qwen}[spec]() if spec in (EMBEDDED, QWEN) else Path(spec)


class LlamaWorker:
    def __init__(self, gguf: Path, n_ctx: int, threads: int, log: Path):
        self.proc = subprocess.Popen([str(LLAMA_PYTHON), "-m", "bench.llamacpp_worker", str(gguf), str(n_ctx),
                                      str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log.open("w"), text=True, bufsize=1, cwd=ROOT)
        self.log = log
        self.info = self.receive()

    def receive(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker died:\n{self.log.read_text(errors='replace')[-3000:]}")
        return json.loads(line)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        return self.receive()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.unlink(missing_ok=True)  # kept only to explain a worker that died


def measure(spec: str, decode_weights: str, prefill_weights: str, args, log) -> dict:
    import torch

    from engine.cache import make_cache
    from engine.model import dtype_name

    torch.set_num_threads(args.threads)
    engine = load_engine(None, args.dtype, model=spec, decode_weights=decode_weights, prefill_weights=prefill_weights)
    lm = engine.lm
    runner = lm.runner()
    gguf = gguf_of(spec)
    blocks = {"gguf4": "4-bit", "gguf": "4-, 6- and 8-bit", "gguf-q8": "4-, 6- and 8-bit (int8 inputs)"}.get(
        lm.packs.get("choice")) if lm.packs else None
    ours_in = (dtype_name(lm.dtype) + (", int8 prefill" if lm.prefill_int8 else "")
               + (f", decode on the GGUF's {blocks} blocks" if blocks else ""))
    log(f"{lm.name}: ours {ours_in}, llama.cpp on {gguf.name}")
    worker = LlamaWorker(gguf, args.prompt + args.steps + 16, args.threads,
                         Path(args.out) / f"llamacpp-{lm.name.split()[0]}.log.tmp")
    text = prose(lm.tokenizer, args.prompt + 100)
    ours_ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"][:args.prompt]
    theirs_ids = worker.ask(tokenize=text)[:args.prompt]
    n = min(len(ours_ids), len(theirs_ids))
    ours_ids, theirs_ids = ours_ids[:n], theirs_ids[:n]
    cache = make_cache(lm.model, n + args.steps + 16)

    def ours_prefill() -> float:
        cache.truncate(0)
        t = time.perf_counter()
        runner.prefill(ours_ids, cache)
        return time.perf_counter() - t

    def ours_decode() -> list[float]:
        seconds = []
        for _ in range(args.steps):
            t = time.perf_counter()
            runner.forward([ours_ids[-1]], cache)
            seconds.append(time.perf_counter() - t)
        cache.truncate(n)
        return seconds

    # Warm-up: first passes pay one-time costs (kernel selection, page faults on the weights) on both sides.
    ours_prefill(), ours_decode()
    worker.ask(prefill=theirs_ids), worker.ask(decode=theirs_ids[-1], steps=2)
    runs = {"ours_prefill": [], "llama_prefill": [], "ours_decode": [], "llama_decode": [], "load": []}
    for rep in range(args.reps):
        log(f"  repetition {rep + 1} of {args.reps}")
        runs["load"].append(os.getloadavg()[0])
        runs["ours_prefill"].append(ours_prefill())
        runs["llama_prefill"].append(worker.ask(prefill=theirs_ids))
        runs["ours_decode"] += ours_decode()
        runs["llama_decode"] += worker.ask(decode=theirs_ids[-1], steps=args.steps)
    worker.close()
    row = {"model": lm.name, "gguf": gguf.name, "ours_dtype": ours_in,
           "llama_cpp": worker.info["version"], "threads": args.threads, "prompt_tokens": n, "steps": args.steps,
           "reps": args.reps, "runs": runs}
    for phase in ("prefill", "decode"):
        per = n if phase == "prefill" else 1
        ours, theirs = per / median(runs[f"ours_{phase}"]), per / median(runs[f"llama_{phase}"])
        row[phase] = {"ours_tps": ours, "llama_tps": theirs, "ratio": ours / theirs, "goal": GOALS[phase]}
    row["load_median"] = median(runs["load"])
    del engine, lm, runner, cache
    return row


def markdown(data: dict) -> str:
    meta, rows = data["meta"], data["rows"]
    lines = [f"# Ours against llama.cpp\n\n{meta['machine']['cpu']}, {meta['threads']} thread(s) each side; prefill "
             f"of {meta['prompt']} tokens of book text into an empty context, then {meta['steps']} decode steps at "
             f"that context; medians of {meta['reps']} repetitions (decode: of every step), the two sides "
             f"alternating. Wall time {meta['wall_seconds'] / 60:.1f} min.\n"]
    table = []
    for r in rows:
        for phase in ("prefill", "decode"):
            p = r[phase]
            table.append([r["model"], f"{r['gguf']} (llama.cpp {r['llama_cpp']})", r["ours_dtype"], phase,
                          f"{p['ours_tps']:.1f}", f"{p['llama_tps']:.1f}", f"{p['ratio']:.2f}x",
                          f">= {p['goal']}x", "yes" if p["ratio"] >= p["goal"] else "NO", f"{r['load_median']:.1f}"])
    lines.append(md_table(["model", "GGUF", "ours in", "phase", "ours tok/s", "llama.cpp tok/s", "ours / llama.cpp",
                           "goal", "met", "load avg"], table))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="embedded,qwen2.5-1.5b")
    parser.add_argument("--dtype", default=None, help="ours: default the engine's choice (bf16 on an AMX CPU)")
    parser.add_argument("--decode-weights", default="gguf4,full",
                        help="ours: one row per choice (engine/model.py's pick_decode_weights)")
    parser.add_argument("--prefill-weights", default="full",
                        help="ours: one row per choice (engine/prefill_int8.py), e.g. full,int8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if not LLAMA_PYTHON.exists():
        raise SystemExit("no .venv-llama: run `make bench-llamacpp` (it builds llama-cpp-python first)")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = [measure(spec, weights, prefill, args, log) for spec in args.models.split(",")
            for weights in args.decode_weights.split(",") for prefill in args.prefill_weights.split(",")]
    meta = {"machine": machine(), "threads": args.threads, "prompt": args.prompt, "steps": args.steps,
            "reps": args.reps, "wall_seconds": time.perf_counter() - started}
    data = {"meta": meta, "rows": rows}
    md = markdown(data)
    paths = write_results(Path(args.out), "llamacpp", data, md)
    print("\n" + md + f"\nwrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
