"""The app's service under ZeroGPU's process model (tests/zerogpu.py, a `spaces`-shaped double): every engine call
runs in a forked worker that may be kept or replaced between calls, with its arguments and events pickled. Upload,
a reading with live margins, Stop, Resume, an answer, a follow-up, a second reading and a restart must all work
without relying on anything a worker kept in memory; a follow-up that finds no warm worker loads the saved cache."""
from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import pytest

import zerogpu
from app import render
from app.records import AnswersChanged, Message
from app.service import Defaults, Service, UserError
from app.storage import Store
from conftest import SHARED

DEFAULTS = Defaults(segment_tokens=64, margin_tokens=8, answer_tokens=8, classifier="none")
CPU_MAX_SECONDS = 120 * 50
RE_READ = "Loading the document into memory first"  # what an answer says while it reads the document again


@pytest.fixture
def zero_gpu():
    """app.worker as a ZeroGPU Space loads it: `spaces` is the double, SPACES_ZERO_GPU is set."""
    from app import worker
    saved = {k: os.environ.get(k) for k in ("SPACES_ZERO_GPU", "MARGINALIA_GPU_MAX_SECONDS")}
    real = sys.modules.get("spaces")
    sys.modules["spaces"] = zerogpu
    os.environ["SPACES_ZERO_GPU"] = "true"
    # A shared 2-core CPU is some fifty times slower than a GPU slice: the per-call maximum scaled alike (both
    # the app's and the double's), and no timed aborts (how long a call takes here depends on the load).
    os.environ["MARGINALIA_GPU_MAX_SECONDS"] = str(CPU_MAX_SECONDS)
    zerogpu.PLATFORM.reset(seed=3, keep=0.5, abort=False, max_duration=CPU_MAX_SECONDS)
    importlib.reload(worker)
    assert worker.ZERO_GPU and worker.engine_job.__wrapped__.__module__ == "app.worker"
    try:
        yield zerogpu.PLATFORM
    finally:
        zerogpu.PLATFORM.shutdown()
        if real is None:
            sys.modules.pop("spaces", None)
        else:
            sys.modules["spaces"] = real
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        importlib.reload(worker)


def upload(service: Service, tmp_path: Path, book: str, start: int, chars: int = 1500) -> int:
    path = tmp_path / f"{book}-{start}.txt"
    path.write_text((SHARED / "books" / book).read_text(encoding="utf-8")[start:start + chars], encoding="utf-8")
    doc_id, _ = service.add_upload(str(path))
    return doc_id


def read_to_the_end(service: Service, owner: str, sid: str, resume: bool = False) -> list[str]:
    """The panel's statuses as the reading goes; at the one that says done, the saved cache is on disk and recorded
    already."""
    statuses = []
    for e in service.read_stream(owner, sid, resume=resume):
        if getattr(e, "panel", None):  # PanelChanged, and the panel a job starts and ends with
            statuses.append(e.panel.status)
            if e.panel.status == "done":
                session = service.store.get_session(sid)
                assert session["status"] == "read" and session["cache_path"], "done before the cache was saved"
                assert (Path(service.data_dir) / session["cache_path"] / "reading.json").exists()
    assert statuses[-1] == "done"
    return statuses


def ask(service: Service, owner: str, sid: str, question: str) -> str:
    """Answer `question`; the document must not be read again (a warm worker, or the saved cache)."""
    service.start_answer(owner, sid, question)
    notes, messages = "", []
    for e in service.answer_stream(owner, sid, question):
        if isinstance(e, AnswersChanged):
            notes += "".join(a.note for a in e.answers)
        elif isinstance(e, Message) and e.text:
            messages.append(e.text)
    assert RE_READ not in notes, "the answer read the document again: the worker's reading was gone"
    assert not messages, messages
    answer = service.store.answers(sid)[-1]
    assert answer["question"] == question and answer["text"].strip()
    return answer["text"]


