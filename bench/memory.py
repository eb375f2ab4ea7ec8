"""`python -m bench.memory`: peak resident memory of a whole reading (load, read, answer) with the default model, in
a process of its own.

Each peak is set against what the reading must hold: the weights, the 4-bit decode packs and the KV cache of the
tokens read. Results: bench/results/memory.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import RESULTS, ROOT, SHARED, cpu_name, md_table, peak_rss_bytes, write_results

SIDES = ("converted in the engine's dtype",)  # the one way the engine loads its weights


def child(spec: str, path: str) -> dict:
    """One reading of a BABILong-form file, the way `python -m engine read` does it; its figures."""
    from engine import Answer, Engine, Settings
    from engine.model import dtype_name
    from bench.baselines import kv_bytes_per_token

    case = json.loads(Path(path).read_text())
    engine = Engine.load(spec)
    model = engine.lm.model
    from engine.packed import weights as packed_weights
    weights = packed_weights(model)[1]
    packs = (engine.lm.packs or {}).get("bytes", 0)
    reading = engine.open(case["context"], Settings())
    most = 0
    for event in reading.read(case["query"]):
        most = max(most, reading.cache.length)
    answer = [e for e in reading.answer(case["query"]) if isinstance(e, Answer)][0]
    most = max(most, reading.doc_end + reading.settings.answer_tokens)
    kv = most * kv_bytes_per_token(model)
    return {"model": engine.lm.name, "dtype": dtype_name(engine.lm.dtype), "weights_mib": weights / 2**20,
            "packs_mib": packs / 2**20, "kv_mib": kv / 2**20, "kv_tokens": most, "peak_rss_mib": peak_rss_bytes() / 2**20,
            "answer": answer.text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the engine's default model")
    parser.add_argument("--file", default=str(SHARED / "babilong" / "babilong_8k.json"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from engine.model import default_model
    spec = args.model or default_model()
    if args.child:
        print(json.dumps(child(spec, args.file)))
        return 0
    rows = []
    for label in SIDES:
        cmd = [sys.executable, "-m", "bench.memory", "--child", "--model", spec, "--file", args.file]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            raise SystemExit(f"{label} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1]) | {"side": label}
        row["needed_mib"] = row["weights_mib"] + row["packs_mib"] + row["kv_mib"]
        row["ratio"] = row["peak_rss_mib"] / row["needed_mib"]
        rows.append(row)
        print(f"{label}: peak {row['peak_rss_mib']:,.0f} MiB, {row['ratio']:.2f}x of weights + packs + KV "
              f"({row['needed_mib']:,.0f} MiB)", flush=True)
    meta = {"cpu": cpu_name(), "file": Path(args.file).name, "model": rows[0]["model"], "dtype": rows[0]["dtype"]}
    table = [[r["side"], f"{r['weights_mib']:,.0f}", f"{r['packs_mib']:,.0f}", f"{r['kv_mib']:,.0f}",
              f"{r['peak_rss_mib']:,.0f}", f"{r['ratio']:.2f}x"] for r in rows]
    md = "\n".join(["# Peak memory of a reading\n",
                    f"{meta['model']}, {meta['dtype']}, `{meta['file']}` read and answered (default settings), "
                    f"one process per row; CPU: {meta['cpu']}.\n",
                    md_table(["weights loaded", "weights MiB", "decode packs MiB", "KV MiB", "peak RSS MiB",
                              "peak / (weights + packs + KV)"], table), ""])
    paths = write_results(args.out, "memory", {"meta": meta, "rows": rows}, md)
    print(md)
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
