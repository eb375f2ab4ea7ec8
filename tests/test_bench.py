"""Smoke tests of the benchmark instruments: both `--quick` runs finish and write well-formed results.

They check the shape of the output (every row, every mode and task, numbers where numbers belong), never that a
target is reached: timings on a shared CI machine say nothing. The scoring helpers are checked exactly.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench.tasks import TASKS, make_case
from tests.conftest import ROOT, shared


def _run(module: str, out, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, "--quick", "--out", str(out), *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
def test_speed_quick(tmp_path):
    shared("books", "pg84.txt")
    done = _run("bench.speed", tmp_path)
    data = json.loads((tmp_path / "speed.json").read_text())
    md = (tmp_path / "speed.md").read_text()
    rows = data["rows"]
    assert sorted(rows) == ["1_wim_vs_plain", "2_naive_vs_wim", "3_reference_vs_wim", "4_prefill_efficiency",
                            "5_decode_and_truncate", "6_followup", "7_memory"]
    for key in ("1_wim_vs_plain", "2_naive_vs_wim", "3_reference_vs_wim", "6_followup"):
        assert rows[key] and all(_number(r["ratio"]) and r["ratio"] > 0 for r in rows[key]), key
    assert all(r["identical"] for r in rows["3_reference_vs_wim"])
    for r in rows["1_wim_vs_plain"]:  # token accounting of both sides
        assert all(_number(r["tokens"][m][k]) for m in ("wim", "plain") for k in ("prefill", "decode"))
        # WiM feeds what plain reading does not: the instructions, the copied notes, the notes in the answer
        assert r["tokens"]["wim"]["prefill"] > r["tokens"]["plain"]["prefill"]
    assert len(rows["4_prefill_efficiency"]) == 3
    assert all(_number(r["ratio"]) and _number(r["gflops"]) for r in rows["4_prefill_efficiency"])
    assert any(_number(r["all_logits_ratio"]) for r in rows["4_prefill_efficiency"])
    assert all(_number(v) for v in rows["5_decode_and_truncate"]["ratio"].values())
    assert {r["mode"] for r in rows["7_memory"]} == {"wim", "plain", "naive", "reference"}
    assert all(_number(r["ratio"]) and r["peak_bytes"] > r["weights_bytes"] for r in rows["7_memory"])
    assert _number(data["meta"]["gemm"]["linear_gflops"])
    for row in range(1, 8):
        assert f"| {row} |" in md
    assert "identical: True" in done.stdout


@pytest.mark.slow
def test_prefill_quick(tmp_path):
    shared("books", "pg84.txt")
    _run("bench.prefill", tmp_path)
    data = json.loads((tmp_path / "prefill_embedded.json").read_text())
    assert [r["tokens"] for r in data["rows"]] == [256, 640]
    for r in data["rows"]:
        assert all(_number(r[k]) and r[k] > 0 for k in ("ratio", "gflops", "linear_gflops", "attention_kernel_gflops",
                                                        "linears_in_order_gflops", "ratio_to_in_order",
                                                        "forward_seconds", "forward_ratio"))  # both ways, one run
        shares = r["last_pass_time_shares"]
        assert all(0 <= v <= 1 for v in shares.values()) and shares["linears"] > 0 and shares["attention"] > 0
    assert "| 640 |" in (tmp_path / "prefill_embedded.md").read_text()


@pytest.mark.slow
def test_eval_quick(tmp_path):
    """The way the README's table was made: cases generated once, run from the file, summarised by --report."""
    shared("babi", "qa1_single-supporting-fact_test.txt")
    cases = tmp_path / "cases.jsonl.gz"
    _run("bench.eval", tmp_path, "--dump-cases", str(cases))
    all_modes = ("--modes", "wim,llm,llm-read,rag,margins-only")
    _run("bench.eval", tmp_path, "--cases", str(cases), *all_modes)
    data = json.loads((tmp_path / "eval.json").read_text())
    md = (tmp_path / "eval.md").read_text()
    from bench.eval import MODES
    from bench.tasks import TASKS
    cells = {(r["task"], r["mode"]): r for r in data["results"]}
    assert set(cells) == {(t, m) for t in (*TASKS, "all") for m in MODES}
    for (task, _), r in cells.items():
        assert r["n"] == (len(TASKS) - ("unanswerable" in TASKS) if task == "all" else 1)
        assert _number(r["score"]) and 0 <= r["lo"] <= r["score"] <= r["hi"] <= 1
    for mode in MODES:  # overall: the mean of the scored tasks' cases
        scored = [cells[(t, mode)]["score"] for t in TASKS if t != "unanswerable"]
        assert abs(cells[("all", mode)]["score"] - sum(scored) / len(scored)) < 1e-9
    for task in TASKS:
        assert f"| {task} |" in md
    assert all(m in md for m in MODES) and "n=1" in md and data["meta"]["model"] in md
    # --report rebuilds the same table from the records alone, running nothing.
    (tmp_path / "eval.md").unlink()
    _run("bench.eval", tmp_path, "--cases", str(cases), *all_modes, "--report")
    assert (tmp_path / "eval.md").read_text() == md
    # Plain reading answered from the wim read, checked against its own read of the same case.
    assert all(c["records"]["llm"]["shared_read"] for c in data["cases"])
    assert data["meta"]["agreement"]["n"] == len(data["cases"]) and "the same answer on" in md
    assert data["meta"]["context_limit"] == 8192  # the embedded model's window, recorded
    # bench.relevance scores the classifiers on the same records: each WiM read's segments count once each.
    from bench.relevance import reads, summarise
    records = reads([tmp_path / "eval_cases.jsonl"])
    segments = sum(r["segments"] for r in records)
    summary = summarise(records, [0.5])
    assert records and summary["segments"] == segments
    for m in summary["classifiers"].values():
        assert 0 <= m["precision"] <= 1 and 0 <= m["recall"] <= 1 and m["kept"] <= segments
    assert summary["classifiers"]["none"]["kept"] == sum(bool(t) for r in records for t in r["margins"].values())
    # bench.notes counts what the same reads' notes copied, from the records alone.
    from transformers import AutoTokenizer
    from bench.notes import folder_counts, summarise as note_rows
    from engine.model import resolve
    _, counts = folder_counts(tmp_path, AutoTokenizer.from_pretrained(resolve("embedded")[0]))
    rows = {r["task"]: r for r in note_rows(counts)}
    for task in ("babilong", "multihop", "aggregation", "hotpotqa", "squad"):
        r = rows[task]
        assert r["gold"] > 0 and 0 <= r["found"] <= r["gold"] and 0 <= r["copied_gold"] <= r["copied"]
        assert 0 < r["share_mean"] <= r["share_max"] < 1 or r["copied"] == 0
    assert rows["unanswerable"]["recall"] is None and rows["all"]["n"] == len(TASKS) - 1


