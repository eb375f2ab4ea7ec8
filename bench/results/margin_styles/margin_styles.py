"""What the margin style costs: plain reading against WiM with free-form (abstractive) and extractive margins,
side by side on the speed benchmark's documents. `python -m bench.margin_styles [--quick] [--reps N] [--out DIR]`.

Unlike `bench.speed` (every margin decoded to its full length, so that reading *patterns* are compared), the
margins here end where they end: what is measured is what a reader waits for with each style. One process,
one model; the modes run interleaved and their order rotated each repetition, so a slow minute of a shared CPU
lands on every mode alike. Reported: wall time (median), prefill and decode tokens, decode tokens per margin,
margins that hit their token cap, and each WiM style's time as a ratio of plain reading's.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from bench.common import RESULTS, load_engine, machine, md_table, median, n_tokens, segment_tokens_for, write_results

# (name, Settings fields): the old default (free-form notes, YES/NO classifier), the two extractive designs.
STYLES = [("plain", dict(mode="llm")),
          ("wim-abstractive (llm classifier)", dict(mode="wim", margins="abstractive", classifier="llm")),
          ("wim-extractive (margin relevance)", dict(mode="wim", margins="extractive", classifier="margin")),
          ("wim-scored (margin relevance)", dict(mode="wim", margins="scored", classifier="margin"))]


def run_once(engine, text: str, query: str, settings) -> dict:
    reading = engine.open(text, settings)
    t = time.perf_counter()
    events = list(reading.read(query)) + list(reading.answer(query))
    seconds = time.perf_counter() - t
    margins = [e for e in events if e.kind == "margin"]
    stats = [e for e in events if e.kind == "stats"]
    answer = next(e for e in events if e.kind == "answer")
    return {"seconds": seconds, "prefill_tokens": sum(s.prefill_tokens for s in stats),
            "decode_tokens": sum(s.decode_tokens for s in stats),
            "margin_decode_tokens": stats[0].decode_tokens, "margins": len(margins),
            "margins_at_cap": sum(m.ending == "limit" for m in margins),
            "margins_looped": sum(m.ending == "repeat" for m in margins),
            "kept": sum(bool(m.relevant) for m in margins), "answer": answer.text, "answer_ending": answer.ending}


def main(argv=None) -> int:
    from engine import Settings
    from bench.speed import FOLLOWUP, QUERY, document  # noqa: F401  (the speed benchmark's document and question)
    parser = argparse.ArgumentParser(prog="python -m bench.margin_styles", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: one 600-token document, one repetition")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--sizes", default="4000,7200")
    parser.add_argument("--styles", default=None,
                        help="comma list of mode names' first words to run (plain, wim-abstractive, wim-extractive, "
                             "wim-scored); default all")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [600] if args.quick else [int(x) for x in args.sizes.split(",")]
    styles = [st for st in STYLES if args.styles is None or st[0].split()[0] in args.styles.split(",")]
    reps = 1 if args.quick else args.reps
    engine = load_engine()
    tok = engine.lm.tokenizer
    results: dict = {}
    started = time.perf_counter()
    for size in sizes:
        text = document(tok, size)
        base = Settings(segment_tokens=segment_tokens_for(text, tok, 4 if args.quick else 8),
                        margin_tokens=16 if args.quick else 64, answer_tokens=8 if args.quick else 32)
        runs: dict[str, list[dict]] = {name: [] for name, _ in styles}
        for rep in range(reps):
            order = styles[rep % len(styles):] + styles[:rep % len(styles)]
            for name, fields in order:
                runs[name].append(run_once(engine, text, QUERY, replace(base, **fields)))
                print(f"[{time.perf_counter() - started:6.0f} s] {size} tokens, {name}: "
                      f"{runs[name][-1]['seconds']:.1f} s", flush=True)
        results[size] = {"doc_tokens": n_tokens(tok, text), "runs": runs}
    rows = []
    for size, r in results.items():
        plain = median([x["seconds"] for x in r["runs"]["plain"]])
        for name, _ in styles:
            xs = r["runs"][name]
            wall = median([x["seconds"] for x in xs])
            margins = xs[0]["margins"]
            rows.append([f"{r['doc_tokens']:,}", name, f"{wall:.1f}", f"{wall / plain:.2f}x",
                         f"{xs[0]['prefill_tokens']:,} / {xs[0]['decode_tokens']:,}",
                         f"{xs[0]['margin_decode_tokens'] / margins:.1f}" if margins else "-",
                         f"{xs[0]['margins_at_cap']} / {xs[0]['margins_looped']}" if margins else "-",
                         f"{xs[0]['kept']} of {margins}" if margins else "-", xs[0]["answer_ending"],
                         xs[0]["answer"].replace("|", "/")[:60]])
    meta = machine() | {"model": engine.lm.name, "dtype": str(engine.lm.dtype), "reps": reps,
                        "wall_s": round(time.perf_counter() - started, 1)}
    table = md_table(["doc tokens", "mode", "wall s (median)", "/ plain", "prefill / decode tokens",
                      "decode tokens per margin", "margins at cap / looped", "margins kept", "answer ended",
                      "answer"], rows)
    md = (f"# Margin styles: {meta['model']}, {meta['dtype']}, medians of {reps}\n\n{table}\n\n"
          f"Machine: {meta.get('cpu', '')}; wall time {meta['wall_s']} s.\n")
    print(md)
    if args.out or not args.quick:
        write_results(args.out or RESULTS, "margin_styles", {"meta": meta, "results": results}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
