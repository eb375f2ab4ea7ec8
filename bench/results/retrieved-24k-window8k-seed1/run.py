"""Past the window: the look-up (kept notes' passages) against the look-up with the retriever's passages (the
rag_top_k segments closest to the question by MiniLM, as the RAG baseline picks them) added:
  rag-fill:  the kept notes' passages first (highest-scored first), then the retriever's in the room left;
  rag-first: the retriever's passages first, then the kept notes' (highest-scored first) in the room left.
Answered from a bench.eval folder's recorded reads (notes taken up without a cache); an answer is made only where
the passages differ from the look-up's (else it is the same greedy computation).
    OMP_NUM_THREADS=1 PYTHONPATH=. python run.py FOLDER SEED OUT [SHARD/N]
"""
import json, sys, time
from pathlib import Path
import torch
from engine import Answer
import engine.answering as A
from bench.common import load_engine
from bench.eval import Evaluator, score
from bench.tasks import make_case

folder, seed, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
k, n = (int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "0/1").split("/"))
data = json.loads((folder / "eval.json").read_text())
meta = data["meta"]
engine = load_engine(None, None, "qwen2.5-1.5b")
tok = engine.lm.tokenizer
ev = Evaluator(engine, meta["margin_tokens"], meta["segments"], meta["max_segment_tokens"], "extractive",
               8192, None, meta.get("copy_choice") or "opening")
MODE = {"v": None}
_orig = A.Answering._passages_that_fit

def patched(self, query, notes, template, room, fill=False):
    if MODE["v"] is None:
        return _orig(self, query, notes, template, room, fill)
    r = self.reading
    every_note = self._prompt(query, A.note_lines(notes, list(notes), lambda i: A.note_label(r.segments[i])), template)
    room -= len(every_note) + self._room_for(template)
    scores = r._note_scores()
    noted = sorted(notes, key=lambda i: (-scores.get(i, 1.0), i))
    texts = [r.doc.segment_text(s) for s in r.segments]
    from engine.classify import embed
    v = embed([query, *texts], "cpu")
    sim = v[1:] @ v[0]
    retrieved = torch.argsort(sim, descending=True).tolist()[:r.settings.rag_top_k]
    if MODE["v"] == "rag-fill":
        candidates = noted + [i for i in retrieved if i not in notes]
    else:
        candidates = retrieved + [i for i in noted if i not in retrieved]
    chosen, used = [], 0
    for i in candidates:
        if used + r.segments[i].tokens <= room:
            chosen.append(i); used += r.segments[i].tokens
    return sorted(chosen)
A.Answering._passages_that_fit = patched

out.parent.mkdir(parents=True, exist_ok=True)
done = {json.loads(l)["case"] for l in out.read_text().splitlines()} if out.exists() else set()
cases = [c for c in data["cases"] if c["task"] in ("babilong", "multihop", "aggregation", "hotpotqa")]
for c in cases[k::n]:
    if c["case"] in done or "wim-combined" not in c["records"]:
        continue
    task, length, index = c["case"].split("/")
    case = make_case(task, int(length), int(index), tok, seed)
    assert case.query == c["query"], c["case"]
    read = c["records"]["wim-read"]
    chosen = [int(i) for i, keep in read["verdicts"]["combined"].items() if keep]
    rec = {"case": c["case"], "task": task, "kept": chosen, "recorded": c["records"]["wim-combined"]["prediction"],
           "recorded_score": c["records"]["wim-combined"]["score"]}
    def passages(v):
        MODE["v"] = v
        reading, _ = ev.wim_read(case, ev.settings(case, "wim"), notes_only=read)
        a = reading.answering
        return a._passages_that_fit(case.query, a._chosen(chosen), None, reading.limit - len(reading.layout.prefix))
    own = passages(None)
    rec["lookup"] = {"prediction": rec["recorded"], "score": score(case, rec["recorded"])["score"], "passages": own}
    first = len(done) < 1
    for v in (["lookup"] if first else []) + ["rag-fill", "rag-first"]:
        ps = passages(None if v == "lookup" else v)
        if v != "lookup" and ps == own:
            rec[v] = {**rec["lookup"], "passages": ps, "same_as_lookup": True}
            continue
        MODE["v"] = None if v == "lookup" else v
        reading, _ = ev.wim_read(case, ev.settings(case, "wim"), notes_only=read)
        t = time.perf_counter()
        answer = [e for e in reading.answer(case.query, margins=chosen, style="lookup") if isinstance(e, Answer)][0]
        res = {"prediction": answer.text, "score": score(case, answer.text)["score"], "passages": answer.passages,
               "seconds": round(time.perf_counter() - t, 1)}
        if v == "lookup":
            assert res["prediction"] == rec["recorded"], (res["prediction"], rec["recorded"])
        else:
            rec[v] = res
    MODE["v"] = None
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    done.add(c["case"])
    print(c["case"], rec["lookup"]["score"], rec["rag-fill"]["score"], rec["rag-first"]["score"],
          own, rec["rag-fill"]["passages"], rec["rag-first"]["passages"], flush=True)
