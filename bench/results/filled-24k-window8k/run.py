"""Past the window: the kept notes' passages (the default look-up) against the same passages plus, in the room
left, the passages the margins scored likeliest (answer_style "filled"), answered from a bench.eval folder's
recorded reads (their notes taken up without a cache, as bench.eval does for wim-passages), so no case is read
again. The look-up's answer was made again on the first cases (it must equal the recorded wim-combined answer; the
first 5 records of each seed, written by an earlier version of this script, made both answers on every case);
where the filled window holds the look-up's passages, the answer is the same greedy computation and is not made.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/results/filled-24k-window8k/run.py FOLDER SEED OUT [SHARD/N]
"""
import json, sys, time
from pathlib import Path
from engine import Answer
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
    # A measurement script: it re-makes the answer window's passages from the recorded reads, so it reaches into
    # the answering's private steps (no public API gives the passages a window would re-read without answering).
    def passages(selection, fill):
        reading, _ = ev.wim_read(case, ev.settings(case, "wim"), notes_only=read)
        a = reading.answering
        return a._passages_that_fit(case.query, a._chosen(selection), None,
                                    reading.limit - len(reading.layout.prefix), fill)

    def answered(selection, recorded, first=False):
        """The look-up's answer (recorded; made again and compared on the first cases) and the filled one (made
        only where its passages differ from the look-up's: else the same greedy computation)."""
        out = {}
        own, filled = passages(selection, False), passages(selection, True)
        styles = ["lookup", "filled"] if first else ["filled"] if filled != own else []
        for style in styles:
            reading, _ = ev.wim_read(case, ev.settings(case, "wim"), notes_only=read)
            t = time.perf_counter()
            answer = [e for e in reading.answer(case.query, margins=selection, style=style)
                      if isinstance(e, Answer)][0]
            out[style] = {"prediction": answer.text, "score": score(case, answer.text)["score"],
                          "passages": answer.passages, "seconds": round(time.perf_counter() - t, 1)}
        if "lookup" in out:
            assert out["lookup"]["prediction"] == recorded and out["lookup"]["passages"] == own, c["case"]
        out.setdefault("lookup", {"prediction": recorded, "score": score(case, recorded)["score"], "passages": own,
                                  "from_record": True})
        out.setdefault("filled", {**out["lookup"], "passages": filled, "same_as_lookup": True})
        return out

    rec.update(answered(chosen, rec["recorded"], first=len(done) < 2))
    if "wim-reader" in c["records"]:  # a reader's marks, answered the filled way too
        marked = [int(i) for i, keep in read["verdicts"]["reader"].items() if keep]
        rec["reader"] = {"kept": marked, **answered(marked, c["records"]["wim-reader"]["prediction"])}
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    done.add(c["case"])
    print(c["case"], rec["recorded_score"], rec["lookup"]["score"], rec["filled"]["score"],
          rec["lookup"]["passages"], rec["filled"]["passages"], flush=True)
