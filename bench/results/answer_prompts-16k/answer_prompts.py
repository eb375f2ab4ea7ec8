"""`python -m bench.answer_prompts`: the answer prompt's framing chosen by measurement. Each case is read once
(WiM, default settings); every candidate prompt then answers from the same cache (an answer never changes the
document's cache), and plain reading's answer too. Tune on a seed other than the reported one (default 1).

Candidates (their texts below; the engine's answer prompt, engine/prompts/answer.txt, is the one chosen; every
answer that cites nothing itself is cited afterwards by the notes that hold its words). The notes are given in
reading order, each tagged with its segment and page ("- [segment 3, page 2] ..."), in every candidate:
- list:        the notes as a list after the document, "answer in a few words" (the engine's default; its
               citations are written after it from the notes' words, engine/attribution.py);
- margins:     the paper's framing (notes written in the margin while reading part by part), cite the notes
               used, say when the document does not say;
- margins-plain: the paper's framing, "answer in a few words" (cited afterwards, as `list`);
- margins-unsure: the paper's framing, and say when the document does not say (no citation instruction);
- list-cite:   the list, and cite the notes after the answer (the default before: at 16,000 tokens the 1.5B
               cited the instruction's example and answered with the note it cited);
- list-unsure: the list, and say so when neither the document nor the notes answer;
- question-first: the question, then the notes as copied from the document, then "answer from the notes where
               they answer it";
- list-cite-after: the list, the answer's own words first and the citations after them ("... [segment 3]");
- question-twice: the question before the notes and again after them, citations as in list-cite-after;
- list-sources: the list, the answer, then "Sources:" and its citations on a line of their own;
- question-first-sources: the question, then the copied notes, the answer and a "Sources:" line.
- list-later:  the list, said to be in the order of the text, and "where notes disagree, the later one is the
               more recent" (at 16k the 1.5B answered "where is X" from the first of several notes on X's moves).
- list-reason: the list, then a sentence or two on what the notes and the document say, in the order of the
               text, before "Answer:" and the answer (engine/prompts/answer_reasoned.txt, Settings.reasoning_tokens;
               scored: the text after "Answer:", Answer.reasoning holds the rest).
- plain-reason: plain reading (the document and the question, no note) asked to reason the same way.
Each prompt answers from the notes of one selection (`--candidates PROMPT+SELECTION`): `margin`, the engine's
default (every note that did not say NONE), `emb-or-rel`: the engine's `combined` classifier (a note MiniLM judges
relevant, or one whose own relevance score is at least 0.7), `embedding`: MiniLM's verdict alone, or `reader`: the
notes on the case's gold segments (what a careful reader would keep). Past the window a candidate may end in
`@lookup` (the kept notes' passages re-read into the answer window, Settings.answer_style) or `@notes` (the last
window and the notes); `@passages`, inside one window too, answers from the kept notes' passages re-read into a
fresh window (the rest of the document left out), `@recall`, inside one window, from the whole document with the
kept notes' passages re-read after it; without any, the engine's default style. `margins-only` answers
from the selected notes alone, without the document (bench/baselines.py), and `plain` from the document alone
(inside one window).

Per candidate: the mean score, the rate of citations on answers where a note was kept, the "not stated" rate on
answerable and on unanswerable cases, and answers cut at their token limit. Records in --out, one line per
(case, candidate), so a rerun skips what is done.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from engine.answering import ANSWER_STYLES as STYLES, says_not_stated
from engine.prompts import prompt

from bench.common import RESULTS, cpu_name, load_engine, md_table, write_results
from bench.eval import add_read_options, evaluator_for, fingerprint, generate_cases, score

_LIST = ("\n\nWhile reading, these notes were written in the margins:\n{margins}\n\n"
         "Using the document and the notes, answer the question: {query}\n")
# The paper's framing: notes written in the margin while reading part by part (margins-plain, margins-unsure).
_MARGINS = ("\n\nWhile reading the document part by part, you wrote these notes in the margin, in reading order, "
            "each tagged with the part it comes from:\n{margins}\n\nUsing the document and your notes, answer the "
            "question: {query}\n")
# The answer's words first, each citation after them (list-cite-after and question-twice).
_CITE_AFTER = "Answer in a few words: first the answer itself, then the notes it comes from in brackets, like " \
              "\"... [segment 3]\"."
# The answer, then its citations on a line of their own (list-sources, question-first-sources).
_SOURCES = "Answer in a few words. Then, on a new line, write \"Sources:\" and the notes the answer comes from, " \
           "like [segment 3]."
# The notes said to be in the order of the text, and a later note to outdate an earlier one (list-later,
# list-one-later).
_IN_ORDER = ("\n\nWhile reading, these notes were written in the margins, in the order of the text:\n{margins}\n\n"
             "Using the document and the notes, answer the question: {query}\n")
_LATER = "Where notes disagree, the later one is the more recent."
CANDIDATES = {
    "list": _LIST + "Answer in a few words.",
    "margins": "\n\nWhile reading the document part by part, you wrote these notes in the margin, in reading order, "
               "each tagged with the part it comes from:\n{margins}\n\nUsing the document and your notes, answer the "
               "question: {query}\nAnswer in a few words, and cite the notes you used, like [segment 3]. If the "
               "document does not say, answer \"The document does not say.\"",
    "margins-plain": _MARGINS + "Answer in a few words.",
    "margins-unsure": _MARGINS + "Answer in a few words. If the document does not say, answer \"The document "
                                 "does not say.\"",
    "list-cite": _LIST + "Answer in a few words. After the answer, cite the notes it comes from, like [segment 3].",
    "list-unsure": _LIST + "Answer in a few words. If neither the document nor the notes answer the question, say "
                           "\"The document does not say.\"",
    "question-first": "\n\nQuestion: {query}\n\nWhile reading, these sentences were copied from the document into the "
                      "margins, in reading order:\n{margins}\n\nAnswer the question in a few words. Where the notes "
                      "answer it, answer from them, and cite the notes you used, like [segment 3].",
    # The answer's words first, each citation after the fact it supports: asked to cite "after the answer", a
    # list answer at 16k came out as a list of citations.
    "list-cite-after": _LIST + _CITE_AFTER,
    # The question before the notes as well as after them (the answer window keeps document, notes, question).
    "question-twice": "\n\nQuestion: {query}\n\nWhile reading, these notes were written in the margins, in reading "
                      "order:\n{margins}\n\nUsing the document and the notes, answer the question: {query}\n"
                      + _CITE_AFTER,
    # The citations on a line of their own after the answer, so a list answer's items are not replaced by them.
    "list-sources": _LIST + _SOURCES,
    "question-first-sources": "\n\nQuestion: {query}\n\nWhile reading, these sentences were copied from the "
                              "document into the margins, in reading order:\n{margins}\n\nAnswer the question from "
                              "the document and the notes. " + _SOURCES,
    "list-later": _IN_ORDER + "Answer in a few words. " + _LATER,
    # One answer, not the notes' facts strung together ("Daniel went to the bedroom and the garden" for where
    # Daniel is): BABILong's own check counts an answer naming two places wrong.
    "list-one": _LIST + "Answer in a few words, with one answer.",
    "list-one-later": _IN_ORDER + "Answer in a few words, with one answer. " + _LATER,
    "list-reason": prompt("answer_reasoned"),  # Settings.reasoning_tokens' prompt
    # Plain reading asked to reason the same way (the document and the question, no note): what the reasoning is
    # worth without the margins. answer_reasoned's own instruction, said of the document alone.
    "plain-reason": prompt("answer_plain").replace(
        "Answer in a few words.",
        prompt("answer_reasoned").rsplit("\n", 1)[1].replace("the notes and the document say", "the document says")),
}
SELECTIONS = ("margin", "emb-or-rel", "embedding", "reader")


def parse(name: str) -> tuple[str, str, str | None]:
    """(prompt, selection, style) of a candidate named PROMPT[+SELECTION][@STYLE]."""
    rest, _, style = name.partition("@")
    candidate, _, selection = rest.partition("+")
    return candidate, selection or "margin", style or None


def selections(reading, case, names: list[str]) -> dict[str, list[int]]:
    """Segment indexes of the notes each named selection keeps, from one reading's notes."""
    from engine.classify import Classifier, says_nothing
    from bench.eval import gold_segments
    query = case.query
    notes = {i: m for i, m in sorted(reading.margins.items()) if m.text and not says_nothing(m.text)}
    out = {}
    for name in names:
        if name == "margin":
            out[name] = list(notes)
        elif name == "emb-or-rel":  # the engine's `combined` classifier
            judge = Classifier("combined", reading.runner, reading.engine.layout, reading.settings.embedding_threshold)
            out[name] = [i for i, m in notes.items() if judge(query, m.text, relevance=m.score)[0]]
        elif name == "embedding":
            judge = Classifier("embedding", reading.runner, reading.engine.layout, reading.settings.embedding_threshold)
            out[name] = [i for i, m in notes.items() if judge(query, m.text)[0]]
        elif name == "reader":
            gold = set(gold_segments(case, reading))
            out[name] = [i for i in notes if i in gold]
        else:
            raise ValueError(f"unknown selection {name!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.answer_prompts", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--task", "--tasks", dest="tasks",
                        default="babilong,multihop,aggregation,hotpotqa,squad,unanswerable")
    parser.add_argument("--length", default="4000")
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--first", type=int, default=0, help="skip the cases whose index is below this (cases read "
                        "on another machine, whose records are kept apart)")
    parser.add_argument("--seed", type=int, default=1)
    add_read_options(parser)
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help="comma list of PROMPT[+SELECTION][@STYLE], PROMPT one of " + ", ".join(CANDIDATES)
                             + ", margins-only; SELECTION one of " + ", ".join(SELECTIONS) + " (default margin); "
                             "STYLE (lookup and notes: past the window; passages: inside it too; recall: inside "
                             "it) one of " + ", ".join(STYLES) + "; plain is always run")
    parser.add_argument("--answer-retries", type=int, default=None, metavar="N",
                        help="loops an answer may take back (default: the engine's Settings.answer_retries); 0: an "
                             "answer ends where it begins to loop, as before that setting")
    parser.add_argument("--reasoning-tokens", type=int, default=160,
                        help="room for a reasoning candidate's reasoning (list-reason, plain-reason; "
                             "Settings.reasoning_tokens); the other candidates answer at once")
    parser.add_argument("--out", type=Path, default=RESULTS / "answer_prompts")
    parser.add_argument("--reads", type=Path, default=None, metavar="DIR",
                        help="keep each case's read here (its cache and notes, engine/saved.py) and take it up "
                             "again on a later run, so new candidates answer without reading again (~0.5 GB "
                             "a 16k case)")
    args = parser.parse_args(argv)
    args.quick = False
    engine = load_engine(None, None, args.model)
    tok = engine.lm.tokenizer
    cases = [c for c in generate_cases(tok, args.tasks.split(","), [int(x) for x in args.length.split(",")], args)
             if c.index >= args.first]
    evaluator = evaluator_for(engine, args)  # its reads are kept by this script (--reads), not the Evaluator
    fp = fingerprint(engine, args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "records.jsonl"
    done = defaultdict(dict)
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["fingerprint"] == fp:
                done[r["case"]][r["candidate"]] = r
    from engine import Answer
    from bench.baselines import margins_only
    names = [*dict.fromkeys(c.replace("+margin", "") for c in args.candidates.split(",")), "plain"]
    unknown = [n for n in names[:-1] if parse(n)[0] not in (*CANDIDATES, "margins-only")
               or parse(n)[1] not in SELECTIONS or parse(n)[2] not in (None, *STYLES)]
    if unknown:
        parser.error(f"unknown candidate: {', '.join(unknown)}")
    chosen_selections = list(dict.fromkeys(parse(n)[1] for n in names[:-1]))
    for k, case in enumerate(cases):
        if all(n in done[case.key] for n in names):
            continue
        t = time.perf_counter()
        settings = evaluator.settings(case, "wim")
        settings = dataclasses.replace(settings, reasoning_tokens=args.reasoning_tokens)
        if args.answer_retries is not None:
            settings = dataclasses.replace(settings, answer_retries=args.answer_retries)
        reading = engine.open(case.text, settings)
        kept_read = args.reads / case.key.replace("/", "-") if args.reads else None
        if not (kept_read and reading.restore(kept_read)):
            list(reading.read(case.query))
            if kept_read:
                reading.save(kept_read)
        chosen = selections(reading, case, chosen_selections)
        with path.open("a", encoding="utf-8") as f:
            for name in names:
                if name in done[case.key]:
                    continue
                if name == "plain" and reading.multiwindow:
                    continue  # plain reading past the window reads on its own (bench.eval's llm)
                candidate, selection, style = parse(name)
                kept = chosen[selection] if name != "plain" and candidate != "plain-reason" else []
                started, reasoned = time.perf_counter(), None
                if candidate == "margins-only":
                    notes = {i: reading.margins[i].text for i in kept}
                    text, ending, citations = margins_only(engine, case.query, notes, case.answer_tokens), "", []
                    passages, retried = [], 0
                else:
                    events = list(reading.answer(case.query, plain=True) if name == "plain"
                                  else reading.answer(case.query, margins=kept, template=CANDIDATES[candidate],
                                                      style=style))
                    answer = next(e for e in events if isinstance(e, Answer))
                    text, ending, citations = answer.text, answer.ending, answer.citations
                    reasoned = answer.reasoning or None
                    passages, retried = answer.passages, answer.retried
                rec = {"case": case.key, "task": case.task, "kind": case.kind, "candidate": name,
                       "prediction": text, "reasoning": reasoned, "ending": ending, "retried": retried,
                       "answer_retries": settings.answer_retries, "citations": citations, "seconds":
                       time.perf_counter() - started, "kept": kept, "passages": passages, "not_stated": says_not_stated(text),
                       "fingerprint": fp, **score(case, text)}
                done[case.key][name] = rec
                f.write(json.dumps(rec) + "\n")
        summary(engine, args, cases, done, names)
        print(f"{k + 1}/{len(cases)} {case.key} ({time.perf_counter() - t:.0f} s) " +
              " ".join(f"{n}={done[case.key][n]['score']:.2f}" for n in names if n in done[case.key]), flush=True)
    summary(engine, args, cases, done, names)
    return 0


def summary(engine, args, cases, done, names) -> None:
    rows = []
    for name in names:
        recs = [done[c.key][name] for c in cases if name in done[c.key]]
        if not recs:
            continue
        answerable = [r for r in recs if r["kind"] != "unanswerable"]
        unanswerable = [r for r in recs if r["kind"] == "unanswerable"]
        with_notes = [r for r in recs if r["kept"]]
        rows.append([name, len(recs), f"{sum(r['score'] for r in recs) / len(recs):.3f}",
                     f"{sum(r['score'] for r in answerable) / len(answerable):.3f}" if answerable else "-",
                     f"{sum(bool(r['citations']) for r in with_notes)}/{len(with_notes)}" if name != "plain" else "-",
                     f"{sum(r['not_stated'] for r in answerable)}/{len(answerable)}",
                     f"{sum(r['not_stated'] for r in unanswerable)}/{len(unanswerable)}",
                     f"{sum(r['ending'] in ('limit', 'repeat') for r in recs)}/{len(recs)}",
                     ", ".join(f"{t} {sum(r['score'] for r in recs if r['task'] == t) / n:.2f}"
                               for t in dict.fromkeys(r["task"] for r in recs)
                               for n in [sum(r["task"] == t for r in recs)])])
    md = "\n".join(["# The answer prompt, by measurement\n",
                    f"{engine.lm.name}, {str(engine.lm.dtype).removeprefix('torch.')}; tasks {args.tasks} at "
                    f"{args.length} tokens, n={args.n} each, seed {args.seed}; one WiM read per case, every prompt "
                    "answering from its cache; CPU: " + cpu_name() + ".\n",
                    md_table(["prompt", "cases", "score (all)", "score (answerable)", "cites a note (where one was kept)",
                              "\"not stated\" on answerable", "\"not stated\" on unanswerable",
                              "cut at limit or repeat", "by task"], rows), "",
                    "The texts: bench/answer_prompts.py.", ""])
    write_results(args.out, "answer_prompts", {"rows": rows, "seed": args.seed, "default": prompt("answer")}, md)


if __name__ == "__main__":
    sys.exit(main())
