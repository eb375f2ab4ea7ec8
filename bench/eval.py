"""Answer quality of WiM (three margin classifiers), plain long-context reading, RAG, and margins alone, on
generated long-context tasks. `python -m bench.eval --modes wim,llm,rag,margins-only --task multihop --n 10
--length 4000` (or `--quick`).

Cost is in reading the document, so each case is read once per reading pattern:
- one `wim` read (margins written, no classifier) serves `wim-llm`, `wim-embedding` and `wim-none`: the margins
  are classified afterwards (classification never touches the document cache) and each selection is answered
  from the same cache as a follow-up; `margins-only` answers from the same margins on a fresh cache;
- `llm` (plain reading) answers from that same read when the text fits one window: at the document's end the
  wim cache *is* plain reading's cache (the notes were cut off), so the question goes straight after the
  document. Past the window (or with no wim read in this run) `llm` reads on its own; `llm-read` always does,
  to check on a sample that the shared read gives the same answers (the report gives the agreement);
- `rag` reads once.
With `--reads DIR` each case's wim read (its cache, engine/saved.py, and its record) is kept there and taken up
again by a later run, so a changed answer prompt or a new wim mode costs answers, not reads. Without it, a wim
mode added to a finished run past the window needs no read either: its answer re-reads its notes' passages (the
look-up), so the recorded read's notes are taken up without a cache (Reading.restore_notes).
Every (case, mode) result is appended to a JSONL record as soon as it exists; a rerun with the same settings
skips what is there, so `--n` can grow later and an interrupted run loses at most one case.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import random
import re
import string
import sys
import time
from collections import defaultdict
from pathlib import Path

from engine.answering import says_not_stated
from engine.attribution import without_citations
from engine.classify import combined_verdict, says_nothing
from engine.model import dtype_name
from engine.settings import Settings

from .common import RESULTS, load_engine, md_table, segment_tokens_for, write_results
from .tasks import BABILONG_TASKS, FIXED_TASKS, TASKS, Case, babilong_samples, make_case

# wim mode -> the verdicts that choose its margins. wim-<classifier>: the margins that classifier keeps
# (wim-combined: engine/classify.py's combined_verdict, on the read's own MiniLM verdicts); wim-reader: the margins
# a careful reader would keep (those on the case's gold segments: the human-in-the-loop upper bound).
WIM_MODES = {"wim-margin": "margin", "wim-llm": "llm", "wim-embedding": "embedding", "wim-combined": "combined",
             "wim-none": "none", "wim-reader": "reader"}
# Modes with a read of their own: llm-read (plain reading, not from the WiM read's cache).
OWN_READ = {"llm": ("llm", {}), "llm-read": ("llm", {}), "rag": ("rag", {})}
MODES = (*WIM_MODES, "llm", "llm-read", "rag", "margins-only")
ALIASES = {"wim": tuple(WIM_MODES)}
# margins-only answers from the notes the app's default classifier keeps (Settings.classifier; "margin" until
# 2026-12-06, when the default had long been "combined": the records name the classifier they used).
MARGINS_ONLY_CLASSIFIER = Settings.classifier
LENGTHS = (4000, 7200)  # "4k" and "8k": 7.2k leaves the 8,192-token window room for 8 margins and the answer


# ---- scoring -------------------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().replace("’", "'")
    text = "".join(" " if c in string.punctuation else c for c in text)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def short_score(prediction: str, answers: list[str]) -> dict:
    """exact: the normalised answer equals a gold one; contained: a gold answer's words appear, in order and
    adjacent, in it (the BABILong-style criterion; it counts exact matches too)."""
    pred = normalize(prediction)
    padded = f" {pred} "
    exact = any(pred == normalize(a) for a in answers)
    contained = any(normalize(a) and f" {normalize(a)} " in padded for a in answers)
    return {"exact": exact, "contained": exact or contained, "score": float(exact or contained)}


def list_score(prediction: str, gold: list[str]) -> dict:
    """Set F1 of the listed items against the gold set: each listed item counts once, matched to a gold item
    whose name it contains; items matching none are false positives."""
    pieces = [normalize(p) for p in re.split(r"[,;\n]|\band\b|\d+\.", prediction)]
    pieces = [p for p in pieces if p]
    found, false_pos = set(), 0
    for piece in dict.fromkeys(pieces):
        hit = next((g for g in gold if f" {normalize(g)} " in f" {piece} "), None)
        if hit is None:
            false_pos += 1
        else:
            found.add(hit)
    tp = len(found)
    precision = tp / (tp + false_pos) if tp + false_pos else 0.0
    recall = tp / len(gold)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "score": f1}


# The places bAbI qa1 and qa2 answer with (BABILong's TASK_LABELS for them, booydar/babilong babilong/metrics.py).
BABILONG_LABELS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")


def babilong_score(prediction: str, answers: list[str], question: str) -> dict:
    """BABILong's own check (its `compare_answers`): the answer's first sentence names the gold place and no
    other of the task's places (a place the question names aside). Containment alone credits an answer that
    lists every room the person went to; `contained` keeps that looser verdict beside it."""
    first = prediction.lower().split(".")[0]
    asked = {label for label in BABILONG_LABELS if label in question.lower()}
    named = {label for label in BABILONG_LABELS if label in first} - asked
    right = len(named) == 1 and any(a.lower() in named for a in answers)
    return {**short_score(prediction, answers), "score": float(right)}


def score(case: Case, prediction: str) -> dict:
    """The answer's words scored (its citations, "[segment 3]", are not part of them); an unanswerable case is
    right when the answer says the document does not say; a BABILong case by BABILong's own check."""
    words = without_citations(prediction)
    if case.kind == "unanswerable":
        right = says_not_stated(words)
        return {"exact": right, "contained": right, "score": float(right)}
    if case.task in BABILONG_TASKS:
        return babilong_score(words, case.answers, case.query)
    return list_score(words, case.answers) if case.kind == "list" else short_score(words, case.answers)


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(values: list[float], iterations: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean."""
    if not values:
        return 0.0, 1.0
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(iterations))
    return means[int(0.025 * iterations)], means[int(0.975 * iterations) - 1]


# ---- running the modes on one case ------------------------------------------------------------------------------
class Evaluator:
    def __init__(self, engine, margin_tokens: int, segments: int, max_segment_tokens: int,
                 margins: str = "extractive", context_limit: int | None = None, reads: Path | None = None,
                 copy_choice: str = "opening"):
        self.engine = engine
        self.margin_tokens, self.segments, self.max_segment = margin_tokens, segments, max_segment_tokens
        self.margins, self.copy_choice = margins, copy_choice
        self.context_limit = context_limit
        self.reads = reads

    def settings(self, case: Case, mode: str):
        """The engine's defaults but for the case's sizes. Margins are read with the default classifier, whose
        selection is what a multi-window reading carries into its next window (each wim mode then answers with
        its own selection, the verdicts worked out after the read)."""
        tok = self.engine.lm.tokenizer
        size = min(segment_tokens_for(case.text, tok, self.segments), self.max_segment)
        return Settings(mode=mode, segment_tokens=size, margin_tokens=self.margin_tokens,
                        answer_tokens=case.answer_tokens, margins=self.margins, context_limit=self.context_limit,
                        copy_choice=self.copy_choice)

    def wim_read(self, case: Case, base, notes_only: dict | None = None) -> tuple[object, dict]:
        """(reading, its record): read now, or taken up from --reads where an earlier run kept it, or (given
        `notes_only`, a wim-read record) its notes taken up without a cache, for answers that re-read passages."""
        from engine.margin_writing import MarginNote
        reading = self.engine.open(case.text, base)
        kept = self.reads / case.key.replace("/", "-") if self.reads else None
        if kept and (kept / "wim-read.json").exists() and reading.restore(kept):
            return reading, json.loads((kept / "wim-read.json").read_text())
        if notes_only is not None:
            keep = notes_only["verdicts"].get(base.classifier, {})
            reading.restore_notes([MarginNote(int(i), text, keep.get(i), notes_only["relevance"][i])
                                   for i, text in notes_only["margins"].items()])
            return reading, notes_only
        record = self._read(case, reading)
        if kept:
            # Past the window only the last window's cache: answers need no other (~0.2 GB a 24k case at 8k).
            reading.save(kept, max_bytes=0 if reading.multiwindow else None)
            (kept / "wim-read.json").write_text(json.dumps(record))
        return reading, record

    def _read(self, case: Case, reading) -> dict:
        """Read the case with WiM and record the margins, every classifier's verdicts on them, and the costs."""
        from engine.classify import Classifier
        base = reading.settings
        t = time.perf_counter()
        events = list(reading.read(case.query))
        read_s = time.perf_counter() - t
        margins = {i: m.text for i, m in sorted(reading.margins.items())}
        verdicts, failed = {}, {}
        for method in ("llm", "embedding"):
            try:
                judge = Classifier(method, reading.runner, self.engine.layout, base.embedding_threshold)
                verdicts[method] = {i: bool(judge(case.query, text)[0]) if text else False
                                    for i, text in margins.items()}
            except Exception as exc:  # say, no embedding model: the other modes still count
                failed[method] = f"{type(exc).__name__}: {exc}"
                print(f"{case.key}: classifier {method} failed: {failed[method]}", flush=True)
        verdicts["none"] = {i: bool(text) for i, text in margins.items()}
        # `margin`: relevance from the note itself; a note is kept unless it said "nothing relevant".
        verdicts["margin"] = {i: bool(text) and not says_nothing(text) for i, text in margins.items()}
        notes = {e.index: e for e in events if e.kind == "margin"}
        if "embedding" in verdicts:  # `combined` (engine/classify.py): MiniLM, or a note sure of itself
            verdicts["combined"] = {i: verdicts["margin"][i] and combined_verdict(verdicts["embedding"][i],
                                                                                notes[i].score) for i in margins}
        gold = gold_segments(case, reading)
        verdicts["reader"] = {i: bool(text) and i in gold for i, text in margins.items()}
        return {"mode": "wim-read", "seconds": read_s, "margins": margins, "verdicts": verdicts,
                "spans": {i: [list(span) for span in m.spans] for i, m in sorted(reading.margins.items())},
                "relevance": {i: notes[i].score for i in notes}, "endings": {i: notes[i].ending for i in notes},
                "gold_segments": gold, "stats": next((e.to_dict() for e in events if e.kind == "stats"), None),
                "segments": len(reading.segments), "notices": [e.text for e in events if e.kind == "notice"],
                "windows": 1 + sum(e.kind == "window" for e in events)}

    def run(self, case: Case, modes: list[str], stored: dict[str, dict]) -> dict[str, dict]:
        """Records for the `modes` not yet in `stored` (mode -> record)."""
        from engine import Answer
        from .baselines import margins_only
        out: dict[str, dict] = {}
        wim_needed = [m for m in modes if m in WIM_MODES and m not in stored]
        read = stored.get("wim-read")
        plain_needed = "llm" in modes and "llm" not in stored
        if wim_needed or ("margins-only" in modes and "margins-only" not in stored and read is None):
            # Answers already recorded for this read: one whose key a needed mode shares is not computed again,
            # and where every other needed answer re-reads its passages, the read's notes are all it takes.
            answered: dict[tuple, dict] = {}  # answer key -> record: two modes giving the same (greedy) answer
            if read is not None:
                answered = {self._answer_key(rec["margins_used"]): rec
                            for m, rec in stored.items() if m in WIM_MODES and "margins_used" in rec}
            stored_read = read
            reading, read = self.wim_read(case, self.settings(case, "wim"),
                                          notes_only=read if read and self._notes_suffice(read, wim_needed, answered)
                                          and not plain_needed else None)
            notes_only = read is stored_read  # no cache: every answer below re-reads its passages
            if not notes_only:
                answered = {}  # a new read: the recorded answers were another read's
                out["wim-read"] = read
            # JSON keys are strings: a record taken up from --reads gives them back as numbers.
            verdicts = {method: {int(i): v for i, v in got.items()} for method, got in read["verdicts"].items()}
            for mode in wim_needed:
                selection = WIM_MODES[mode]
                if selection not in verdicts:
                    continue
                chosen = [i for i, keep in verdicts[selection].items() if keep]
                key = self._answer_key(chosen)
                if key in answered:
                    same = answered[key]
                    out[mode] = same | {"mode": mode, "same_selection_as": same["mode"]}
                    continue
                t = time.perf_counter()
                answer = [e for e in reading.answer(case.query, margins=chosen)
                          if isinstance(e, Answer)][0]
                out[mode] = self._record(case, mode, answer.text, time.perf_counter() - t, margins_used=chosen,
                                         ending=answer.ending, retried=answer.retried, citations=answer.citations,
                                         passages=answer.passages,
                                         **({"notes_from_record": True} if notes_only else {}))
                answered[key] = out[mode]
            if plain_needed and not reading.multiwindow:
                t = time.perf_counter()
                answer = [e for e in reading.answer(case.query, plain=True) if isinstance(e, Answer)][0]
                out["llm"] = self._record(case, "llm", answer.text, time.perf_counter() - t, ending=answer.ending,
                                          retried=answer.retried, shared_read=True)
            del reading
        verdicts = read["verdicts"] if read else {}
        kept_by = MARGINS_ONLY_CLASSIFIER if MARGINS_ONLY_CLASSIFIER in verdicts else "llm"  # older records: llm
        if "margins-only" in modes and "margins-only" not in stored and kept_by in verdicts:
            margins = {int(i): text for i, text in read["margins"].items()}  # stored JSON has string keys
            # The notes WiM's default classifier keeps: the same ones the wim-<default> answer sees.
            keep = sorted(int(i) for i, k in verdicts[kept_by].items() if k and margins[int(i)])
            chosen = {i: margins[i] for i in keep}
            t = time.perf_counter()
            text = margins_only(self.engine, case.query, chosen, case.answer_tokens)
            out["margins-only"] = self._record(case, "margins-only", text, time.perf_counter() - t, margins_used=keep,
                                               classifier=kept_by)
        for mode, (engine_mode, changes) in OWN_READ.items():
            if mode in modes and mode not in stored and mode not in out:
                t = time.perf_counter()
                try:
                    settings = dataclasses.replace(self.settings(case, engine_mode), **changes)
                    events = list(self.engine.run(case.text, case.query, settings))
                except Exception as exc:  # one mode failing (say, rag without its embedding model) ends no other
                    print(f"{case.key}: {mode} failed: {type(exc).__name__}: {exc}", flush=True)
                    continue
                answer = [e for e in events if isinstance(e, Answer)][0]
                extra = {} if engine_mode != "wim" else {"margins_used": answer.margins_used,
                                                         "citations": answer.citations}
                out[mode] = self._record(case, mode, answer.text, time.perf_counter() - t, ending=answer.ending,
                                         retried=answer.retried, **extra)
        return out

    @staticmethod
    def _answer_key(chosen) -> tuple:
        """Two answers with the same key are the same greedy computation: the same margins, answered from the
        same reading."""
        return tuple(sorted(int(i) for i in chosen))

    def _notes_suffice(self, read: dict, needed: list[str], answered: dict) -> bool:
        """Whether every needed wim answer is recorded already or, past the window, re-reads its notes' passages
        (the look-up: no cache of the text needed)."""
        if read["windows"] > 1:
            return True
        return all(self._answer_key([i for i, keep in read["verdicts"].get(WIM_MODES[mode], {}).items() if keep])
                   in answered for mode in needed)

    @staticmethod
    def _record(case: Case, mode: str, prediction: str, seconds: float, **extra) -> dict:
        return {"mode": mode, "prediction": prediction, "seconds": seconds, "not_stated": says_not_stated(prediction),
                **score(case, prediction), **extra}


def gold_segments(case: Case, reading) -> list[int]:
    """Segments that hold a gold fact: one of the case's inserted answer texts, or a 40-character end of one
    (a text cut by a segment boundary counts for both sides)."""
    gold = case.info.get("gold") or []
    found = []
    for seg in reading.segments:
        body = reading.doc.segment_text(seg)
        if any(g in body or g[:40] in body or g[-40:] in body for g in gold):
            found.append(seg.index)
    return found


# ---- the record of results --------------------------------------------------------------------------------------
def attention_kernel() -> str:
    """Which attention the reads' prefill passes run: engine/kernels' fused one on AMX's tiles (`fused-amx`) or on
    its AVX-512 path (`fused`), or torch's (`torch`)."""
    from engine.attention import fused_enabled
    from engine.kernels import attention_use_amx, load
    if not fused_enabled() or load() is None:
        return "torch"
    return "fused-amx" if attention_use_amx(True) else "fused"


def fingerprint(engine, args) -> str:
    """What a stored result depends on: model, dtype, reading settings, prompts and seed."""
    from engine.prompts import PROMPT_DIR
    from .baselines import MARGINS_ONLY_PROMPT
    parts = [engine.lm.name, str(engine.lm.dtype), args.margin_tokens, args.segments, args.max_segment_tokens,
             *([args.margins] if args.margins != "abstractive" else []),
             # copies chosen by their openings (the records made token by token keep their fingerprint)
             *(["copy=opening"] if args.margins == "extractive" and args.copy_choice == "opening" else []),
             *([f"context_limit={args.context_limit}"] if args.context_limit else []),
             # the fused kernel's sums come in another order than torch's (torch's records keep their fingerprint)
             *([f"attention={kernel}"] if (kernel := attention_kernel()) != "torch" else []),
             # decode weights asked for by name, not left to the engine (their sums differ: another record)
             *([f"decode={chosen}"] if (chosen := getattr(args, "decode_weights", None)
                                          or os.environ.get("MARGINALIA_DECODE_WEIGHTS"))
               not in (None, "auto") else []),
             *(["prefill=int8"] if getattr(engine.lm, "prefill_int8", None) else []),  # other values in the cache
             # transformers' forward for every pass, asked for (the written-out pass rounds a few sums otherwise)
             *(["prefill=forward"] if os.environ.get("MARGINALIA_PREFILL_PASS") == "forward" else []),
             args.seed, MARGINS_ONLY_PROMPT, *(p.read_text() for p in sorted(PROMPT_DIR.glob("*.txt")))]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:12]


