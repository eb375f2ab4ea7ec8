"""Decode steps on the GGUF's 4-bit blocks (engine/packed.py) against the full weights, side by side in one
process: `python -m bench.decode_weights [--model qwen2.5-1.5b] [--dtype fp32] [--threads 2]`.

1. The kernel alone, per matrix shape of the model: torch's int4 CPU kernel against the dtype's matmul for
   passes of 1 to 512 rows (where the crossover that sets engine/packed.py's DECODE_ROWS lies).
2. The whole model: forward passes of 1, 2, 4 and 8 tokens after 512 and 4,000 tokens of context, the two
   copies of the model alternating, and greedy decoding of 32 tokens with each (the same tokens or not, and
   the greatest logit difference). Writes bench/results/decode_weights_<model>_<dtype>.{md,json}.
"""
from __future__ import annotations

import argparse
import time

from bench.common import RESULTS, load_engine, machine, md_table, median, prose, timed, write_results

ROWS = (1, 2, 4, 8, 32, 512)
PASS_TOKENS = (1, 2, 4, 8)
CONTEXTS = (512, 4000)


def kernel_rows(lm, reps: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from engine.packed import GROUP, PackedLinear

    shapes = {}
    for name, module in lm.model.named_modules():
        if isinstance(module, PackedLinear):
            shapes.setdefault((module.out_features, module.in_features), module)
    rows = []
    for (n, k), module in shapes.items():
        for m in ROWS:
            x = torch.randn(m, k, dtype=lm.dtype)
            full = timed(lambda: F.linear(x, module.weight), reps)
            packed = timed(lambda: torch._weight_int4pack_mm_for_cpu(x, module.packed, GROUP, module.scales_zeros),
                           reps)
            rows.append({"shape": f"{n} x {k}", "rows": m, "full_ms": full * 1e3, "packed_ms": packed * 1e3,
                         "ratio": packed / full})
    return rows


def model_rows(models: dict, ids: list[int], reps: int, log) -> list[dict]:
    from engine.generate import Runner

    runners = {w: Runner(lm.model, lm.tokenizer, lm.device) for w, lm in models.items()}
    caches = {w: r.new_cache(max(CONTEXTS) + 64) for w, r in runners.items()}
    rows = []
    for context in CONTEXTS:
        for w, runner in runners.items():
            caches[w].truncate(0)
            runner.prefill(ids[:context], caches[w])
        for q in PASS_TOKENS:
            times = {w: [] for w in runners}
            for rep in range(reps + 1):  # alternating; the first round warms up
                for w, runner in runners.items():
                    t = time.perf_counter()
                    runner.forward(ids[context:context + q], caches[w])
                    if rep:
                        times[w].append(time.perf_counter() - t)
                    caches[w].truncate(context)
            row = {"context": context, "tokens": q, "full_ms": median(times["full"]) * 1e3,
                   "packed_ms": median(times["gguf4"]) * 1e3}
            row["ratio"] = row["packed_ms"] / row["full_ms"]
            log(f"context {context}, {q} tokens: full {row['full_ms']:.1f} ms, packs {row['packed_ms']:.1f} ms")
            rows.append(row)
    return rows


def greedy(models: dict, ids: list[int], steps: int = 32) -> dict:
    from engine.generate import Runner

    runs = {}
    for w, lm in models.items():
        runner = Runner(lm.model, lm.tokenizer, lm.device)
        cache = runner.new_cache(len(ids) + steps + 1)
        logits = runner.prefill(ids, cache)
        tokens, seen = [], []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            seen.append(logits.float())
            logits = runner.forward([tokens[-1]], cache)[-1]
        runs[w] = (tokens, seen)
    same = runs["full"][0] == runs["gguf4"][0]
    agree = next((i for i, (a, b) in enumerate(zip(runs["full"][0], runs["gguf4"][0])) if a != b), steps)
    worst = max((a - b).abs().max().item() for a, b in zip(runs["full"][1][:agree], runs["gguf4"][1][:agree]))
    return {"same_tokens": same, "steps_equal": agree, "steps": steps, "max_logit_diff": worst}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_weights", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default=None, help="default: the engine's choice (bf16 on an AMX CPU)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    import torch

    from engine.model import dtype_name

    torch.set_num_threads(args.threads)

    def log(msg):
        print(msg, flush=True)

    models = {w: load_engine("cpu", args.dtype, args.model, decode_weights=w).lm for w in ("full", "gguf4")}
    lm = models["gguf4"]
    dtype = dtype_name(lm.dtype)
    ids = lm.tokenizer(prose(lm.tokenizer, max(CONTEXTS) + 100), add_special_tokens=False)["input_ids"]
    kernel = kernel_rows(lm, args.reps)
    passes = model_rows(models, ids, args.reps, log)
    quality = greedy(models, ids[:512])
    data = {"model": lm.name, "dtype": dtype, "threads": args.threads, "machine": machine(), "packs": lm.packs,
            "kernel": kernel, "passes": passes, "greedy": quality}
    md = [f"# Decode weights: the GGUF's 4-bit blocks against the full weights\n\n{lm.name}, {dtype}, "
          f"{args.threads} threads on {data['machine']['cpu']}; medians of {args.reps}, the two copies of the "
          f"model alternating in one process. Packs: {lm.packs['packed']} matrices, "
          f"{lm.packs['bytes'] / 2**20:,.0f} MiB (beside the full weights).\n",
          "## Whole forward passes\n",
          md_table(["context", "tokens", "full ms", "packs ms", "packs / full"],
                   [[f"{r['context']:,}", r["tokens"], f"{r['full_ms']:.1f}", f"{r['packed_ms']:.1f}",
                     f"{r['ratio']:.2f}x"] for r in passes]),
          "\nPasses of more than engine/packed.py's DECODE_ROWS rows use the full weights in both copies.\n",
          "## The kernel alone\n",
          md_table(["matrix", "rows", "full ms", "int4 ms", "int4 / full"],
                   [[r["shape"], r["rows"], f"{r['full_ms']:.3f}", f"{r['packed_ms']:.3f}", f"{r['ratio']:.2f}x"]
                    for r in kernel]),
          "\n## Greedy decoding, 32 tokens after 512 of prose\n\n"
          f"Same tokens: {'yes' if quality['same_tokens'] else 'no'} "
          f"(equal for {quality['steps_equal']} of {quality['steps']} steps); greatest logit difference while they "
          f"agreed: {quality['max_logit_diff']:.4f}.\n"]
    name = f"decode_weights_{args.model if args.model in ('embedded', 'qwen2.5-1.5b') else 'model'}_{dtype}"
    write_results(RESULTS, name, data, "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
