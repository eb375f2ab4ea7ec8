"""What the margins found, measured from the reads alone: each case's gold sentences (what a note must copy for the
question to be answerable from the notes) against the sentences the notes copied.

    python -m bench.notes bench/results/eval-16k bench/results/eval-24k-window8k
    python -m bench.notes --write bench/results/eval-16k          # notes.md beside its eval.json

Gold sentences, per task:
- babilong:    the facts that decide the answer (bAbI's own supporting facts for the question);
- babilong-sample: the last sentence that moves the person asked about;
- multihop:    the chain's facts (the distractors are not gold);
- aggregation: every ledger entry, of the ten most listed items and of the rare ones (which item is listed most
               often can only be counted from all of them);
- hotpotqa:    HotpotQA's `supporting_facts` sentences;
- squad:       the sentence of the gold paragraph that holds the answer;
- unanswerable: none (its row counts what the notes copied, and recall is not defined).

Recall: the share of gold sentences copied into some note (counted with their repeats: five identical ledger lines
are five entries). Precision: the share of copied sentences that are gold (over the answerable tasks). A sentence
counts as copied when a note's piece holds it, or when pieces inside it cover most of it (the engine cuts a few
sentences where the task's sentence splitter does not). Notes' share: all the notes of a reading together, in
tokens, against its document's tokens. Nothing is read again: the notes come from the recorded wim-read records,
the cases are made again from (task, length, index, seed).
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .common import SHARED
from .tasks import ITEMS, Case, make_case

COVER = 0.8  # pieces inside a gold sentence that cover this share of it copy it


@dataclass
class NoteCount:
    """One reading's notes against its case's gold sentences."""
    gold: int               # gold sentences in the document (with repeats)
    found: int              # of those, copied into some note
    copied: int             # sentences the notes copied
    copied_gold: int        # of those, gold
    note_tokens: int        # tokens of all the notes together
    document_tokens: int


def _norm(text: str) -> str:
    return " ".join(text.split())


# ---- gold sentences ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _babi_support(prefix: str) -> dict[tuple[tuple[str, ...], str], list[str]]:
    """(story facts, question) -> the supporting facts' texts, for every question of a bAbI file."""
    name = next(p.name for p in (SHARED / "babi").glob(f"{prefix}_*_test.txt"))
    out, story = {}, {}
    for line in (SHARED / "babi" / name).read_text().splitlines():
        num, _, rest = line.partition(" ")
        if num == "1":
            story = {}
        if "\t" in rest or "|" in rest:
            question, _, support = re.split(r"[\t|]", rest)
            facts = tuple(story.values())
            out[(facts, question.strip())] = [story[int(n)] for n in support.split()]
        else:
            story[int(num)] = rest.strip()
    return out


@lru_cache(maxsize=None)
def _hotpot_by_id() -> dict[str, dict]:
    data = json.loads((SHARED / "hotpotqa" / "hotpot_dev_distractor_v1_first53.json").read_text())
    return {ex["_id"]: ex for ex in data}


_LEDGER_ENTRY = re.compile(
    r"The ledger records one (?P<a>[a-z ]+)\.|Item entered in the ledger: a (?P<b>[a-z ]+)\.|"
    r"Ledger entry: one (?P<c>[a-z ]+), in good order\.|In the ledger, another line reads: (?P<d>[a-z ]+)\.")


def ledger_entries(text: str) -> list[str]:
    """Every ledger entry in `text`, in order (bench/tasks.py's templates, with an item of its list)."""
    return [m.group(0) for m in _LEDGER_ENTRY.finditer(text)
            if next(g for g in m.groups() if g) in ITEMS]


def _sentences(text: str) -> list[str]:
    from engine.margins import sentences_of
    return sentences_of(text)


def gold_sentences(case: Case) -> list[str]:
    """The sentences a note must copy for `case` (see the module's docstring); [] where none is gold."""
    info = case.info
    if case.task == "babilong":
        return _babi_support(info["babi"])[(tuple(info["gold"]), case.query)]
    if case.task == "babilong-sample":
        person = re.search(r"Where is (\w+)\?", case.query)
        moves = [s for s in _sentences(case.text) if person and re.match(rf"{person.group(1)}\b", s)]
        return moves[-1:]
    if case.task == "multihop":
        return list(info["chain"])
    if case.task == "aggregation":
        return ledger_entries(case.text)
    if case.task == "hotpotqa":
        ex = _hotpot_by_id()[info["id"]]
        paragraphs = dict((title, sents) for title, sents in ex["context"])
        return [paragraphs[t][k].strip() for t, k in ex["supporting_facts"]
                if t in paragraphs and k < len(paragraphs[t])]
    if case.task == "squad":
        paragraph = info["gold"][0]
        for sentence in _sentences(paragraph):
            if any(a in sentence for a in case.answers):
                return [sentence]
        return []
    return []


