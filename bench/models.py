"""`python -m bench.models`: the two models, loaded from their GGUF file as transformers does it vs from the
converted fp32 safetensors cache, side by side: load time, resident memory, prefill and decode tokens/s.

Why: transformers 5 can keep some GGUF weights packed (GgufHfQuantizer, GgufLinear), which would save memory.
This measures what actually happens on this CPU for SmolLM2-135M (Q4_1, llama) and Qwen2.5-Coder-1.5B
(Q4_K_M, qwen2): how many linear layers stay packed, what the weights' dtype is, and what each way costs.

Each (model, source) runs in its own process, so its peak RSS is its own; the rows of one model run one after
the other, in rotated order across repeats. The CPU may be shared: compare ratios within a model, not seconds.
Results: bench/results/models.{json,md}; the app's model picker shows the measured speeds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, peak_rss_bytes, prose, rss_bytes

MODELS = ("embedded", "qwen2.5-1.5b")
# from_pretrained(gguf_file=...) each time (transformers picks the dtype), or the folder convert_gguf wrote once,
# in fp32 and in bf16 (what the engine picks on a CPU with bf16 matrix units).
SOURCES = ("gguf", "cache-fp32", "cache-bf16")


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process, MiB (the kernel's figures)."""
    return rss_bytes() / 2**20, peak_rss_bytes() / 2**20


def _gguf_of(spec: str) -> Path:
    from engine import model as models
    return models.embedded_gguf() if spec == "embedded" else models.assemble_qwen()


def child(spec: str, source: str, prefill: int, decode: int) -> dict:
    """Load one model one way, then time one prefill of `prefill` tokens and `decode` greedy decode steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from engine import model as models
    from engine.cache import cache_keyword

    base_rss, _ = _rss_mib()
    start = time.perf_counter()
    if source == "gguf":
        gguf = _gguf_of(spec)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    else:
        folder = models.resolve(spec)[0]
        tokenizer = AutoTokenizer.from_pretrained(folder)
        dtype = torch.bfloat16 if source == "cache-bf16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - start
    loaded_rss, loaded_peak = _rss_mib()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "GgufLinear"]
    packed = sum(type(m).__name__ == "GgufLinear" for m in linears)
    dtypes = sorted({models.dtype_name(p.dtype) for p in model.parameters()})
    from engine.packed import weights as packed_weights
    weight_bytes = packed_weights(model)[1]

    ids = tokenizer(prose(tokenizer, prefill + 64), add_special_tokens=False, return_tensors="pt")["input_ids"]
    ids = ids[:, :prefill]
    with torch.inference_mode():
        past = {cache_keyword(model): DynamicCache(config=model.config)}  # filled in place by each pass
        t = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1, **past)
        prefill_s = time.perf_counter() - t
        token = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(decode):
            out = model(token, use_cache=True, **past)
            token = out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t
    _, peak = _rss_mib()
    return {"model": spec, "source": source, "load_s": load_s, "rss_after_load_mib": loaded_rss - base_rss,
            "peak_during_load_mib": loaded_peak - base_rss, "peak_rss_mib": peak,
            "weights_mib": weight_bytes / 2**20, "linear_layers": len(linears), "packed_linear_layers": packed,
            "parameter_dtypes": dtypes, "prefill_tokens": int(ids.shape[1]), "prefill_tps": ids.shape[1] / prefill_s,
            "decode_tokens": decode, "decode_tps": decode / decode_s, "threads": torch.get_num_threads()}


def run_child(spec: str, source: str, prefill: int, decode: int) -> dict:
    cmd = [sys.executable, "-m", "bench.models", "--child", spec, source, "--prefill", str(prefill),
           "--decode", str(decode)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{spec}/{source} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


LABELS = {"gguf": "GGUF file", "cache-fp32": "converted cache, fp32", "cache-bf16": "converted cache, bf16"}


def report(rows: list[dict], meta: dict) -> str:
    lines = [f"# Models: GGUF load vs converted cache ({meta['when']})", "",
             f"{meta['cpu']}, {meta['threads']} threads; CPU load average {meta['load_before']} before, "
             f"{meta['load_after']} after (shared machine: compare within a model). Medians of {meta['repeats']} "
             f"run(s) each; prefill {meta['prefill']} tokens, decode {meta['decode']} greedy steps after it.", "",
             "| model | loaded from | load s | RSS after load MiB | peak while loading MiB | peak after decoding MiB "
             "| weights MiB | packed linears | weight dtype | prefill tok/s | decode tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for spec in MODELS:
        for source in SOURCES:
            runs = [r for r in rows if r["model"] == spec and r["source"] == source]
            if not runs:
                continue
            med = {k: statistics.median(r[k] for r in runs) for k in
                   ("load_s", "rss_after_load_mib", "peak_during_load_mib", "peak_rss_mib", "weights_mib",
                    "prefill_tps", "decode_tps")}
            r = runs[0]
            lines.append(f"| {spec} | {LABELS[source]} | {med['load_s']:.1f} | "
                         f"{med['rss_after_load_mib']:,.0f} | {med['peak_during_load_mib']:,.0f} | {med['peak_rss_mib']:,.0f} | "
                         f"{med['weights_mib']:,.0f} | {r['packed_linear_layers']} of {r['linear_layers']} | "
                         f"{'/'.join(r['parameter_dtypes'])} | {med['prefill_tps']:,.1f} | {med['decode_tps']:,.2f} |")
    lines.append("")
    m = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    for spec in MODELS:
        by = {src: [r for r in rows if r["model"] == spec and r["source"] == src] for src in SOURCES}
        if by["gguf"] and by["cache-fp32"]:
            g, c = by["gguf"], by["cache-fp32"]
            lines.append(f"- {spec}: GGUF / fp32 cache: load time {m(g, 'load_s') / m(c, 'load_s'):.1f}x, "
                         f"peak RSS {m(g, 'peak_rss_mib') / m(c, 'peak_rss_mib'):.2f}x, "
                         f"prefill {m(g, 'prefill_tps') / m(c, 'prefill_tps'):.2f}x, "
                         f"decode {m(g, 'decode_tps') / m(c, 'decode_tps'):.2f}x.")
        if by["cache-bf16"] and by["cache-fp32"]:
            b, c = by["cache-bf16"], by["cache-fp32"]
            lines.append(f"- {spec}: bf16 / fp32 (both from the cache): peak RSS "
                         f"{m(b, 'peak_rss_mib') / m(c, 'peak_rss_mib'):.2f}x, prefill "
                         f"{m(b, 'prefill_tps') / m(c, 'prefill_tps'):.2f}x, decode "
                         f"{m(b, 'decode_tps') / m(c, 'decode_tps'):.2f}x.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n")[0])
    p.add_argument("--child", nargs=2, metavar=("MODEL", "SOURCE"), help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.prefill, args.decode)))
        return 0
    import platform

    import torch
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": platform.processor() or
            platform.machine(), "threads": torch.get_num_threads(), "repeats": args.repeats,
            "prefill": args.prefill, "decode": args.decode, "load_before": round(os.getloadavg()[0], 1)}
    rows = []
    for rep in range(args.repeats):
        for spec in args.models:
            order = SOURCES[rep % len(SOURCES):] + SOURCES[:rep % len(SOURCES)]
            for source in order:
                row = run_child(spec, source, args.prefill, args.decode)
                print(json.dumps(row), flush=True)
                rows.append(row)
    meta["load_after"] = round(os.getloadavg()[0], 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "models.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n")
    (args.out / "models.md").write_text(report(rows, meta))
    print(report(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
