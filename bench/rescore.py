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
from collections import Counter, defaultdict
from pathlib import Path

from .eval import markdown, score, summarise
from .tasks import KINDS, Case, make_case

Records = dict[str, dict[str, dict]]  # case key -> mode (or candidate) -> record


def eval_folder(folder: Path) -> tuple[dict, dict[str, Case], Records]:
    """A bench.eval folder's meta, cases and records, from its eval.json."""
    data = json.loads((folder / "eval.json").read_text())
    cases, records = {}, {}
    for c in data["cases"]:
        index = int(c["case"].rsplit("/", 1)[1])
        cases[c["case"]] = Case(c["task"], c["length"], index, "", c["query"], c["answers"],
                                kind=KINDS.get(c["task"], "short"), info=c.get("info") or {})
        records[c["case"]] = {mode: r for mode, r in c["records"].items() if "prediction" in r}
    return data["meta"], cases, records


def prompts_folder(folder: Path, seed: int, tokenizer) -> tuple[dict[str, Case], Records]:
    """A bench.answer_prompts folder's records (case key -> candidate -> record), its cases made again."""
    records: Records = defaultdict(dict)
    for line in (folder / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        records[r["case"]][r["candidate"]] = r
    cases = {}
    for key in records:
        task, length, index = key.split("/")
        cases[key] = make_case(task, int(length), int(index), tokenizer, seed)
    return cases, dict(records)


def rescored(cases: dict[str, Case], records: Records) -> Records:
    """The records with today's score in place of the recorded one."""
    return {key: {mode: {**r, **score(cases[key], r["prediction"])} for mode, r in by_mode.items()}
            for key, by_mode in records.items()}


def modes_of(records: Records) -> list[str]:
    return list(dict.fromkeys(m for by_mode in records.values() for m in by_mode))


def table(name: str, cases: dict[str, Case], records: Records) -> str:
    """Per task and mode, as bench.eval summarises them (its "all": the answerable cases every mode answered):
    cases, the recorded mean score, today's, and how many answers' scores changed (per task)."""
    modes, now = modes_of(records), rescored(cases, records)
    before = {(r["task"], r["length"], r["mode"]): r for r in summarise(list(cases.values()), records, modes)}
    changed = Counter((cases[key].task, mode) for key, by_mode in records.items() for mode, r in by_mode.items()
                      if abs(r["score"] - now[key][mode]["score"]) > 1e-9)
    lines = [f"### {name}", "", "| task | mode | n | recorded | rescored | changed |", "|---|---|---|---|---|---|"]
    for row in summarise(list(cases.values()), now, modes):
        if not row["n"]:
            continue
        task, mode = row["task"], row["mode"]
        moved = "" if task == "all" else changed[(task, mode)]  # the task rows say which changed
        lines.append(f"| {task} | {mode} | {row['n']} | {before[(task, row['length'], mode)]['score']:.3f} | "
                     f"{row['score']:.3f} | {moved} |")
    return "\n".join(lines)


def rescored_markdown(meta: dict, cases: dict[str, Case], records: Records) -> str:
    """The folder's eval.md table made again from its records scored by today's scorer."""
    modes = [m for m in meta["modes"] if any(m in by_mode for by_mode in records.values())]
    return markdown(meta, summarise(list(cases.values()), rescored(cases, records), modes), modes)


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
            meta, cases, records = eval_folder(folder)
            if args.write:
                (folder / "rescored.md").write_text(
                    f"Rescored by `python -m bench.rescore --write {folder}`: the records of eval.md, scored by "
                    f"today's scorer.\n\n" + rescored_markdown(meta, cases, records))
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
