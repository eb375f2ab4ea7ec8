"""WiM over a real vLLM (CPU build in .venv-vllm, `make vllm`) through its prefix cache: the server backend.

One server for the module, on loopback, serving the embedded model's converted folder; the tests read through
it with `Engine.load(..., backend="openai")` exactly as `--backend openai --base-url URL` does."""
from __future__ import annotations

import json
import threading

import pytest

from bench.vllm_server import BLOCK_TOKENS, VLLMServer, vllm_available
from engine import Settings
from engine.events import Answer, Margin, Notice, ServerRequest, Stats

from tests.conftest import shared

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(not vllm_available(), reason="no .venv-vllm: run `make vllm` (make test does)")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from engine.model import convert_embedded
    with VLLMServer(convert_embedded(), tmp_path_factory.mktemp("vllm") / "vllm.log", dev_mode=True) as running:
        yield running


@pytest.fixture(scope="module")
def remote(server):
    from engine import Engine
    engine = Engine.load("embedded", backend="openai", base_url=server.url)
    engine.lm.block_tokens = BLOCK_TOKENS
    return engine


def test_babilong_8k_through_vllm_reuses_the_prefix(remote):
    data = json.loads(shared("babilong", "babilong_8k.json").read_text())
    # Free-form notes and the YES/NO classifier: one generate and one yes/no request per segment.
    settings = Settings(segment_tokens=1024, margin_tokens=48, answer_tokens=32, margins="abstractive",
                        classifier="llm")
    reading = remote.open(data["context"], settings)
    instruction = len(remote.layout.suffix("margin", query=data["query"]))
    events = list(reading.read(data["query"]))
    margins = [e for e in events if isinstance(e, Margin)]
    assert [m.index for m in margins] == list(range(len(reading.segments)))
    assert len(reading.segments) >= 7
    # The requests of the read, in order: per segment the note's first step, the note, the classifier's yes/no.
    requests = [e for e in events if isinstance(e, ServerRequest)]
    assert all(r.cached_tokens is not None for r in requests), "start vLLM with --enable-prompt-tokens-details"
    first_steps = [r for r in requests if r.purpose == "margin step"]
    generate = [r for r in requests if r.purpose == "generate"]
    assert len(first_steps) == len(generate) == len(reading.segments)
    for seg, step, note in zip(reading.segments[1:], first_steps[1:], generate[1:]):
        # The first request after a segment carries it: the server computes the new segment and the
        # instruction, plus at most one partly filled block; the note's request then finds all of that cached.
        assert step.computed <= seg.tokens + instruction + BLOCK_TOKENS, (seg.index, step)
        assert note.computed <= BLOCK_TOKENS + 1, (seg.index, note)
        assert not step.evicted and not note.evicted
    read_stats = [e for e in events if isinstance(e, Stats)][-1]
    # Per segment: the note's first step (its relevance: P(NONE)), the note, the classifier's yes/no.
    assert read_stats.requests == 3 * len(reading.segments)
    assert read_stats.reuse > 0.5
    answer_events = list(reading.answer(data["query"]))
    answer = [e for e in answer_events if isinstance(e, Answer)][0]
    assert answer.text
    (request,) = [e for e in answer_events if isinstance(e, ServerRequest)]
    # The answer prompt follows the whole document, which the margins' requests left in the server's cache.
    assert request.computed <= request.prompt_tokens - request.shared_prefix + BLOCK_TOKENS
    print(f"\nbabilong_8k via vLLM: {len(margins)} margins, answer {answer.text!r}; "
          f"segments {[seg.tokens for seg in reading.segments]} tokens (instruction {instruction}); the request "
          f"after each computed {[r.computed for r in first_steps]} of {[r.prompt_tokens for r in first_steps]} "
          f"prompt tokens, its note's {[r.computed for r in generate]}; read reuse {read_stats.reuse:.1%}")


