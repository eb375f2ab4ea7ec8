"""The notes a recorded read would have with the evidence's proposals (engine/evidence.py), without reading again:
each segment's recorded note completed, as MarginWriting.complete does, by the segment's sentences whose MiniLM
similarity to the question reaches `cut`, while the note's token cap holds them; `hop`: then every sentence of the
document whose similarity to a sentence of a kept note reaches `hop` joins its own segment's note (not adopted
unless the table says so). Counted by bench/notes.py.

    .venv/bin/python bench/results/proposals/simulate.py bench/results/eval-16k --cuts 0.4,0.45,0.5 --cap 96
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.common import segment_tokens_for  # noqa: E402
from bench.notes import count, markdown, summarise  # noqa: E402
from bench.tasks import make_case  # noqa: E402
from engine.classify import embed  # noqa: E402
from engine.margins import pieces_of  # noqa: E402
from engine.segment import segment  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("folders", nargs="+", type=Path)
parser.add_argument("--cuts", default="0.4,0.45,0.5")
parser.add_argument("--hops", default="none")
parser.add_argument("--cap", type=int, default=96)
parser.add_argument("--tasks", default=None)
parser.add_argument("--n", type=int, default=None, help="at most this many cases a task")
args = parser.parse_args()

from transformers import AutoTokenizer  # noqa: E402
from engine.model import resolve  # noqa: E402
tok = AutoTokenizer.from_pretrained(resolve("qwen2.5-1.5b")[0])
cuts = [float(c) for c in args.cuts.split(",")]
hops = [None if h == "none" else float(h) for h in args.hops.split(",")]
for folder in args.folders:
    data = json.loads((folder / "eval.json").read_text())
    meta = data["meta"]
    counts = {(c, h): {} for c in cuts for h in hops}
    base = {}
    seen = {}
    for c in data["cases"]:
        read = c["records"].get("wim-read")
        task, length, index = c["case"].split("/")
        if not read or (args.tasks and task not in args.tasks.split(",")):
            continue
        seen[task] = seen.get(task, 0) + 1
        if args.n and seen[task] > args.n:
            continue
        case = make_case(task, int(length), int(index), tok, meta.get("seed", 0))
        size = min(segment_tokens_for(case.text, tok, meta["segments"]), meta["max_segment_tokens"])
        doc = segment(case.text, tok, size)
        pieces = [pieces_of(case.text, s.char_start, s.char_end, tok, args.cap) for s in doc.segments]
        flat = [(k, p) for k, ps in enumerate(pieces) for p in ps]
        v = embed([case.query, *(" ".join(p.text.split()) for _, p in flat)])
        sim = (v[1:] @ v[0]).tolist()
        pair = v[1:] @ v[1:].T
        notes = {int(i): t for i, t in read["margins"].items()}
        if len(notes) != len(doc.segments):
            print(f"{c['case']}: {len(notes)} notes, {len(doc.segments)} segments: skipped", file=sys.stderr)
            continue
        base[c["case"]] = (case, count(case, read, tok))
        for cut in cuts:
            for hop in hops:
                text = dict(notes)
                room = {k: args.cap - (len(tok.encode(t, add_special_tokens=False)) if t else 0) for k, t in notes.items()}
                chosen = set()
                for j, (k, p) in enumerate(flat):
                    if sim[j] >= cut and p.text not in text[k] and len(p.ids_after) <= room[k]:
                        text[k] = f"{text[k]} {p.text}" if text[k] else p.text
                        room[k] -= len(p.ids_after)
                        chosen.add(j)
                if hop is not None:
                    kept = [j for j, (k, p) in enumerate(flat) if j in chosen or (notes[k] and p.text in notes[k])]
                    if kept:
                        near = (pair[kept] >= hop).any(0).tolist()
                        for j, (k, p) in enumerate(flat):
                            if near[j] and p.text not in text[k] and len(p.ids_after) <= room[k]:
                                text[k] = f"{text[k]} {p.text}" if text[k] else p.text
                                room[k] -= len(p.ids_after)
                counts[(cut, hop)][c["case"]] = (case, count(case, {"margins": text}, tok))
        print(c["case"], file=sys.stderr, flush=True)
    print(f"### {folder}: the recorded notes\n\n{markdown(summarise(base))}\n")
    for (cut, hop), got in counts.items():
        print(f"### completed at cut {cut}, hop {hop}, cap {args.cap}\n\n{markdown(summarise(got))}\n", flush=True)
