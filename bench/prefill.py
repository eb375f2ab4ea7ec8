"""`python -m bench.prefill`: how close a prefill comes to this CPU's matmul rate, and where the rest goes.

The yardstick is the model's own matmuls: every linear layer of one transformer layer (q, k, v, o, gate, up,
down) at PREFILL_CHUNK rows, in the engine's dtype and at the thread count given (default: torch's, which is what
the app uses), measured in the same process right before each prefill. A prefill's rate counts every matmul FLOP
of its layers and of causal attention (bench/flops.py's Shape), so a pass that ran its linears at the yardstick's rate
and its attention as fast would score 100%. Beside the yardstick, every layer's linears in the order a pass
calls them, nothing else between them: the yardstick repeats one layer, whose weights stay in the cache, while a
pass reads each layer's from memory once, so this is the most a pass can reach with these matmuls. Each prefill
runs through the written-out pass (engine/prefill_step.py, the engine's) and through transformers' forward,
alternating, so the gain is measured side by side; with --dense,
where the engine prepacked its weights for oneDNN (engine/packed.py), also through a second copy of the model whose
weights are left as they are. The torch profiler then splits one 512-token pass after a cache of
each length into the linears, the attention kernel and everything else, and the attention kernel is timed alone
on the model's shape, to say which part holds a prefill below the yardstick.

Results: bench/results/prefill.{md,json} (prefill_<model>.md for a model other than the default).
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

from .common import RESULTS, book, cpu_name, environment, load_engine, md_table, median, timed, write_results
from .flops import Shape, layer_linears, linear_gflops
from .speed import TARGETS

TARGET = TARGETS["prefill_efficiency"][1]  # bench.speed's row 4: prefill / the model's own matmuls, 512 and 4k
LENGTHS = (512, 4096, 16384)


def linears_in_order_gflops(model, dtype, rows: int, reps: int = 3) -> float:
    """Every layer's linears at `rows` rows, in the order a pass calls them, with nothing else in between: the
    most a pass can reach with these matmuls. The yardstick repeats one layer, whose weights then come from the
    cache (one layer of the 1.5B is 94 MB, the model 2.6 GB); a pass reads each layer's from memory once."""
    import torch
    linears = [linear for index in range(len(model.model.layers)) for linear in layer_linears(model, index).values()]
    inputs = {}
    for linear in linears:
        inputs.setdefault(linear.in_features, torch.randn(rows, linear.in_features, dtype=dtype))
    flops = sum(2 * rows * linear.in_features * linear.out_features for linear in linears)

    def run():
        for linear in linears:
            linear(inputs[linear.in_features])
    with torch.inference_mode():
        return flops / timed(run, reps) / 1e9