@pytest.mark.slow
def test_book_quick(tmp_path):
    """The whole-book row: the CLI run in windows, its events read back into one result."""
    shared("books", "pg1342.txt")
    done = _run("bench.book", tmp_path)
    r = json.loads((tmp_path / "book.json").read_text())["result"]
    assert r["windows"] >= 2 and r["segments"] == r["segments_total"] == r["margins"] > r["windows"]
    spans = [tuple(e["char_span"]) for e in map(json.loads, (tmp_path / "book_events.jsonl").read_text().splitlines())
             if e["event"] == "segment"]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # in order, none twice
    assert [a["query"] for a in r["answers"]] == [r["query"], r["follow_up"]]
    # Not read again: a follow-up re-reads at most one window (its notes' passages or, with none kept, the
    # passages the margins scored likeliest), never the book.
    from bench.book import QUICK_ARGS
    window = int(QUICK_ARGS[QUICK_ARGS.index("--context-limit") + 1])
    assert r["follow_up_answer"]["prefill_tokens"] <= window < r["read"]["prefill_tokens"]
    assert _number(r["ratio"]) and 0 < r["ratio"] and r["peak_rss_bytes"] > 2**27
    assert "follow-up / first read" in (tmp_path / "book.md").read_text() and "answer:" in done.stdout


