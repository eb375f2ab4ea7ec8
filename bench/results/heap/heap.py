"""Memory across many readings in one process, with and without handing freed heap pages back:
`python -m bench.heap [--readings 8] [--tokens 3000] [--model embedded] [--quick]`.

A server reads document after document in one process. glibc serves large blocks from the heap once its mmap
threshold has risen, and a fragmented heap rarely shrinks, so RSS can grow with every reading although nothing
is kept. The engine calls `engine.model.release_freed_memory` (malloc_trim) at the end of each phase. Each side
runs in a child process of its own (a heap's history cannot be undone in one process), one after the other in
this run: the same documents, the same settings; the "without" side replaces the call with a no-op.
Prints a table and writes bench/results/heap.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from pathlib import Path

from bench.common import RESULTS, md_table, median, write_results

CHILD = r"""
import gc, json, sys, time
import engine.model, engine.wim
if not {trim}:
    engine.wim.release_freed_memory = lambda: None
from bench.common import load_engine, prose
from engine.wim import Settings

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

eng = load_engine(model={model!r})
loaded, after, seconds = rss_mib(), [], []
for i in range({readings}):
    text = prose(eng.lm.tokenizer, {tokens}, start_char=20000 * i)
    t = time.perf_counter()
    reading = eng.open(text, Settings(segment_tokens=400, margin_tokens=32, answer_tokens=16))
    for _ in reading.read("Who is Victor?"):
        pass
    for _ in reading.answer("Who is Victor?"):
        pass
    seconds.append(time.perf_counter() - t)
    del reading
    gc.collect()
    after.append(rss_mib())
print("RESULT " + json.dumps({{"loaded_mib": loaded, "rss_mib": after, "seconds": seconds}}))
"""


def run_side(trim: bool, args) -> dict:
    code = CHILD.format(trim=trim, model=args.model, readings=args.readings, tokens=args.tokens)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=RESULTS.parents[1], env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.heap", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--readings", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--quick", action="store_true", help="3 readings of ~800 tokens (the test suite's smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.readings, args.tokens = 3, 800
    sides = {"without malloc_trim": run_side(False, args), "with malloc_trim (the engine)": run_side(True, args)}
    rows = []
    for name, r in sides.items():
        growth = (r["rss_mib"][-1] - r["rss_mib"][0]) / max(1, len(r["rss_mib"]) - 1)
        rows.append({"side": name, "loaded_mib": round(r["loaded_mib"]), "first_mib": round(r["rss_mib"][0]),
                     "last_mib": round(r["rss_mib"][-1]), "growth_mib_per_reading": round(growth, 1),
                     "median_s": round(median(r["seconds"]), 2), "rss_mib": [round(x) for x in r["rss_mib"]]})
    without, with_ = rows
    ratios = {"last_rss": round(with_["last_mib"] / without["last_mib"], 2),
              "median_s": round(with_["median_s"] / without["median_s"], 2)}
    md = [f"# Memory across {args.readings} readings in one process ({args.model}, ~{args.tokens} tokens each)", "",
          md_table(["side", "RSS after load MiB", "after reading 1", "after the last", "growth per reading MiB",
                    "median s per reading"],
                   [[r["side"], f"{r['loaded_mib']:,}", f"{r['first_mib']:,}", f"{r['last_mib']:,}",
                     r["growth_mib_per_reading"], r["median_s"]] for r in rows]),
          "", f"with / without: last RSS {ratios['last_rss']}x, median seconds per reading {ratios['median_s']}x"]
    markdown = "\n".join(md) + "\n"
    print(markdown)
    write_results(Path(args.out), "heap", {"args": vars(args), "rows": rows, "ratios": ratios}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