# ---- copied sentences ----------------------------------------------------------------------------------------------
def copied_pieces(case: Case, note: str, spans: list | None) -> list[str]:
    """The sentences one note copied: by its spans where the record has them, else its text cut as the engine
    cuts a segment into pieces."""
    if spans:
        return [_norm(case.text[a:b]) for a, b in spans]
    from engine.margins import sentences_of
    return [_norm(p) for p in sentences_of(note)]


def match(gold: list[str], pieces: list[str]) -> tuple[int, int]:
    """(gold sentences copied, pieces that are gold), each piece and each gold sentence used once."""
    left = Counter(_norm(g) for g in gold)
    found, gold_pieces = 0, 0
    free = list(pieces)
    for g in list(left.elements()):
        if not g:
            continue
        holder = next((k for k, p in enumerate(free) if g in p), None)
        if holder is not None:
            free.pop(holder)
            found += 1
            gold_pieces += 1
            continue
        inside = [k for k, p in enumerate(free) if len(p) >= 12 and p in g]
        if inside and sum(len(free[k]) for k in inside) >= COVER * len(g):
            for k in reversed(inside):
                free.pop(k)
            found += 1
            gold_pieces += len(inside)
    return found, gold_pieces


def count(case: Case, read: dict, tokenizer) -> NoteCount:
    """A wim-read record's notes against `case`'s gold sentences."""
    spans = read.get("spans") or {}
    pieces: list[str] = []
    for i, note in read["margins"].items():
        if note:
            pieces += copied_pieces(case, note, spans.get(str(i)) or spans.get(i))
    gold = gold_sentences(case)
    found, gold_pieces = match(gold, pieces)
    notes = " ".join(n for n in read["margins"].values() if n)
    return NoteCount(len(gold), found, len(pieces), gold_pieces,
                     len(tokenizer.encode(notes, add_special_tokens=False)) if notes else 0,
                     len(tokenizer.encode(case.text, add_special_tokens=False)))


def summarise(counts: dict[str, tuple[Case, NoteCount]]) -> list[dict]:
    """Per task and length, then all answerable tasks: recall and precision (summed over cases), the notes'
    largest and mean share of their document."""
    groups: dict[tuple, list[NoteCount]] = defaultdict(list)
    for case, c in counts.values():
        groups[(case.task, case.length)].append(c)
        if case.task != "unanswerable":
            groups[("all", case.length)].append(c)
    rows = []
    for (task, length), cs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] == "all", kv[0][0])):
        gold, found = sum(c.gold for c in cs), sum(c.found for c in cs)
        copied, copied_gold = sum(c.copied for c in cs), sum(c.copied_gold for c in cs)
        shares = [c.note_tokens / max(1, c.document_tokens) for c in cs]
        rows.append({"task": task, "length": length, "n": len(cs), "gold": gold, "found": found,
                     "recall": found / gold if gold else None, "copied": copied, "copied_gold": copied_gold,
                     "precision": copied_gold / copied if copied and task != "unanswerable" else None,
                     "share_max": max(shares), "share_mean": sum(shares) / len(shares)})
    return rows


def markdown(rows: list[dict]) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"
    lines = ["| task | length | n | gold sentences copied | recall | copied sentences that are gold | precision | "
             "notes / document (mean, max) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['length']} | {r['n']} | {r['found']} of {r['gold']} | {pct(r['recall'])} | "
                     f"{r['copied_gold']} of {r['copied']} | {pct(r['precision'])} | "
                     f"{pct(r['share_mean'])}, {pct(r['share_max'])} |")
    return "\n".join(lines)


def folder_counts(folder: Path, tokenizer) -> tuple[dict, dict[str, tuple[Case, NoteCount]]]:
    """A bench.eval folder's meta, and each case's notes counted (its cases made again from their keys)."""
    data = json.loads((folder / "eval.json").read_text())
    meta = data["meta"]
    out = {}
    for c in data["cases"]:
        read = c["records"].get("wim-read")
        if not read or "margins" not in read:
            continue
        task, length, index = c["case"].split("/")
        case = _case(task, int(length), int(index), tokenizer, meta.get("seed", 0))
        out[c["case"]] = (case, count(case, read, tokenizer))
    return meta, out


def _case(task: str, length: int, index: int, tokenizer, seed: int) -> Case:
    if task == "babilong-sample":
        from .tasks import babilong_samples
        return babilong_samples(tokenizer)[index]
    return make_case(task, length, index, tokenizer, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.notes", description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="bench.eval folders (with eval.json)")
    parser.add_argument("--model", default="qwen2.5-1.5b", help="whose tokenizer made the cases")
    parser.add_argument("--write", action="store_true", help="write notes.md into each folder")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer
    from engine.model import resolve
    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model)[0])
    for folder in args.folders:
        _, counts = folder_counts(folder, tokenizer)
        table = markdown(summarise(counts))
        if args.write:
            (folder / "notes.md").write_text(
                f"What the notes copied, by `python -m bench.notes {folder}` (from the recorded reads):\n\n"
                + table + "\n")
        print(f"### {folder}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
