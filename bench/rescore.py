"""Recorded answers scored again by today's scorer (`bench.eval.score`), beside the scores they were recorded with.

    python -m bench.rescore bench/results/eval-16k-opening [more folders]
    python -m bench.rescore --write bench/results/eval-16k-opening
    python -m bench.rescore --seed 1 bench/results/answer_prompts-16k-seed1-n6/babilong-multihop

A `bench.eval` folder's eval.json holds its cases and their records; `--write` adds rescored.md beside them, the
folder's eval.md table under today's scorer (eval.md and the records stay as they were made). A
`bench.answer_prompts` folder keeps only its records (records.jsonl): its cases are made again from (task, length,
index) and `--seed`, with `--model`'s tokenizer. Nothing is read or answered again.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from .eval import markdown, score, summarise
from .tasks import Case, make_case


def eval_folder(folder: Path) -> tuple[dict[str, Case], dict[str, dict[str, dict]]]:
    """A bench.eval folder's cases and its records (case key -> mode -> record), from its eval.json."""
    data = json.loads((folder / "eval.json").read_text())
    cases, records = {}, {}
    for c in data["cases"]:
        index = int(c["case"].rsplit("/", 1)[1])
        cases[c["case"]] = Case(c["task"], c["length"], index, "", c["query"], c["answers"],
                                kind=_kind(c["task"]), info=c.get("info") or {})
        records[c["case"]] = {mode: r for mode, r in c["records"].items() if "prediction" in r}
    return cases, records


def prompts_folder(folder: Path, seed: int, tokenizer) -> tuple[dict[str, Case], dict[str, dict[str, dict]]]:
    """A bench.answer_prompts folder's records (case key -> candidate -> record), its cases made again."""
    records: dict[str, dict[str, dict]] = defaultdict(dict)
    for line in (folder / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        records[r["case"]][r["candidate"]] = r
    cases = {}
    for key in records:
        task, length, index = key.split("/")
        cases[key] = make_case(task, int(length), int(index), tokenizer, seed)
    return cases, dict(records)


def _kind(task: str) -> str:
    return {"aggregation": "list", "unanswerable": "unanswerable"}.get(task, "short")


def table(name: str, cases: dict[str, Case], records: dict[str, dict[str, dict]]) -> str:
    """Per task and mode: cases, the recorded mean score and today's; then all answerable cases every mode
    answered."""
    modes = list(dict.fromkeys(m for by_mode in records.values() for m in by_mode))
    tasks = list(dict.fromkeys(c.task for c in cases.values()))
    lines = [f"### {name}", "", "| task | mode | n | recorded | rescored | changed |", "|---|---|---|---|---|---|"]
    for task in [*tasks, "all"]:
        keys = [k for k, c in cases.items() if (c.task == task if task != "all" else c.kind != "unanswerable")]
        if task == "all":
            keys = [k for k in keys if all(m in records.get(k, {}) for m in modes)]
        for mode in modes:
            got = [(cases[k], records[k][mode]) for k in keys if mode in records.get(k, {})]
            if not got:
                continue
            before = [r["score"] for _, r in got]
            after = [score(c, r["prediction"])["score"] for c, r in got]
            changed = sum(abs(a - b) > 1e-9 for a, b in zip(before, after))
            lines.append(f"| {task} | {mode} | {len(got)} | {sum(before) / len(got):.3f} | "
                         f"{sum(after) / len(got):.3f} | {changed} |")
    return "\n".join(lines)


def rescored_markdown(folder: Path, cases: dict[str, Case], records: dict[str, dict[str, dict]]) -> str:
    """The folder's eval.md table made again from its records scored by today's scorer."""
    meta = json.loads((folder / "eval.json").read_text())["meta"]
    modes = [m for m in meta["modes"] if any(m in by_mode for by_mode in records.values())]
    now = {key: {mode: {**r, **score(cases[key], r["prediction"])} for mode, r in by_mode.items()}
           for key, by_mode in records.items()}
    return markdown(meta, summarise(list(cases.values()), now, modes), modes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rescore", description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--seed", type=int, default=None, help="the seed of answer_prompts folders (required there)")
    parser.add_argument("--model", default="qwen2.5-1.5b", help="whose tokenizer made the answer_prompts cases")
    parser.add_argument("--write", action="store_true", help="write rescored.md into each bench.eval folder")
    args = parser.parse_args(argv)
    tokenizer = None
    for folder in args.folders:
        if (folder / "eval.json").exists():
            cases, records = eval_folder(folder)
            if args.write:
                (folder / "rescored.md").write_text(
                    f"Rescored by `python -m bench.rescore --write {folder}`: the records of eval.md, scored by "
                    f"today's scorer.\n\n" + rescored_markdown(folder, cases, records))
        elif (folder / "records.jsonl").exists():
            if args.seed is None:
                parser.error(f"{folder} is an answer_prompts folder: give its --seed")
            if tokenizer is None:
                from transformers import AutoTokenizer
                from engine.model import resolve
                tokenizer = AutoTokenizer.from_pretrained(resolve(args.model)[0])
            cases, records = prompts_folder(folder, args.seed, tokenizer)
        else:
            parser.error(f"{folder}: neither eval.json nor records.jsonl")
        print(table(str(folder), cases, records), end="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
