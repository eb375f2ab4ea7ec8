"""Per task: the look-up against the filled answer (and a reader's marks both ways), from run.py's records."""
import json, sys
from collections import defaultdict
from pathlib import Path
from bench.eval import wilson, bootstrap, score
from bench.rescore import eval_folder

def main(path, folder):
    _, cases, _ = eval_folder(Path(folder))
    recs = [json.loads(l) for l in open(path)]
    by = defaultdict(lambda: defaultdict(list))
    for r in recs:
        by[r["task"]]["lookup"].append(r["lookup"]["score"])
        by[r["task"]]["filled"].append(r["filled"]["score"])
        if "reader" in r:
            rd = r["reader"]
            by[r["task"]]["reader-lookup"].append(rd["lookup"]["score"] if "lookup" in rd
                                                  else score(cases[r["case"]], rd["recorded"])["score"])
            by[r["task"]]["reader-filled"].append(rd["filled"]["score"])
    cols = ["lookup", "filled", "reader-lookup", "reader-filled"]
    print(f"{path}: {len(recs)} cases")
    print("| task | " + " | ".join(cols) + " | changed (lookup -> filled) |")
    print("|---|" + "---|" * (len(cols) + 1))
    allv = defaultdict(list)
    for task, d in by.items():
        cells = []
        for c in cols:
            v = d.get(c, [])
            allv[c] += v
            if not v:
                cells.append("-"); continue
            lo, hi = bootstrap(v) if task == "aggregation" else wilson(sum(v), len(v))
            cells.append(f"{sum(v)/len(v):.2f} [{lo:.2f}, {hi:.2f}] n={len(v)}")
        ch = sum(a != b for a, b in zip(d["lookup"], d["filled"]))
        print(f"| {task} | " + " | ".join(cells) + f" | {ch} |")
    cells = []
    for c in cols:
        v = allv[c]
        if not v:
            cells.append("-"); continue
        lo, hi = bootstrap(v)
        cells.append(f"**{sum(v)/len(v):.3f}** [{lo:.2f}, {hi:.2f}] n={len(v)}")
    print("| **all** | " + " | ".join(cells) + " | |")
    print("sum of scores: lookup %.2f, filled %.2f" % (sum(allv["lookup"]), sum(allv["filled"])))

main(sys.argv[1], sys.argv[2])
