"""int8 weight-only dynamic quantization of the linear layers against fp32, side by side:
`python -m bench.int8 [--model embedded] [--threads 1]`.

For CPUs without bf16 matrix units, where fp32 weights are what every decode step reads. torch's
`quantize_dynamic` stores each nn.Linear's weight as int8 (one scale per output channel) and quantizes the activations on
the fly. Two copies of the model in one process, timed alternately: a decode step at 512 tokens of context
and a 512-token prefill, plus how far the int8 model's next-token logits are from fp32's and whether greedy
decoding picks the same 32 tokens. The LM head (tied to the embedding) is left in fp32. Prints the figures;
writes nothing. torch marks its quantized tensors deprecated (pytorch#184982), so this is a measurement,
not a path the engine takes.
"""
from __future__ import annotations

import argparse
import copy
import os
import time
import warnings

from .common import load_engine, median, prose


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.int8", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    from engine.cache import make_cache
    from engine.generate import Runner

    torch.set_num_threads(args.threads)
    engine = load_engine("cpu", "fp32", model=args.model, decode_weights="full")  # quantize_dynamic wants nn.Linear
    lm = engine.lm
    int8 = copy.deepcopy(lm.model)
    head = int8.lm_head
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Per output channel: one scale per row (a per-tensor scale lost the argmax on the first token).
        int8.model = quantize_dynamic(int8.model, {torch.nn.Linear: per_channel_dynamic_qconfig})
    int8.lm_head = head
    models = {"fp32": lm.model, "int8": int8}
    size = {name: sum(t.numel() * t.element_size() for t in m.state_dict().values() if isinstance(t, torch.Tensor))
            for name, m in models.items()}
    ids = lm.tokenizer(prose(lm.tokenizer, 600), add_special_tokens=False)["input_ids"][:512]
    runners = {name: Runner(m, lm.tokenizer, lm.device) for name, m in models.items()}
    caches = {name: make_cache(m, 600) for name, m in models.items()}
    times = {f"{name} {what}": [] for name in models for what in ("prefill", "decode")}
    logits, tokens = {}, {}
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for name, runner in runners.items():
            cache = caches[name]
            cache.truncate(0)
            t = time.perf_counter()
            logits[name] = runner.prefill(ids, cache)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            runner.forward([ids[-1]], cache)
            decode = time.perf_counter() - t
            if rep:
                times[f"{name} prefill"].append(prefill)
                times[f"{name} decode"].append(decode)
            if rep == args.reps:
                cache.truncate(len(ids))
                tokens[name] = [t for t, _ in runner.decode(cache, logits[name], 32)]
    print(f"{lm.name}, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f}; medians of {args.reps}")
    for name in models:
        print(f"  {name}: linear weights + rest {size[name] / 2**20:,.0f} MiB; prefill 512 tokens "
              f"{512 / median(times[name + ' prefill']):.1f} tok/s; decode step at 512 "
              f"{median(times[name + ' decode']) * 1e3:.1f} ms")
    print(f"  int8 / fp32: prefill time {median(times['int8 prefill']) / median(times['fp32 prefill']):.2f}x, "
          f"decode step time {median(times['int8 decode']) / median(times['fp32 decode']):.2f}x")
    diff = (logits["int8"] - logits["fp32"]).abs().max().item()
    same = sum(a == b for a, b in zip(tokens["int8"], tokens["fp32"]))
    print(f"  next-token logits max |int8 - fp32| {diff:.3f} (argmax same: "
          f"{int(logits['int8'].argmax()) == int(logits['fp32'].argmax())}); greedy 32 tokens: first "
          f"{next((i for i, (a, b) in enumerate(zip(tokens['int8'], tokens['fp32'])) if a != b), same)} agree")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
