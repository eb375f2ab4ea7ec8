"""The 36 tuning cases at 16k: notes latest first against the default order (made again in the same run), the
recorded default answers (answer_prompts-16k-seed1-n6 and question-first/cases-6-8/default) for agreement."""
import glob, json, sys
from collections import defaultdict
here = sys.argv[1]
recs = {}
for p in glob.glob(f"{here}/*/records.jsonl"):
    for l in open(p):
        r = json.loads(l); recs[(r["case"], r["candidate"])] = r
old = {}
for p in glob.glob("bench/results/answer_prompts-16k-seed1-n6/*/records.jsonl") + \
        glob.glob("bench/results/answer_prompts-16k-seed1-question-first/cases-6-8/default/records.jsonl"):
    for l in open(p):
        r = json.loads(l); old[(r["case"], r["candidate"])] = r
cases = sorted({c for c, _ in recs})
for cand in ("list+emb-or-rel", "list-reversed+emb-or-rel", "plain"):
    per = defaultdict(float)
    for c in cases:
        per[c.split("/")[0]] += recs[(c, cand)]["score"]
    print(f"| {cand} | {len(cases)} | {sum(per.values()) / len(cases):.3f} | " +
          " | ".join(f"{per[t]:.2f}" for t in ("babilong", "multihop", "aggregation", "hotpotqa")) + " |")
same = sum(recs[(c, "list+emb-or-rel")]["prediction"] == old[(c, "list+emb-or-rel")]["prediction"] for c in cases)
samep = sum(recs[(c, "plain")]["prediction"] == old[(c, "plain")]["prediction"] for c in cases)
print("default made again equals the recorded answer:", same, "of", len(cases), "; plain:", samep)
ch = [(c, recs[(c, "list+emb-or-rel")]["score"], recs[(c, "list-reversed+emb-or-rel")]["score"]) for c in cases
      if recs[(c, "list+emb-or-rel")]["score"] != recs[(c, "list-reversed+emb-or-rel")]["score"]]
print("changed:", ch)
cut = sum(recs[(c, "list-reversed+emb-or-rel")]["ending"] not in ("end",) for c in cases)
print("reversed endings other than end:", cut)
