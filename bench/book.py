"""A whole book through the CLI, then a follow-up question, in one run: `python -m bench.book`.

Runs exactly what a user runs, `python -m engine read BOOK --query Q --follow-up F`, as a child process whose
progress bar, margins and answers go to this terminal, and asks it for its events (`--events`) to measure:
the first read (read + answer) against the follow-up answer (same process, same cache: the book is not read
again), tokens/s, windows, the child's peak RSS (from the kernel, `wait4`), and both answers.

    python -m bench.book                          # Pride and Prejudice, ~1.3 h on this 2-core CPU
    python -m bench.book --quick --out /tmp/book  # the first ~2,000 tokens in 256-token windows: a smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import BOOKS, RESULTS, ROOT, fmt_bytes, machine, md_table, write_results

BOOK = BOOKS / "pg1342.txt"
QUERY = "Who does Elizabeth Bennet marry?"
FOLLOW_UP = "What is the name of Elizabeth's eldest sister?"
TARGET = 0.10  # follow-up / first read: the project's target
QUICK_CHARS = 9_000
QUICK_ARGS = ["--context-limit", "1024", "--segment-tokens", "256", "--margin-tokens", "24", "--answer-tokens", "24"]


def run_cli(book: Path, query: str, follow_up: str, events: Path, extra: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit status) of one CLI run; its output goes straight to our stdout."""
    cmd = [sys.executable, "-m", "engine", "read", str(book), "--query", query, "--follow-up", follow_up,
           "--events", str(events), *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    started = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=ROOT)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - started, usage.ru_maxrss * 1024, child.returncode


def summarise(events: list[dict], wall: float, peak_rss: int, book: Path, query: str, follow_up: str,
              extra: list[str]) -> dict:
    stats = [e for e in events if e["event"] == "stats"]
    read = next(s for s in stats if s["phase"] == "read")
    first_answer, follow = [s for s in stats if s["phase"] == "answer"][:2]
    answers = [e for e in events if e["event"] == "answer"]
    segments = [e for e in events if e["event"] == "segment"]
    margins = [e for e in events if e["event"] == "margin"]
    first_read = read["seconds"] + first_answer["seconds"]
    text_tokens = sum(e["tokens"] for e in segments)
    return {
        "book": book.name, "args": extra, "query": query, "follow_up": follow_up,
        "segments": len(segments), "segments_total": segments[-1]["total"] if segments else 0,
        "windows": 1 + sum(e["event"] == "window" for e in events),
        "characters_covered": sum(e["char_span"][1] - e["char_span"][0] for e in segments),
        "margins": len(margins), "relevant": sum(bool(m["relevant"]) for m in margins),
        "read": read, "answer": first_answer, "follow_up_answer": follow,
        "first_read_seconds": round(first_read, 2), "follow_up_seconds": follow["seconds"],
        "ratio": round(follow["seconds"] / first_read, 5), "target": TARGET,
        "document_tokens": text_tokens, "document_tokens_per_s": round(text_tokens / read["seconds"], 2),
        "reading_tokens_per_s": round((read["prefill_tokens"] + read["decode_tokens"]) / read["seconds"], 2),
        "wall_seconds": round(wall, 1), "peak_rss_bytes": peak_rss,
        "answers": [{"query": a["query"], "text": a["text"], "margins_used": len(a["margins_used"])}
                    for a in answers],
        "notices": [e["text"] for e in events if e["event"] == "notice"],
    }


def one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown(r: dict, meta: dict) -> str:
    rows = [
        ["book", f"{r['book']}: {r['segments']} of {r['segments_total']} segments, {r['windows']} windows, "
                 f"{r['read']['prefill_tokens']:,} prefill + {r['read']['decode_tokens']:,} margin tokens"],
        ["first read (read + answer)", f"{r['first_read_seconds']:,.1f} s: {r['document_tokens']:,} tokens of text at "
                                       f"{r['document_tokens_per_s']:,.1f} tok/s; {r['reading_tokens_per_s']:,.1f} "
                                       "tok/s counting every token prefilled or decoded"],
        ["follow-up answer, same cache", f"{r['follow_up_seconds']:,.2f} s"],
        ["**follow-up / first read**", f"**{r['ratio']:.2%}** (target <= {TARGET:.0%}: "
                                       f"{'met' if r['ratio'] <= TARGET else 'missed'})"],
        ["peak RSS (whole process)", fmt_bytes(r["peak_rss_bytes"])],
        ["margins kept by the classifier", f"{r['relevant']} of {r['margins']}"],
    ] + [[f"answer: {a['query']}", f"\"{one_line(a['text'])}\" ({a['margins_used']} margins)"] for a in r["answers"]]
    return (f"# Whole book and follow-up (`python -m bench.book`)\n\n"
            f"`python -m engine read {r['book']} --query \"{r['query']}\" --follow-up \"{r['follow_up']}\""
            f"{' ' + ' '.join(r['args']) if r['args'] else ''}`, one run, {meta['cpu']}, {meta['cores']} cores, "
            f"torch {meta['torch']}.\n\n" + md_table(["", "measured"], rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.book", description=__doc__.split("\n")[0])
    parser.add_argument("--book", type=Path, default=BOOK)
    parser.add_argument("--query", default=QUERY)
    parser.add_argument("--follow-up", default=FOLLOW_UP)
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK_CHARS:,} characters, small windows")
    parser.add_argument("--out", type=Path, default=None, help=f"results folder (default {RESULTS})")
    parser.add_argument("cli_args", nargs="*", help="more arguments for the CLI, after --")
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick writes a smoke result: give --out (bench/results keeps the full run)")
    out = args.out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    book, extra = args.book, list(args.cli_args)
    if args.quick:
        book = out / f"quick_{args.book.name}"
        book.write_text(args.book.read_text(encoding="utf-8")[:QUICK_CHARS], encoding="utf-8")
        extra = QUICK_ARGS + extra
    events_path = out / "book_events.jsonl"
    wall, peak, code = run_cli(book, args.query, args.follow_up, events_path, extra)
    if code != 0:
        print(f"error: the CLI exited with {code}", file=sys.stderr)
        return 1
    events = [json.loads(line) for line in events_path.read_text(encoding="utf-8").splitlines()]
    result = summarise(events, wall, peak, book, args.query, args.follow_up, extra)
    meta = machine()
    md = markdown(result, meta)
    write_results(out, "book", {"meta": meta, "result": result}, md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
