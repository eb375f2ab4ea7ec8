"""How well each classifier finds the segments that hold a gold fact, from `bench.eval`'s records.
`python -m bench.relevance RECORDS.jsonl [...] [--thresholds 0.3,0.5,0.7]`.

Every WiM read in the records lists the segments holding one of the case's inserted facts (`gold_segments`),
each classifier's keep/drop verdict per segment (`verdicts`), and the note's own first-step relevance score
(`relevance`: P(copy) / (P(copy) + P(marker))). Printed: precision, recall and F1 of "kept" against "holds a
gold fact" per classifier, the score's AUC, and the note relevance at other thresholds. Choose a threshold on
a tuning seed's records, never on the seed that is reported.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import md_table


def reads(paths: list[Path]) -> list[dict]:
    """The wim-read records of the run written last: a record file also keeps the records of earlier settings
    (another fingerprint), which must not be mixed in."""
    by_run: dict[str, dict[str, dict]] = {}
    last = None
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record.get("mode") == "wim-read" and "gold_segments" in record:
                last = record.get("fingerprint")
                by_run.setdefault(last, {})[record["case"]] = record
    return list(by_run.get(last, {}).values())


def precision_recall(pairs: list[tuple[bool, bool]]) -> dict:
    """pairs: (kept, gold) per segment."""
    kept = sum(k for k, _ in pairs)
    gold = sum(g for _, g in pairs)
    hits = sum(k and g for k, g in pairs)
    p = hits / kept if kept else 0.0
    r = hits / gold if gold else 0.0
    return {"kept": kept, "precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}


def auc(scored: list[tuple[float, bool]]) -> float | None:
    """Probability that a gold segment scores above a non-gold one (ties count half)."""
    pos = [s for s, g in scored if g]
    neg = [s for s, g in scored if not g]
    if not pos or not neg:
        return None
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def summarise(records: list[dict], thresholds: list[float]) -> dict:
    by_classifier: dict[str, list[tuple[bool, bool]]] = {}
    scored: list[tuple[float, bool]] = []
    for r in records:
        gold = {int(i) for i in r["gold_segments"]}
        for name, verdicts in (r.get("verdicts") or {}).items():
            by_classifier.setdefault(name, []).extend((bool(v), int(i) in gold) for i, v in verdicts.items())
        scored += [(float(s), int(i) in gold) for i, s in (r.get("relevance") or {}).items() if s is not None]
    return {"cases": len(records), "segments": len(scored) or max((len(v) for v in by_classifier.values()), default=0),
            "gold": sum(g for _, g in scored),
            "classifiers": {name: precision_recall(pairs) for name, pairs in sorted(by_classifier.items())},
            "auc": auc(scored),
            "thresholds": {t: precision_recall([(s >= t, g) for s, g in scored]) for t in thresholds}}


def markdown(summary: dict) -> str:
    rows = [[name, m["kept"], f"{m['precision']:.2f}", f"{m['recall']:.2f}", f"{m['f1']:.2f}"]
            for name, m in summary["classifiers"].items()]
    out = [f"{summary['cases']} cases, {summary['segments']} segments, {summary['gold']} holding a gold fact; "
           f"AUC of the note's relevance score: "
           + (f"{summary['auc']:.2f}" if summary["auc"] is not None else "-"), "",
           md_table(["classifier", "kept", "precision", "recall", "F1"], rows), "",
           md_table(["note relevance >=", "kept", "precision", "recall", "F1"],
                    [[t, m["kept"], f"{m['precision']:.2f}", f"{m['recall']:.2f}", f"{m['f1']:.2f}"]
                     for t, m in summary["thresholds"].items()])]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+", help="eval_cases*.jsonl files of one bench.eval run")
    parser.add_argument("--thresholds", default="0.3,0.5,0.6,0.7,0.8,0.9")
    args = parser.parse_args(argv)
    records = reads(args.records)
    if not records:
        print("no WiM reads with gold segments in these records", file=sys.stderr)
        return 1
    print(markdown(summarise(records, [float(t) for t in args.thresholds.split(",")])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
