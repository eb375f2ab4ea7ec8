"""`python -m bench.decode_kernels [--model qwen2.5-1.5b] [--threads 2]`: one decode step with the `gguf` decode
copies (engine/kernels' gemv_q4 and gemv_int8 over the GGUF's own 4-, 6- and 8-bit values) against the full
weights, in one process: the model is loaded once with `gguf`, and each repetition runs a step six ways in turn
(full weights; the 4-bit copies only; the 6- and 8-bit copies only; both; both with the inputs rounded to int8
blocks, `gguf-q8`, through transformers' forward and through engine/decode_step.py, its layers run from C++ as
the engine runs them and in Python), at the context a 512-token prefill left; where the kernels were built with
AVX-512 VNNI, one more way runs the written-out step with their AVX2 path instead (the same values, engine/kernels'
use_avx512). Writes
bench/results/decode_kernels_<model>_<dtype>_<threads>t.{md,json}.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import RESULTS, cpu_name, load_engine, md_table, median, prose, write_results

# way -> (4-bit copies on, 6- and 8-bit copies on, inputs rounded to int8, the kernels' AVX-512 path where built)
WAYS = {"full weights": (False, False, False, True), "4-bit copies": (True, False, False, True),
        "6- and 8-bit copies": (False, True, False, True), "all copies (gguf)": (True, True, False, True),
        "all copies, int8 inputs (gguf-q8)": (True, True, True, True),
        "gguf-q8, the written-out step": (True, True, True, True),
        "gguf-q8, the written-out step, its layers in Python": (True, True, True, True),
        "gguf-q8, the written-out step, AVX2 kernels": (True, True, True, False)}
# engine/decode_step.py's ways -> whether its layers run from C++ (engine/kernels' decode_layers.cpp)
WRITTEN_OUT = {"gguf-q8, the written-out step": True, "gguf-q8, the written-out step, its layers in Python": False,
               "gguf-q8, the written-out step, AVX2 kernels": True}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--dtype", default=None, help="default: the engine's choice (fp32 without bf16 units)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    import torch

    from engine import kernels as native, packed
    from engine.decode_step import DecodeStep
    from engine.model import dtype_name
    torch.set_num_threads(args.threads)
    lm = load_engine("cpu", args.dtype, args.model, decode_weights="gguf").lm
    ids = lm.tokenizer(prose(lm.tokenizer, args.context + 100), add_special_tokens=False)["input_ids"]
    ids = ids[:args.context]
    runner = lm.runner()
    cache = runner.new_cache(args.context + 8)
    runner.prefill(ids, cache)
    kernels = {packed.Q4Linear: packed.Q4Linear.few_rows, packed.Int8Linear: packed.Int8Linear.few_rows}
    copies = [m for m in lm.model.modules() if isinstance(m, (packed.Q4Linear, packed.Int8Linear))]
    # gguf-q8's kernels read the scales and lows in fp16: both versions are kept, and each way takes its own
    scales = {round_x: [{k: (v.half() if round_x else v) for k, v in m._buffers.items() if k in ("scale", "low")}
                        for m in copies] for round_x in (False, True)}
    ways = WAYS if native.use_avx512(True) else {w: v for w, v in WAYS.items() if v[3]}
    times = {way: [] for way in ways}
    written_out = {}  # built once the copies are gguf-q8's
    try:
        for rep in range(args.reps + 1):  # the first round warms up
            for way, (q4, q8, round_x, wide) in ways.items():
                native.use_avx512(wide)
                packed.Q4Linear.few_rows = kernels[packed.Q4Linear] if q4 else (lambda self, x: None)
                packed.Int8Linear.few_rows = kernels[packed.Int8Linear] if q8 else (lambda self, x: None)
                for copy, buffers in zip(copies, scales[round_x]):
                    copy.round_x = round_x
                    copy._buffers.update(buffers)
                if way in WRITTEN_OUT and way not in written_out:
                    written_out[way] = DecodeStep.of(lm.model, native=WRITTEN_OUT[way])
                t = time.perf_counter()
                if way in WRITTEN_OUT:
                    written_out[way](ids[-1], args.context, cache)
                else:
                    runner.forward([ids[-1]], cache)
                if rep:
                    times[way].append(time.perf_counter() - t)
                cache.truncate(args.context)
    finally:
        packed.Q4Linear.few_rows, packed.Int8Linear.few_rows = kernels.values()
        native.use_avx512(True)
        for copy, buffers in zip(copies, scales[False]):
            copy.round_x = False
            copy._buffers.update(buffers)
    full = median(times["full weights"])
    rows = [{"way": way, "ms": median(t) * 1e3, "tok_s": 1 / median(t), "ratio": median(t) / full}
            for way, t in times.items()]
    dtype = dtype_name(lm.dtype)
    meta = {"model": lm.name, "dtype": dtype, "threads": args.threads, "cpu": cpu_name(), "reps": args.reps,
            "context": args.context, "packs": lm.packs}
    table = md_table(["decode step with", "ms", "tok/s", "time / full weights"],
                     [[r["way"], f"{r['ms']:.0f}", f"{r['tok_s']:.2f}", f"{r['ratio']:.2f}x"] for r in rows])
    text = (f"# Decode steps on the GGUF's own values\n\n{lm.name}, {dtype}, {args.threads} thread(s), {meta['cpu']}; "
            f"one step at {args.context} tokens of context, medians of {args.reps}, the {len(ways)} ways in turn in one "
            f"process.\n\n{table}\n")
    slug = lm.name.split()[0].lower()
    name = f"decode_kernels_{slug}_{dtype}_{args.threads}t"
    paths = write_results(args.out, name, {"meta": meta, "rows": rows}, text)
    print(text)
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