@pytest.mark.slow
def test_eval_shard_runs_only_its_cases(tmp_path):
    cases = tmp_path / "cases.jsonl.gz"
    _run("bench.eval", tmp_path, "--dump-cases", str(cases))
    from bench.eval import read_cases
    mine = read_cases(cases)[3::4]
    _run("bench.eval", tmp_path, "--cases", str(cases), "--shard", "3/4", "--modes", "llm")
    records = [json.loads(line) for line in (tmp_path / "eval_cases.shard3.jsonl").read_text().splitlines()]
    assert sorted(r["case"] for r in records) == sorted(c.key for c in mine) and {r["mode"] for r in records} == {"llm"}
    _run("bench.eval", tmp_path, "--cases", str(cases), "--modes", "llm", "--report")
    results = json.loads((tmp_path / "eval.json").read_text())["results"]
    counts = {r["task"]: r["n"] for r in results if r["task"] != "all"}
    assert counts == {c.task: int(c.task in {m.task for m in mine}) for c in read_cases(cases)}
    from bench.tasks import FIXED_TASKS
    overall = [r["n"] for r in results if r["task"] == "all"]
    assert overall == [sum(m.task not in (*FIXED_TASKS, "unanswerable") for m in mine)]


def test_scoring():
    from bench.eval import bootstrap, list_score, short_score, wilson
    assert short_score("The bathroom.", ["bathroom"])["exact"]
    assert short_score("Sandra is in the bathroom", ["bathroom"])["contained"]
    assert not short_score("bath", ["bathroom"])["contained"]
    assert not short_score("I do not know", ["no"])["contained"]   # whole words only
    gold = ["lantern", "compass", "music box"]
    s = list_score("1. lantern, 2. music box, 3. kettle", gold)
    assert s["precision"] == pytest.approx(2 / 3) and s["recall"] == pytest.approx(2 / 3)
    assert list_score("", gold)["score"] == 0
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    assert wilson(0, 10)[0] == 0 and bootstrap([1.0] * 5) == (1.0, 1.0)


def test_babilong_check():
    """BABILong's own check: the first sentence names the gold place and no other (the question's aside)."""
    from bench.eval import babilong_score, score
    from bench.tasks import Case
    q = "Where is Daniel?"
    assert babilong_score("Daniel is in the garden.", ["garden"], q)["score"] == 1
    moves = babilong_score("Daniel went to the bedroom and the garden.", ["garden"], q)
    assert moves["score"] == 0 and moves["contained"]   # two places named: wrong, though the gold one is among them
    assert babilong_score("The garden. Earlier he was in the kitchen.", ["garden"], q)["score"] == 1
    assert babilong_score("Daniel is not mentioned.", ["garden"], q)["score"] == 0
    assert babilong_score("From the kitchen to the hallway", ["hallway"], "Where was the milk before the kitchen?"
                          )["score"] == 1
    case = Case("babilong", 16000, 0, "", q, ["garden"])
    assert score(case, "Daniel went to the bedroom [segment 3] and the garden [segment 9].")["score"] == 0
    assert score(case, "Daniel is in the garden [segment 9].")["score"] == 1


def test_rescore_an_eval_folder(tmp_path):
    """bench.rescore scores a folder's recorded answers again, and --write leaves eval.md's table beside them."""
    from bench.rescore import main
    record = {"mode": "wim-combined", "prediction": "Daniel went to the bedroom and the garden [segment 6].",
              "score": 1.0, "exact": False, "contained": True, "seconds": 1.0}
    plain = {**record, "mode": "llm", "prediction": "Daniel is in the garden."}
    meta = {"model": "m", "dtype": "bfloat16", "lengths": [24000], "segments": 8, "max_segment_tokens": 1024,
            "margin_tokens": 64, "context_limit": 8192, "seed": 0, "tasks": ["babilong"],
            "modes": ["wim-combined", "llm"]}
    cases = [{"case": "babilong/24000/4", "task": "babilong", "length": 24000, "query": "Where is Daniel?",
              "answers": ["garden"], "info": {}, "records": {"wim-combined": record, "llm": plain}}]
    (tmp_path / "eval.json").write_text(json.dumps({"meta": meta, "cases": cases}))
    assert main(["--write", str(tmp_path)]) == 0
    rescored = (tmp_path / "rescored.md").read_text()
    assert "| babilong | 24000 | 0.00 [0.00, 0.79] n=1 | 1.00 [0.21, 1.00] n=1 |" in rescored