def load_records(out: Path, fp: str) -> dict[str, dict[str, dict]]:
    """case key -> mode -> record, for records made with this fingerprint, from every record file in `out`
    (eval_cases.jsonl, and eval_cases.shardK.jsonl written by parallel workers)."""
    records: dict[str, dict[str, dict]] = defaultdict(dict)
    for path in sorted(out.glob("eval_cases*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by an interrupted run
            if r.get("fingerprint") == fp:
                records[r["case"]][r["mode"]] = r
    return records


def summarise(cases: list[Case], records, modes: list[str]) -> list[dict]:
    groups: dict[tuple[str, int], list[Case]] = defaultdict(list)
    for c in cases:
        groups[(c.task, c.length if c.task not in FIXED_TASKS else 0)].append(c)
    rows = []
    for (task, length), group in groups.items():
        kind = group[0].kind
        for mode in modes:
            got = [records[c.key][mode] for c in group if mode in records.get(c.key, {})]
            scores = [r["score"] for r in got]
            n = len(scores)
            mean = sum(scores) / n if n else None
            lo, hi = (bootstrap(scores) if kind == "list" else wilson(sum(scores), n)) if n else (None, None)
            rows.append({"task": task, "length": length or "sample", "mode": mode, "n": n, "score": mean,
                         "lo": lo, "hi": hi, "metric": {"list": "set F1 (bootstrap 95%)",
                                                         "unanswerable": "answered not stated (Wilson 95%)"}.get(
                             kind, "BABILong's check (Wilson 95%)" if task in BABILONG_TASKS
                             else "contained match (Wilson 95%)"),
                         "exact": (sum(r.get("exact", False) for r in got) / n) if n and kind != "list" else None,
                         "seconds": sum(r["seconds"] for r in got) / n if n else None})
    # Overall, per length: the cases of the scored tasks (not the fixed samples, not the unanswerable questions,
    # whose score is another measure) that every mode answered, so each column averages the same cases.
    for length in dict.fromkeys(length for task, length in groups if task not in FIXED_TASKS):
        shared = [c for (task, at), group in groups.items() if at == length and task not in FIXED_TASKS
                  for c in group if c.kind != "unanswerable" and all(m in records.get(c.key, {}) for m in modes)]
        for mode in modes:
            got = [records[c.key][mode] for c in shared]
            scores = [r["score"] for r in got]
            n = len(scores)
            lo, hi = bootstrap(scores) if n else (None, None)
            rows.append({"task": "all", "length": length, "mode": mode, "n": n,
                         "score": sum(scores) / n if n else None, "lo": lo, "hi": hi,
                         "metric": "mean score of the cases every mode answered (bootstrap 95%)", "exact": None,
                         "seconds": sum(r["seconds"] for r in got) / n if n else None})
    return rows


def answer_form(cases: list[Case], records, modes: list[str]) -> list[list]:
    """Per mode: answers ended by the token cap or a repetition (then trimmed to their last sentence), answers
    that cite a note where a note was given (wim modes, records that have citations), and "not stated" answers
    on answerable and on unanswerable cases."""
    kinds = {c.key: c.kind for c in cases}
    rows = []
    for mode in modes:
        got = [(kinds[k], m[mode]) for k, m in records.items() if k in kinds and mode in m]
        if not got:
            continue
        cut = sum(r.get("ending") in ("limit", "repeat") for _, r in got)
        with_notes = [r for _, r in got if r.get("margins_used") and "citations" in r]
        answerable = [r for kind, r in got if kind != "unanswerable"]
        unanswerable = [r for kind, r in got if kind == "unanswerable"]
        rows.append([mode, len(got), f"{cut}/{len(got)}",
                     f"{sum(bool(r['citations']) for r in with_notes)}/{len(with_notes)}" if with_notes else "-",
                     f"{sum(bool(r.get('not_stated')) for r in answerable)}/{len(answerable)}",
                     f"{sum(bool(r.get('not_stated')) for r in unanswerable)}/{len(unanswerable)}"
                     if unanswerable else "-"])
    return rows


def agreement(records) -> dict | None:
    """Plain reading answered from the wim read (`llm`, shared_read) against its own read (`llm-read`), on the
    cases that have both: same answer text, same score."""
    pairs = [(m["llm"], m["llm-read"]) for m in records.values()
             if "llm-read" in m and m.get("llm", {}).get("shared_read")]
    if not pairs:
        return None
    return {"n": len(pairs), "same_text": sum(a["prediction"] == b["prediction"] for a, b in pairs),
            "same_score": sum(a["score"] == b["score"] for a, b in pairs)}


def markdown(meta: dict, rows: list[dict], modes: list[str]) -> str:
    cells: dict[tuple, dict] = {(r["task"], r["length"], r["mode"]): r for r in rows}
    keys = list(dict.fromkeys((r["task"], r["length"]) for r in rows))
    table = []
    for task, length in keys:
        line = [task, length]
        for mode in modes:
            r = cells[(task, length, mode)]
            line.append("-" if not r["n"] else f"{r['score']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] n={r['n']}")
        table.append(line)
    cost = []
    for m in modes:
        done = [r for r in rows if r["mode"] == m and r["n"] and r["task"] != "all"]
        n = sum(r["n"] for r in done)
        cost.append([m, f"{sum(r['seconds'] * r['n'] for r in done) / n:.1f}" if n else "-"])
    return "\n".join([
        "# Answer quality\n",
        f"{meta['model']}, {meta['dtype']}; documents of {', '.join(str(x) for x in meta['lengths'])} tokens "
        f"(book prose with the task inserted)"
        f"{' plus the two shared BABILong samples' if 'babilong-sample' in meta['tasks'] else ''}; "
        f"segments of about 1/{meta['segments']} of the document (at most {meta['max_segment_tokens']} tokens), margins of at most {meta['margin_tokens']} "
        f"tokens, a context limit of {meta.get('context_limit') or 'the model window'} tokens, "
        f"greedy decoding; seed {meta['seed']}. n = cases per cell.\n",
        "Scores: short answers by contained match (a gold answer's normalised words appear in the answer; "
        "exact matches count), babilong by BABILong's own check (the answer's first sentence names the gold place "
        "and no other), each with a 95% Wilson interval; aggregation by set F1 of the listed items with a 95% "
        "bootstrap interval. wim-margin / wim-llm / wim-embedding / wim-none: WiM answering with the margins each "
        "classifier keeps (margin: the note's own relevance; none: all margins); margins-only: the notes the "
        f"default classifier ({MARGINS_ONLY_CLASSIFIER}) keeps, without the document.\n",
        md_table(["task", "length", *modes], table), "",
        "Mean seconds per case and mode (wim-*: the answer step only; the shared wim read is listed as wim-read):\n",
        md_table(["mode", "s"], cost + ([["wim-read", f"{meta['wim_read_seconds']:.1f}"]]
                                       if meta.get("wim_read_seconds") else [])), "",
        *(["How the answers end and what they cite:\n",
           md_table(["mode", "answers", "ended by the token cap or a repetition", "cite a note (where notes were "
                     "given)", "\"not stated\" (answerable)", "\"not stated\" (unanswerable)"], meta["form"]), ""]
          if meta.get("form") else []),
        *([f"Plain reading answered from the wim read against its own read (`llm` against `llm-read`), "
           f"{a['n']} cases: the same answer on {a['same_text']}, the same score on {a['same_score']}.\n"]
          if (a := meta.get("agreement")) else [])])


def save_cases(path: Path, cases: list[Case]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(dataclasses.asdict(c)) + "\n")


def read_cases(path: Path) -> list[Case]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [Case(**json.loads(line)) for line in f if line.strip()]


def add_read_options(parser: argparse.ArgumentParser) -> None:
    """How each case is read (engine Settings): the options bench.eval, bench.answer_prompts and
    bench.answer_choice share, read by evaluator_for."""
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--margin-tokens", type=int, default=64)
    parser.add_argument("--max-segment-tokens", type=int, default=1024)
    parser.add_argument("--margins", default="extractive", choices=("extractive", "scored", "abstractive"),
                        help="how margins are written (engine Settings.margins)")
    parser.add_argument("--copy-choice", default="opening", choices=("opening", "token"),
                        help="how a copied note chooses its sentences (engine Settings.copy_choice)")
    parser.add_argument("--context-limit", type=int, default=None,
                        help="tokens the cache may hold (default: the model's window); a smaller limit reads a "
                             "long text in several windows at a fraction of the cost of a window that long")


def evaluator_for(engine, args, reads: Path | None = None) -> Evaluator:
    """The Evaluator for add_read_options' options; `reads`: where reads are kept and taken up again."""
    return Evaluator(engine, args.margin_tokens, args.segments, args.max_segment_tokens, args.margins,
                     args.context_limit, reads, args.copy_choice)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eval", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="wim,llm,rag,margins-only",
                        help=f"comma list of {', '.join(MODES)}; `wim` = the three wim-* classifiers")
    parser.add_argument("--task", "--tasks", dest="tasks", default=",".join((*TASKS, *FIXED_TASKS)),
                        help=f"comma list of {', '.join((*TASKS, *FIXED_TASKS))}")
    parser.add_argument("--n", type=int, default=10, help="cases per task and length")
    parser.add_argument("--length", default=",".join(map(str, LENGTHS)), help="comma list of document lengths")
    parser.add_argument("--seed", type=int, default=0)
    add_read_options(parser)
    parser.add_argument("--quick", action="store_true", help="smoke test: one short case per task")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results; "
                                                                "--quick requires it)")
    parser.add_argument("--cases", type=Path, default=None,
                        help="read the cases from this file (written by --dump-cases) instead of generating them")
    parser.add_argument("--dump-cases", type=Path, default=None,
                        help="generate the cases, write them to this .jsonl.gz file and stop (to run them elsewhere)")
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="run only every N-th case from the K-th (parallel workers on one accelerator); "
                             "each shard writes its own record file in --out")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: summarise the records found in --out into eval.json and eval.md")
    parser.add_argument("--workers", type=int, default=1,
                        help="run the cases in this many parallel worker processes (one accelerator shared), "
                             "then summarise them all")
    parser.add_argument("--deadline", type=float, default=None,
                        help="with --workers: stop the workers after this many seconds and report what is done "
                             "(cases run in an order that keeps the table balanced)")
    parser.add_argument("--reads", type=Path, default=None, metavar="DIR",
                        help="keep each case's wim read here (its cache, engine/saved.py, and its record) and take "
                             "it up again on a later run: a changed answer prompt or a new wim mode then costs "
                             "answers, not reads (~0.5 GB a 16k case; past the window the last window only)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--decode-weights", default=None, help="engine/model.py's decode weights (default: auto)")
    parser.add_argument("--prefill-weights", default=None,
                        help="engine/prefill_int8.py's prefill weights (default: full)")
    parser.add_argument("--model", default="embedded",
                        help="`embedded`, `qwen2.5-1.5b`, a .gguf file, a folder or a hub id (records are kept apart "
                             "by model: the fingerprint names it)")
    args = parser.parse_args(argv)
    if args.quick:
        if args.out is None:
            parser.error("--quick writes only to a folder given by --out (never over bench/results)")
        args.n, args.length, args.segments, args.margin_tokens = 1, "500", 4, 16
        args.tasks = ",".join(t for t in args.tasks.split(",") if t not in FIXED_TASKS)
    modes = list(dict.fromkeys(m for name in args.modes.split(",") for m in ALIASES.get(name.strip(), [name.strip()])))
    tasks = [t.strip() for t in args.tasks.split(",")]
    lengths = [int(x) for x in args.length.split(",")]
    unknown = [m for m in modes if m not in MODES] + [t for t in tasks if t not in (*TASKS, *FIXED_TASKS)]
    if unknown:
        parser.error(f"unknown mode or task: {', '.join(unknown)}")
    out = args.out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)

    if args.workers > 1 and not (args.shard or args.report or args.dump_cases):
        return run_workers(list(sys.argv[1:] if argv is None else argv), args.workers, args.deadline, out, log)
    if args.dump_cases:
        from transformers import AutoTokenizer
        from engine.model import convert_embedded
        cases = generate_cases(AutoTokenizer.from_pretrained(convert_embedded()), tasks, lengths, args)
        save_cases(args.dump_cases, cases)
        log(f"wrote {len(cases)} cases to {args.dump_cases}")
        return 0
    engine = load_engine(args.device, args.dtype, args.model, args.decode_weights, args.prefill_weights)
    tok = engine.lm.tokenizer
    fp = fingerprint(engine, args)
    cases = read_cases(args.cases) if args.cases else generate_cases(tok, tasks, lengths, args)
    if args.cases:  # the file decides the cases; the table lists what it holds
        tasks = list(dict.fromkeys(c.task for c in cases))
        lengths = list(dict.fromkeys(c.length for c in cases if c.task not in FIXED_TASKS))
    records = load_records(out, fp)
    record_path = out / "eval_cases.jsonl"
    mine = cases
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        mine = cases[k::n]
        record_path = out / f"eval_cases.shard{k}.jsonl"
    evaluator = evaluator_for(engine, args, args.reads)
    meta = {"model": engine.lm.name, "dtype": dtype_name(engine.lm.dtype), "lengths": lengths,
            "segments": args.segments, "margin_tokens": args.margin_tokens, "copy_choice": args.copy_choice,
            "max_segment_tokens": args.max_segment_tokens, "context_limit": args.context_limit or
            engine.lm.context_length, "seed": args.seed, "n": args.n, "tasks": tasks,
            "modes": modes, "quick": args.quick, "fingerprint": fp, "attention": attention_kernel(),
            "decode_weights": engine.lm.info.get("decode_weights") if hasattr(engine.lm, "info") else None,
            "prefill_weights": engine.lm.info.get("prefill_weights") if hasattr(engine.lm, "info") else None}

    if args.report:
        mine = []

    def save() -> tuple[Path, Path]:
        rows = summarise(cases, records, modes)
        reads = [m["wim-read"]["seconds"] for m in records.values() if "wim-read" in m]
        meta["wim_read_seconds"] = sum(reads) / len(reads) if reads else None
        meta["wall_seconds"] = time.perf_counter() - started
        meta["agreement"] = agreement(records)
        meta["notes_from_record"] = sum(bool(r.get("notes_from_record")) for m in records.values() for r in m.values())
        meta["form"] = answer_form(cases, records, modes)
        data = {"meta": meta, "results": rows,
                "cases": [{"case": c.key, "task": c.task, "length": c.length, "query": c.query, "answers": c.answers,
                           "info": c.info, "records": records.get(c.key, {})} for c in cases]}
        return write_results(out, "eval", data, markdown(meta, rows, modes))

    for k, case in enumerate(mine):
        have = records.get(case.key, {})
        if all(m in have for m in modes):
            continue
        t = time.perf_counter()
        try:
            new = evaluator.run(case, modes, have)
        except Exception as exc:  # one failed case (say, a document the engine refuses) must not end the run
            log(f"{case.key}: {type(exc).__name__}: {exc}")
            continue
        # Opened for each case, not held for the run: a file replaced meanwhile (a git checkout of the results)
        # gets the records, not a deleted copy of it.
        with record_path.open("a", encoding="utf-8") as log_file:
            for mode, rec in new.items():
                rec |= {"case": case.key, "fingerprint": fp}
                records[case.key][mode] = rec
                log_file.write(json.dumps(rec) + "\n")
        scores = " ".join(f"{m}={new[m]['score']:.2f}" for m in modes if m in new)
        log(f"{k + 1}/{len(mine)} {case.key} ({time.perf_counter() - t:.0f} s) {scores}")
        if not args.shard:  # shards leave the summary to one `--report` run over all record files
            save()
    if args.shard:
        return 0
    paths = save()
    rows = summarise(cases, records, modes)
    print()
    print(markdown(meta, rows, modes))
    print(f"wrote {paths[0]} and {paths[1]} ({meta['wall_seconds'] / 60:.1f} min)")
    return 0