@pytest.mark.slow
def test_the_service_under_zerogpus_process_model(engine, tmp_path, zero_gpu, capsys):
    from app import worker
    db = tmp_path / "marginalia.db"
    service = Service(engine, Store(db), DEFAULTS)
    # No warm-up, as on ZeroGPU (the main process has no GPU): the rates each call's duration is asked from are
    # the defaults, then those learned from the readings' own Stats.
    owner = "alice"

    # Upload, read with live margins, Stop after the second margin.
    doc = upload(service, tmp_path, "pg11.txt", 5000)
    sid = service.start_read(owner, doc, "Who does Alice follow?", service.settings())
    total = service.store.get_session(sid)["segments_total"]
    assert total >= 5
    live, stopped = [], False
    for e in service.read_stream(owner, sid):
        if getattr(e, "panel", None):
            live.append(render.panel_html(e.panel))  # drawn as it comes, as the screen draws it
        if not stopped and len(service.store.margins(sid)) >= 2:
            stopped = service.stop(owner, sid)
    session = service.store.get_session(sid)
    assert stopped and session["status"] == "stopped" and 2 <= len(service.store.margins(sid)) < total
    assert 'data-status="stopped"' in live[-1]
    streamed = [p.count("mg-card") for p in live if 'data-status="reading"' in p]
    assert max(streamed) >= 2 and sorted(streamed) == streamed  # margins appeared one by one while it read
    assert zero_gpu.calls[-1]["end"] == "closed"                 # Stop cancelled the GPU call

    # Resume in whatever worker the platform gives: the kept margins are not written again.
    kept = {m["segment_index"]: m["text"] for m in service.store.margins(sid)}
    service.start_resume(owner, sid)
    read_to_the_end(service, owner, sid, resume=True)
    margins = service.store.margins(sid)
    assert len(margins) == total and all(m["text"] == kept[m["segment_index"]] for m in margins if m["segment_index"] in kept)

    # An answer and a follow-up.
    ask(service, owner, sid, "Who does Alice follow?")
    ask(service, owner, sid, "What is the rabbit holding?")

    # A second reading of another document, and a question about it.
    doc2 = upload(service, tmp_path, "pg84.txt", 20000)
    sid2 = service.start_read(owner, doc2, "Where is the ship?", service.settings())
    read_to_the_end(service, owner, sid2)
    ask(service, owner, sid2, "Where is the ship?")

    # A restart: every worker gone, new Service and Store objects; follow-ups on both readings.
    zero_gpu.shutdown()
    service = Service(engine, Store(db), DEFAULTS)
    ask(service, owner, sid, "Is Alice tired?")
    ask(service, owner, sid2, "Who writes the letters?")

    # Nothing ran in this process, and the platform did what it may: fresh workers and reused ones.
    assert worker.cached_sessions() == []
    workers = [c["worker"] for c in zero_gpu.calls]
    assert all(c["name"] == "app.worker.engine_job" for c in zero_gpu.calls)
    assert workers.count("fresh") >= 3 and "reused" in workers, workers
    assert [c["end"] for c in zero_gpu.calls].count("done") == len(zero_gpu.calls) - 1  # all but the Stop

    # Durations: each call asked for what its work needs (the service's measured rates times the work), never
    # more than the platform's per-call maximum.
    with capsys.disabled():
        print("\nGPU calls (worker, seconds asked, seconds taken, end):",
              [(c["worker"], c["duration"], round(c["seconds"], 1), c["end"]) for c in zero_gpu.calls])
    # (Whether a call finished within what it asked depends on this CPU's load, so it is printed, not asserted.)
    asked = [c["duration"] for c in zero_gpu.calls]
    assert all(0 < d <= worker.GPU_MAX_SECONDS for d in asked) and len(set(asked)) > 1

    # A reading too long for one GPU call is refused before it starts, with the estimate and what to do.
    service.rates = {"prefill": 0.05, "decode": 0.005}  # as slow as a machine where this text takes hours
    calls = len(zero_gpu.calls)
    with pytest.raises(UserError, match=r"about .+ of GPU time.+shorter text.+log in.+your own machine"):
        service.start_read(owner, doc, "Who does Alice follow?", service.settings())
    assert len(zero_gpu.calls) == calls