def test_cases_are_reproducible_and_sized():
    shared("books", "pg1342.txt")
    from transformers import AutoTokenizer
    from engine.model import convert_embedded
    from bench.common import n_tokens
    from bench.tasks import TASKS, make_case
    tok = AutoTokenizer.from_pretrained(str(convert_embedded()))
    for task in TASKS:
        a, b, c = (make_case(task, 1500, i, tok) for i in (0, 0, 1))
        assert a.text == b.text and a.query == b.query and a.answers == b.answers
        assert a.text != c.text
        assert 0.85 * 1500 <= n_tokens(tok, a.text) <= 1.1 * 1500
        if task in ("babilong", "multihop"):
            needles = a.info.get("chain", [])
            assert all(n in a.text for n in needles)


@pytest.mark.slow
def test_eval_takes_up_kept_reads(tmp_path):
    """--reads keeps each case's wim read (cache and record); a later run answers from it without reading again,
    with the answers a fresh read gives."""
    shared("babi", "qa1_single-supporting-fact_test.txt")
    reads = tmp_path / "reads"
    first, second = tmp_path / "first", tmp_path / "second"
    _run("bench.eval", first, "--task", "babilong,multihop", "--modes", "wim-margin", "--reads", str(reads))
    _run("bench.eval", second, "--task", "babilong,multihop", "--modes", "wim-margin,wim-reader",
         "--reads", str(reads))

    def records(folder):
        lines = (folder / "eval_cases.jsonl").read_text().splitlines()
        return {(r["case"], r["mode"]): r for r in map(json.loads, lines)}

    a, b = records(first), records(second)
    reads_a = {k: r for k, r in a.items() if k[1] == "wim-read"}
    assert len(reads_a) == 2 and sorted(p.name for p in reads.iterdir()) == ["babilong-500-0", "multihop-500-0"]
    for key, read in reads_a.items():
        assert b[key]["seconds"] == read["seconds"] and b[key]["margins"] == read["margins"]  # not read again
        case = key[0]
        assert b[(case, "wim-margin")]["prediction"] == a[(case, "wim-margin")]["prediction"]
        assert (case, "wim-reader") in b


def test_note_recall_matches_gold_sentences_to_copied_ones():
    """A gold sentence counts once it is copied: held by a piece (a HotpotQA title before it), or covered by the
    pieces the engine cut it into; each piece and each repeat of a gold sentence counts once."""
    from bench.notes import match
    assert match(["Ann went home.", "Bob is tall and thin."], ["Ann went home.", "People: Bob is tall and thin.",
                                                               "It rained."]) == (2, 2)
    assert match(["The ledger records one lantern."] * 3, ["The ledger records one lantern."] * 2) == (2, 2)
    assert match(["He sailed to the U.S. and stayed there for years."],
                 ["He sailed to the U.S.", "and stayed there for years."]) == (1, 2)
    assert match(["He sailed to the U.S. and stayed there for years."], ["He sailed to the U.S."]) == (0, 0)


def test_gold_sentences_are_the_facts_that_decide_each_answer():
    from transformers import AutoTokenizer
    from bench.notes import gold_sentences, ledger_entries
    from engine.model import resolve
    tok = AutoTokenizer.from_pretrained(resolve("embedded")[0])
    shared("babi", "qa1_single-supporting-fact_test.txt")
    for index in range(4):
        case = make_case("babilong", 2000, index, tok, seed=5)
        gold = gold_sentences(case)
        assert 1 <= len(gold) <= 2 and set(gold) <= set(case.info["gold"]) and all(g in case.text for g in gold)
    case = make_case("multihop", 2000, 0, tok, seed=5)
    assert gold_sentences(case) == case.info["chain"]
    case = make_case("aggregation", 2000, 0, tok, seed=5)
    entries = ledger_entries(case.text)
    assert gold_sentences(case) == entries and len(entries) == 10 * case.info["per_common"] + 20 * case.info["per_rare"]
    case = make_case("hotpotqa", 4000, 0, tok, seed=5)
    gold = gold_sentences(case)
    assert len(gold) >= 2 and all(" ".join(g.split()) in " ".join(case.text.split()) for g in gold)
    case = make_case("squad", 2000, 0, tok, seed=5)
    assert len(gold_sentences(case)) == 1 and any(a in gold_sentences(case)[0] for a in case.answers)
