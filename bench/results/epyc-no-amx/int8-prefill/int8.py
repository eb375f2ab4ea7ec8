"""int8 prefill (engine/prefill_int8.py) against the loaded weights, side by side in one process:
`python -m bench.int8 [--model qwen2.5-1.5b] [--threads 2] [--lengths 512,4096] [--reps 3]`.

One model loaded with its int8 copies; each repetition prefills the same book prose with the copies in use and
with them set aside (the full weights), alternating, so that both see the same machine. Prints prefill tok/s
each way and their ratio at each length, then how far the int8 pass's logits are from the full weights' at
every position of `--compare` tokens of another book: greedy (argmax) agreement and the mean KL divergence.
Writes bench/results/int8.{md,json}.
"""
from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

from bench.common import RESULTS, load_engine, machine, median, prose, write_results


@contextmanager
def full_weights(model):
    """The int8 copies set aside for the block: passes of many rows take the loaded weights."""
    held = [(m, m.prefill_q) for m in model.modules() if getattr(m, "prefill_q", None) is not None]
    for m, _ in held:
        m.prefill_q = None
    try:
        yield
    finally:
        for m, q in held:
            m.prefill_q = q


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.int8", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="512,4096")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compare", type=int, default=2048, help="tokens whose logits are compared")
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from engine.cache import make_cache
    from engine.model import dtype_name

    torch.set_num_threads(args.threads)
    lm = load_engine(None, None, args.model, prefill_weights="int8").lm
    if not lm.prefill_int8:
        raise SystemExit("no int8 copies were added (engine/prefill_int8.py)")
    runner = lm.runner()
    lengths = [int(n) for n in args.lengths.split(",")]
    rows, start = [], time.perf_counter()
    for length in lengths:
        ids = lm.tokenizer(prose(lm.tokenizer, length + 64), add_special_tokens=False)["input_ids"][:length]
        cache = make_cache(lm.model, length + 8)
        times = {"int8": [], "full": []}
        for rep in range(args.reps + 1):  # the first round warms up and is not counted
            for way in ("int8", "full"):
                cache.truncate(0)
                with (full_weights(lm.model) if way == "full" else _nothing()):
                    t = time.perf_counter()
                    runner.prefill(ids, cache)
                    if rep:
                        times[way].append(time.perf_counter() - t)
        full, int8 = length / median(times["full"]), length / median(times["int8"])
        rows.append({"tokens": length, "full_tok_s": round(full, 1), "int8_tok_s": round(int8, 1),
                     "int8_over_full": round(int8 / full, 3)})
        print(f"{length} tokens: full weights {full:.1f} tok/s, int8 {int8:.1f} tok/s: {int8 / full:.2f}x", flush=True)
    # the logits at every position, each way, over another book's prose
    ids = lm.tokenizer(prose(lm.tokenizer, args.compare + 64, "pg1342.txt", 20_000),
                       add_special_tokens=False)["input_ids"][:args.compare]
    logits = {}
    for way in ("int8", "full"):
        cache = make_cache(lm.model, len(ids) + 8)
        with (full_weights(lm.model) if way == "full" else _nothing()):
            logits[way] = torch.cat([runner.forward(ids[s:s + 512], cache, all_logits=True).float()
                                     for s in range(0, len(ids), 512)])
    agree = float((logits["int8"].argmax(-1) == logits["full"].argmax(-1)).float().mean())
    kl = float(F.kl_div(logits["int8"].log_softmax(-1), logits["full"].log_softmax(-1), log_target=True,
                        reduction="batchmean"))
    print(f"{len(ids)} positions: greedy tokens agree {agree:.4f}, mean KL(full || int8) {kl:.4f}")
    meta = {"model": lm.name, "dtype": dtype_name(lm.dtype), "threads": args.threads,
            **machine(), "load_average": round(os.getloadavg()[0], 1),
            "prefill_weights": lm.info["prefill_weights"], "decode_weights": lm.info["decode_weights"],
            "reps": args.reps, "positions_compared": len(ids), "greedy_agreement": round(agree, 4),
            "mean_kl": round(kl, 5), "wall_seconds": round(time.perf_counter() - start, 1)}
    header = (f"# int8 prefill against the full weights\n\n{meta['model']}, {meta['dtype']}, {meta['cpu']}, "
              f"{args.threads} thread(s); medians of {args.reps} prefills each way, alternating; {meta['prefill_weights']}."
              f"\n\n| tokens | full weights tok/s | int8 tok/s | int8 / full |\n|---|---|---|---|\n")
    table = "".join(f"| {r['tokens']} | {r['full_tok_s']} | {r['int8_tok_s']} | {r['int8_over_full']:.2f}x |\n"
                    for r in rows)
    footer = (f"\nLogits at {len(ids)} positions of another book: greedy tokens agree {agree:.2%}, mean KL "
              f"{kl:.4f}. Load average {meta['load_average']}.\n")
    write_results(RESULTS, "int8", {"meta": meta, "rows": rows}, header + table + footer)
    return 0


@contextmanager
def _nothing():
    yield


if __name__ == "__main__":
    raise SystemExit(main())