def run_workers(argv: list[str], workers: int, deadline: float | None, out: Path, log) -> int:
    """`workers` copies of this command, each on every workers-th case (--shard), then one --report over all of
    their record files. A small model decoding one token at a time leaves an accelerator mostly idle, waiting on
    Python and kernel launches; several processes fill it."""
    import subprocess
    started = time.monotonic()
    procs = []
    # Threads per worker: more threads than cores in all make every worker wait on the others' spinning threads.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, os.cpu_count() // workers)))}
    for k in range(workers):
        cmd = [sys.executable, "-m", "bench.eval", *argv, "--workers", "1", "--shard", f"{k}/{workers}"]
        with (out / f"worker{k}.log").open("w") as worker_log:
            procs.append(subprocess.Popen(cmd, stdout=worker_log, stderr=subprocess.STDOUT, env=env))
    log(f"{workers} workers started")
    while any(p.poll() is None for p in procs):
        if deadline is not None and time.monotonic() - started > deadline:
            log(f"deadline of {deadline:.0f} s reached: stopping the workers, reporting what is done")
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
            break
        time.sleep(1)
    failed = [k for k, p in enumerate(procs) if p.returncode not in (0, -15)]
    if failed:
        log(f"workers {failed} failed: see {out}/worker<k>.log")
    main([*argv, "--workers", "1", "--report"])
    return 1 if failed else 0


def generate_cases(tok, tasks: list[str], lengths: list[int], args) -> list[Case]:
    """Index-major order, so every (task, length) cell grows together and an early stop is still balanced.
    The fixed samples come after the first round, so that an early stop still has every task."""
    cases: list[Case] = []
    for i in range(args.n):
        for length in lengths:
            cases += [make_case(task, length, i, tok, args.seed) for task in tasks if task not in FIXED_TASKS]
        if i == 0 and "babilong-sample" in tasks:
            cases += babilong_samples(tok)
    if args.quick:
        for c in cases:
            c.answer_tokens = 16 if c.kind == "short" else 32
    return cases


if __name__ == "__main__":
    sys.exit(main())