def test_extractive_margins_through_vllm(remote):
    """The default notes over a server: copied sentences of their own segment, chosen with one max_tokens=1
    request per branch of the sentence trie; each request finds everything before it in the prefix cache."""
    from tests.test_margins import assert_faithful
    data = json.loads(shared("babilong", "babilong_8k.json").read_text())
    reading = remote.open(data["context"], Settings(segment_tokens=1024, margin_tokens=48, answer_tokens=32))
    instruction = len(remote.layout.suffix("margin_extractive", query=data["query"]))
    events = list(reading.read(data["query"]))
    margins = [e for e in events if isinstance(e, Margin)]
    assert [m.index for m in margins] == list(range(len(reading.segments)))
    assert_faithful(reading, margins)
    copy = [e for e in events if isinstance(e, ServerRequest) and e.purpose == "margin step"]
    assert len(copy) >= len(reading.segments)  # at least the first step of every note
    longest = max(seg.tokens for seg in reading.segments)
    for request in copy[1:]:
        assert request.computed <= longest + instruction + 48 + BLOCK_TOKENS, request
        assert not request.evicted
    answer = [e for e in reading.answer(data["query"]) if isinstance(e, Answer)][0]
    assert answer.text and answer.ending != "limit"


def test_two_readings_at_once_both_complete(server, remote):
    """Two readings through the same server at the same time (as two app sessions would): the server batches
    them, both finish, and each reports its own reuse. The prefix cache starts empty (the first test read the
    same text: its blocks would count as this reading's reuse)."""
    server.reset_prefix_cache()
    data = json.loads(shared("babilong", "babilong_8k.json").read_text())
    text = data["context"]
    jobs = {"first half": text[:len(text) // 2], "second half": text[len(text) // 2:]}
    settings = Settings(segment_tokens=512, margin_tokens=24, answer_tokens=16)
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(name: str, part: str) -> None:
        try:
            results[name] = list(remote.run(part, data["query"], settings))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors, errors
    for name, events in results.items():
        reading_stats = [e for e in events if isinstance(e, Stats) and e.phase == "read"][0]
        assert [e for e in events if isinstance(e, Answer)], name
        assert not [e for e in events if isinstance(e, Notice) and "evicted" in e.text], name
        assert reading_stats.reuse > 0.3, (name, reading_stats)
        print(f"\n{name}: {reading_stats.requests} requests, reuse {reading_stats.reuse:.1%}")


def test_follow_up_margins_through_vllm_leave_out_the_later_text(remote):
    """remargin(): a new question's margin at boundary i is sent as the text up to segment i and the
    instruction (the local engine masks; a server is sent the shorter prompt), so it equals a fresh read's."""
    data = json.loads(shared("babilong", "babilong_8k.json").read_text())
    text = data["context"][:6000]
    settings = Settings(segment_tokens=400, margin_tokens=16, classifier="none")
    first = remote.open(text, settings)
    list(first.read("Where is Mary?"))
    again = [e for e in first.remargin(data["query"]) if isinstance(e, Margin)]
    fresh = remote.open(text, settings)
    direct = [e for e in fresh.read(data["query"]) if isinstance(e, Margin)]
    assert [m.text for m in again] == [m.text for m in direct]


def test_cli_reads_through_the_server(server, tmp_path, capsys):
    """`python -m engine read ... --backend openai --base-url URL`: the reuse figures reach the JSON events; a
    missing URL or an unreachable server is a clear error (exit 2), not a traceback."""
    from engine.cli import main
    from tests.conftest import free_port
    data = json.loads(shared("babilong", "babilong_8k.json").read_text())
    doc = tmp_path / "short.json"
    doc.write_text(json.dumps({"context": data["context"][:3000], "query": data["query"]}))
    assert main(["read", str(doc), "--backend", "openai", "--base-url", server.url, "--segment-tokens", "300",
                 "--margin-tokens", "8", "--answer-tokens", "8", "--jsonl"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    stats = [e for e in events if e["event"] == "stats"]
    assert [s["phase"] for s in stats] == ["read", "answer"]
    # Extractive notes (the default): a request where a note's sentence trie branches, at least one a note.
    assert stats[0]["requests"] >= sum(e["event"] == "margin" for e in events) > 0
    assert stats[0]["cached_tokens"] > 0 and 0 < stats[0]["reuse"] < 1
    assert main(["read", str(doc), "--backend", "openai"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert main(["read", str(doc), "--backend", "openai", "--base-url", f"http://127.0.0.1:{free_port()}/v1"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_an_evicted_prefix_is_flagged(server, remote):
    """The server's prefix cache emptied between two margins (as eviction under load would): the next margin
    request recomputes the text before it, and the events say so."""
    data = json.loads(shared("babilong", "babilong_8k.json").read_text())
    reading = remote.open(data["context"][:4000], Settings(segment_tokens=300, margin_tokens=8, classifier="none"))
    events = []
    for ev in reading.read(data["query"]):
        events.append(ev)
        if isinstance(ev, Margin) and ev.index == 0:
            server.reset_prefix_cache()
    # A margin's requests are reported after its Margin event: those after segment 1 was read came after the reset.
    seg1 = next(i for i, e in enumerate(events) if e.kind == "segment" and e.index == 1)
    before = [e for e in events[:seg1] if isinstance(e, ServerRequest)]
    after = [e for e in events[seg1:] if isinstance(e, ServerRequest)]
    assert before and len(after) >= 2 and not any(r.evicted for r in before)
    assert after[0].evicted and after[0].computed == after[0].prompt_tokens  # nothing was left to reuse
    assert not any(r.evicted for r in after[1:])
    assert [e for e in events if isinstance(e, Notice) and "evicted" in e.text]


def test_two_app_sessions_read_through_the_server_at_once(server, tmp_path):
    """The app on `--backend openai`: two API clients (two app sessions, two owners) read different documents
    at the same time. The engine's queue lets both through (a local model would run them one after the other:
    the second's first margin would come only after the first reading's end); both finish with a margin for
    every segment, and each reports its own prefix-cache reuse."""
    import time

    from gradio_client import Client, handle_file

    from tests.conftest import AppServer
    server.reset_prefix_cache()
    data = json.loads(shared("babilong", "babilong_8k.json").read_text())
    text = data["context"]
    docs = {}
    for name, part in {"first": text[:len(text) // 2], "second": text[len(text) // 2:]}.items():
        docs[name] = tmp_path / f"{name}.txt"
        docs[name].write_text(part, encoding="utf-8")
    app = AppServer(tmp_path / "data", "--backend", "openai", "--base-url", server.url, "--no-warm-up",
                    log_path=tmp_path / "app.log").start()
    try:
        seen: dict[str, dict] = {}   # name -> {"first_margin": t, "done": t, "result": ...}
        errors: list[BaseException] = []

        def read(name: str) -> None:
            try:
                client = Client(app.url, verbose=False)
                job = client.submit(handle_file(str(docs[name])), data["query"], 400, 24, 16, "margin", "",
                                    api_name="/read")
                times = seen[name] = {}
                while not job.done():
                    if "first_margin" not in times and any(o.get("segments_read", 0) >= 1 for o in job.outputs()):
                        times["first_margin"] = time.monotonic()
                    time.sleep(0.05)
                times["result"] = job.result(timeout=900)
                times["done"] = time.monotonic()
                times.setdefault("first_margin", times["done"])
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=read, args=(name,)) for name in docs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        assert not errors, errors
        first, second = sorted(seen.values(), key=lambda t: t["done"])
        # Both were reading at once: the later one had a margin before the earlier one finished.
        assert second["first_margin"] < first["done"], (first, second)
        owners = set()
        for name, times in seen.items():
            result = times["result"]
            owners.add(result["owner"])
            assert result["status"] == "read", (name, result)
            assert [m["segment"] for m in result["margins"]] == list(range(result["segments_total"]))
            assert result["server_prompt_tokens"] > 0 and 0.3 < result["reuse"] < 1, (name, result)
            print(f"\n{name}: {result['segments_total']} segments, {result['server_prompt_tokens']} prompt tokens "
                  f"sent, reuse {result['reuse']:.1%}, {times['done'] - times['first_margin']:.1f} s after the "
                  f"first margin")
        assert len(owners) == 2
    finally:
        app.stop()