def attention_gflops(shape, dtype, context: int, rows: int, reps: int = 3) -> float:
    """The attention kernel alone, as engine/attention.py calls it for a `rows`-token pass after `context - rows`
    cached tokens (grouped heads, the causal mask)."""
    import torch
    from engine.attention import attention
    start = context - rows
    q = torch.randn(1, rows, shape.heads, shape.head_dim, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, shape.kv_heads, context, shape.head_dim, dtype=dtype)
    v = torch.randn(1, shape.kv_heads, context, shape.head_dim, dtype=dtype)
    mask = (torch.arange(context)[None, :] <= torch.arange(start, context)[:, None])[None, None]
    with torch.inference_mode():
        s = timed(lambda: attention(None, q, k, v, mask, scaling=shape.head_dim ** -0.5), reps)
    return 4 * shape.heads * shape.head_dim * (rows * start + rows * (rows + 1) // 2) / s / 1e9


def pass_shares(runner, cache, ids: list[int]) -> dict:
    """One forward pass of `ids` after what `cache` holds, under the torch profiler: the shares of its time in the
    linears, in the attention kernel and in everything else."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.forward(ids, cache)
    total = linears = attention = 0.0
    for event in prof.key_averages():
        total += event.self_cpu_time_total
        if event.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu",
                         "mkldnn::_linear_pointwise", "aten::_int_mm"):  # prepacked weights, int8 prefill
            linears += event.self_cpu_time_total
        elif "attention" in event.key:
            attention += event.self_cpu_time_total
    return {"linears": linears / total, "attention": attention / total, "other": 1 - (linears + attention) / total}


class OtherAttention:
    """The written-out pass with another attention kernel (MARGINALIA_ATTENTION set to `choice` during its
    calls): the side-by-side column of --attention."""

    def __init__(self, runner, choice: str):
        self.runner, self.choice = runner, choice

    def __call__(self, work):
        with environment("MARGINALIA_ATTENTION", self.choice):
            return work()

    def prefill(self, ids, cache):
        return self(partial(self.runner.prefill, ids, cache))


def measure(engine, lengths=LENGTHS, reps: int = 2, log=print, dense=None, attention: str | None = None
            ) -> list[dict]:
    """A row per length: the prefill of that many tokens into an empty cache against the yardstick measured right
    before it (`reps` of each, medians), the attention kernel's rate at that context, and one profiled pass.
    `attention`: also the written-out pass with that attention kernel, alternating with the others."""
    import torch
    from engine.cache import make_cache
    from engine.generate import PREFILL_CHUNK, Runner
    lm = engine.lm
    model, dtype = lm.model, lm.dtype
    rows = PREFILL_CHUNK  # the yardstick's rows are the prefill's passes
    shape = Shape.of(model)
    text = book("pg84.txt")
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (max(lengths) // len(ids) + 1))[:max(lengths)]
    runner = Runner(model, lm.tokenizer, lm.device)
    forward = Runner(model, lm.tokenizer, lm.device)  # transformers' forward, for the side-by-side column
    forward.prefill_step = None
    ways = [runner, forward] if runner.prefill_step is not None else [runner]
    # `dense`: the same model loaded with its full weights as they are (MARGINALIA_PREPACK=off), where the engine
    # prepacked them (engine/packed.py's prepack_full_weights): the written-out pass over those, a third way
    unpacked = Runner(dense.lm.model, dense.lm.tokenizer, dense.lm.device) if dense is not None else None
    ways += [unpacked] if unpacked is not None else []
    other = OtherAttention(runner, attention) if attention else None
    ways += [other] if other is not None else []
    with torch.inference_mode():
        for way in ways:
            warm = make_cache(model, 2 * rows + 8)
            way.prefill(ids[:2 * rows], warm)  # the first passes pay one-time costs
            del warm
        out = []
        for n in lengths:
            log(f"prefill {n:,} tokens x{reps}")
            yard, in_order, times = [], [], {way: [] for way in ways}
            for rep in range(reps):
                yard.append(linear_gflops(model, dtype, rows)["gflops"])
                in_order.append(linears_in_order_gflops(model, dtype, rows, reps=1))
                for way in ways if rep % 2 == 0 else ways[::-1]:  # the order alternates
                    cache = make_cache(model, n + rows)
                    t = time.perf_counter()
                    way.prefill(ids[:n], cache)
                    times[way].append(time.perf_counter() - t)
                    del cache
            seconds, forward_seconds = times[runner], times.get(forward, [])
            dense_seconds, other_seconds = times.get(unpacked, []), times.get(other, [])
            flops = shape.prefill_flops(n)
            context = max(n, rows)
            cache = make_cache(model, context + rows)
            if context > rows:
                runner.prefill(ids[:context - rows], cache)
            shares = pass_shares(runner, cache, ids[context - rows:context])
            other_shares = other(partial(pass_shares, runner, cache, ids[context - rows:context])) if other else None
            del cache
            gflops = flops / median(seconds) / 1e9
            out.append({"tokens": n, "reps": reps, "seconds": median(seconds), "tokens_per_s": n / median(seconds),
                        "gflop": flops / 1e9, "gflops": gflops, "linear_gflops": median(yard),
                        "ratio": gflops / median(yard),
                        "linears_in_order_gflops": median(in_order),
                        "in_order_ratio": median(in_order) / median(yard),
                        "ratio_to_in_order": gflops / median(in_order),
                        "forward_seconds": median(forward_seconds) if forward_seconds else None,
                        "dense_seconds": median(dense_seconds) if dense_seconds else None,
                        "forward_ratio": flops / median(forward_seconds) / 1e9 / median(yard) if forward_seconds else None,
                        "attention_flop_share": shape.attention_flops(0, n) / flops,
                        "attention_kernel_gflops": attention_gflops(shape, dtype, context, rows),
                        "last_pass_time_shares": shares,
                        **({"other_attention": attention, "other_seconds": median(other_seconds),
                            "other_ratio": flops / median(other_seconds) / 1e9 / median(yard),
                            "other_attention_kernel_gflops": other(partial(attention_gflops, shape, dtype, context, rows)),
                            "other_last_pass_time_shares": other_shares} if other else {})})
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    table = md_table(
        ["tokens", "s", "tok/s", "GFLOP/s", "model's matmuls GFLOP/s", "prefill / matmuls", f"target >= {TARGET:.0%}",
         "transformers' forward: s", "forward / matmuls", "forward / written out, time",
         "dense weights / prepacked, time",
         "attention: share of FLOPs", "attention kernel GFLOP/s", "last 512-token pass: linears / attention / other",
         "all layers' linears in order: GFLOP/s", "in order / matmuls", "prefill / in order"],
        [[f"{r['tokens']:,}", f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['gflops']:.0f}",
          f"{r['linear_gflops']:.0f}", f"{r['ratio']:.0%}",
          ("yes" if r["ratio"] >= TARGET else "NO") if r["tokens"] <= 4096 else "(reported)",
          *((f"{r['forward_seconds']:.2f}", f"{r['forward_ratio']:.0%}", f"{r['forward_seconds'] / r['seconds']:.2f}x")
            if r.get("forward_seconds") else ("-", "-", "-")),
          f"{r['dense_seconds'] / r['seconds']:.2f}x" if r.get("dense_seconds") else "-",
          f"{r['attention_flop_share']:.0%}", f"{r['attention_kernel_gflops']:.0f}",
          " / ".join(f"{r['last_pass_time_shares'][k]:.0%}" for k in ("linears", "attention", "other")),
          f"{r['linears_in_order_gflops']:.0f}", f"{r['in_order_ratio']:.0%}", f"{r['ratio_to_in_order']:.0%}"]
         for r in rows])
    others = [r for r in rows if r.get("other_attention")]
    if others:
        choice = others[0]["other_attention"]
        table += "\n\n" + f"The same prefills with MARGINALIA_ATTENTION={choice}, alternating with the above:\n\n" + md_table(
            ["tokens", "s", "prefill / matmuls", "time against the default's", "attention kernel GFLOP/s",
             "last 512-token pass: linears / attention / other"],
            [[f"{r['tokens']:,}", f"{r['other_seconds']:.2f}", f"{r['other_ratio']:.0%}",
              f"{r['other_seconds'] / r['seconds']:.2f}x", f"{r['other_attention_kernel_gflops']:.0f}",
              " / ".join(f"{r['other_last_pass_time_shares'][k]:.0%}" for k in ("linears", "attention", "other"))]
             for r in others])
    return "\n".join([
        "# Prefill against the model's own matmuls\n",
        f"{meta['model']}, {meta['dtype']} (weights for passes of many rows: {meta.get('weights', 'full')}), "
        f"{meta['threads']} thread(s), {meta['cpu']}; passes of {meta['chunk']} "
        f"tokens through the written-out pass (engine/prefill_step.py) and, in the same run, the two alternating, "
        f"through transformers' forward; medians of {meta['reps']}; load average {meta['load']:.1f} before. The yardstick: one layer's seven "
        f"linears at {meta['chunk']} rows, measured before each prefill, and beside it every layer's linears "
        f"in the order a pass calls them (the most a pass can reach with these matmuls); its plain "
        f"{meta['chunk']}x{meta['hidden']} @ {meta['hidden']}x{meta['intermediate']} product ran at "
        f"{meta['plain_gflops']:.0f} GFLOP/s.\n", table, ""])


def main(argv: list[str] | None = None) -> int:
    import os
    parser = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--lengths", default=",".join(str(n) for n in LENGTHS))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's (all cores, as the app)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="smoke test: the 135M, 256 and 640 tokens, once")
    parser.add_argument("--dense", action="store_true",
                        help="where the engine prepacks its weights (the default with AMX), also time a second copy "
                             "of the model whose weights are left as they are (twice the memory)")
    parser.add_argument("--attention", choices=["torch", "fused"], default=None,
                        help="also time the written-out pass with this attention kernel (MARGINALIA_ATTENTION), "
                             "alternating with the default")
    args = parser.parse_args(argv)
    if args.quick:
        if args.out is None:
            parser.error("--quick writes only to a folder given by --out (never over bench/results)")
        args.model, args.lengths, args.reps = "embedded", "256,640", 1
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    engine = load_engine(model=args.model)
    lm = engine.lm
    dense = None
    if args.dense and lm.prepacked and lm.prepacked["matrices"]:  # the same model, its weights left as they are
        with environment("MARGINALIA_PREPACK", "off"):
            dense = load_engine(model=args.model)
    from engine.generate import PREFILL_CHUNK
    from engine.model import dtype_name
    cfg = lm.model.config.get_text_config(decoder=True)
    a = torch.randn(PREFILL_CHUNK, cfg.hidden_size, dtype=lm.dtype)
    b = torch.randn(cfg.hidden_size, cfg.intermediate_size, dtype=lm.dtype)
    plain = 2 * PREFILL_CHUNK * cfg.hidden_size * cfg.intermediate_size / timed(lambda: a @ b, 5) / 1e9
    rows = measure(engine, [int(x) for x in args.lengths.split(",")], args.reps, dense=dense,
                   attention=args.attention)
    meta = {"model": lm.name, "dtype": dtype_name(lm.dtype), "threads": torch.get_num_threads(),
            "weights": lm.info["prefill_weights"],
            "cpu": cpu_name(), "chunk": PREFILL_CHUNK, "reps": args.reps, "load": load, "plain_gflops": plain,
            "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "target": TARGET,
            "attention": os.environ.get("MARGINALIA_ATTENTION", "auto"), "other_attention": args.attention}
    md = markdown(meta, rows)
    out = args.out or RESULTS
    name = "prefill" + ("" if args.model == "qwen2.5-1.5b" else f"_{args.model.replace('/', '_')}")
    write_results(out, name, {"meta": meta, "rows": rows}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
