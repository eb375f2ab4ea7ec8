"""`python -m bench.answer_choice`: would choosing, inside one window, between WiM's answer and plain reading's
answer (both from one read's cache) by the model's own likelihood give better answers than WiM's alone?

Takes bench.answer_prompts' records and kept reads (`--reads`), scores each case's two answers (their words, the
citations left out, then the end of the turn) under each prompt (WiM's: the document, the kept notes, the
question; plain reading's: the document and the question) as the mean log-probability of their tokens, and scores
three ways of choosing:
- by the notes: the answer likelier under WiM's prompt;
- by its own prompt: WiM's answer under WiM's prompt against plain reading's under its own;
- by both: the answer likelier under both prompts together (the sum of its two means).
An answer's likelihood costs a prefill of the prompt and a pass per answer token, after the kept document.
Records in --out (one line per case, so a rerun skips what is done); the summary prints per rule.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine.attribution import without_citations

from .common import load_engine
from .eval import add_read_options, evaluator_for, generate_cases

RULES = {
    "by the notes": lambda s: s["wim|wim"] >= s["plain|wim"],
    "by its own prompt": lambda s: s["wim|wim"] >= s["plain|plain"],
    "by both": lambda s: s["wim|wim"] + s["wim|plain"] >= s["plain|wim"] + s["plain|plain"],
}


def mean_logprob(reading, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """The mean log-probability of `answer_ids` after the reading's document and `prompt_ids`; the cache is left
    as it was."""
    end = reading.cache.length
    total = 0.0
    try:
        with reading.engine.lock:
            logits = reading.runner.prefill(prompt_ids, reading.cache)
            for token in answer_ids:
                total += float(torch.log_softmax(logits.float(), -1)[token])
                logits = reading.runner.prefill([token], reading.cache)
    finally:
        reading.cache.truncate(end)
    return total / len(answer_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.answer_choice", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--records", type=Path, nargs="+", required=True, help="bench.answer_prompts records.jsonl")
    parser.add_argument("--reads", type=Path, required=True, help="the reads those runs kept")
    parser.add_argument("--candidate", default="list+emb-or-rel", help="the WiM answer to weigh against plain's")
    parser.add_argument("--task", "--tasks", dest="tasks", default="babilong,multihop,aggregation,hotpotqa")
    parser.add_argument("--length", type=int, default=16000)
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    add_read_options(parser)  # as the answer_prompts runs read: their defaults unless told
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    records = {}
    for path in args.records:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            records[(r["case"], r["candidate"])] = r
    engine = load_engine(None, None, args.model)
    tok = engine.lm.tokenizer
    cases = generate_cases(tok, args.tasks.split(","), [args.length], argparse.Namespace(
        n=args.n, seed=args.seed, quick=False))
    evaluator = evaluator_for(engine, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if args.out.exists():
        done = {r["case"]: r for r in map(json.loads, args.out.read_text().splitlines())}
    for case in cases:
        wim, plain = records.get((case.key, args.candidate)), records.get((case.key, "plain"))
        if case.key in done or wim is None or plain is None:
            continue
        reading = engine.open(case.text, evaluator.settings(case, "wim"))
        turn_end = reading.layout.encode(reading.layout.turn_end)[0]  # the chat template's end of a turn
        if reading.multiwindow or not reading.restore(args.reads / case.key.replace("/", "-")):
            print(f"{case.key}: no kept read inside one window; left out", flush=True)
            continue
        notes = {i: reading.margins[i].text for i in wim["kept"]}
        prompts = {"wim": reading.answering.notes_prompt(case.query, notes)[0],
                   "plain": reading.layout.suffix("answer_plain", query=case.query)}
        answers = {"wim": without_citations(wim["prediction"]).strip(), "plain": plain["prediction"].strip()}
        scores = {}
        for answer, text in answers.items():
            ids = tok.encode(text, add_special_tokens=False) + [turn_end]
            for name, ids_before in prompts.items():
                scores[f"{answer}|{name}"] = mean_logprob(reading, ids_before, ids)
        rec = {"case": case.key, "task": case.task, "score": {"wim": wim["score"], "plain": plain["score"]},
               "answers": answers, "kept": wim["kept"], "mean_logprob": scores,
               "chosen": {rule: "wim" if pick(scores) else "plain" for rule, pick in RULES.items()}}
        done[case.key] = rec
        with args.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        print(case.key, rec["score"], {k: round(v, 3) for k, v in scores.items()}, flush=True)
    summary(list(done.values()))
    return 0


def summary(recs: list[dict]) -> None:
    if not recs:
        return
    n = len(recs)
    print(f"{n} cases: wim {sum(r['score']['wim'] for r in recs) / n:.3f}, "
          f"plain {sum(r['score']['plain'] for r in recs) / n:.3f}")
    for rule in RULES:
        chosen = [r["score"][r["chosen"][rule]] for r in recs]
        swapped = sum(r["chosen"][rule] == "plain" and r["answers"]["wim"] != r["answers"]["plain"] for r in recs)
        print(f"  chosen {rule}: {sum(chosen) / n:.3f} (plain's answer taken on {swapped} cases where they differ)")


if __name__ == "__main__":
    sys.exit(main())
