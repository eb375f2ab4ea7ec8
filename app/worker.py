"""The engine worker: the only code that runs the model.

`engine_job(job, stop)` takes plain data (a dict of str/int/list/dict, the engine's Settings and the document's
segments) and yields the engine's events. On a
Hugging Face ZeroGPU Space it is wrapped by `spaces.GPU`, which runs it in another process with a GPU
attached: so it touches neither the database nor the Gradio session, its arguments and events must
pickle, and a threading.Event cannot be passed in (the caller stops consuming instead; see `run`).
Everywhere else `spaces.GPU` is a no-op and the stop flag reaches the engine, which checks it before
every forward pass.

Readings (a document in a KV cache) are kept in a small LRU keyed by session id, so a follow-up question
on the same document reuses the cache instead of reading the document again. Each cache holds the
model's whole context window (~380 MB for SmolLM2-135M), hence at most two.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from collections import OrderedDict
from typing import Iterator

from engine.events import Event, SegmentRead, Stats
from engine import Engine, Reading, Settings

try:  # the `spaces` package is a no-op off Hugging Face Spaces
    import spaces
except Exception:  # pragma: no cover - optional dependency
    spaces = None

log = logging.getLogger(__name__)

ZERO_GPU = os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")
MAX_READINGS = 2
# Engine jobs that run at once on a model server (--backend openai): the server batches their requests, so
# readings need not wait for each other. A local model runs one job at a time (one forward pass at a time, and
# a KV cache of the whole context window each).
SERVER_JOBS = max(1, int(os.environ.get("MARGINALIA_SERVER_JOBS", "4")))

_engine: Engine | None = None
_readings: "OrderedDict[str, tuple[str, Reading]]" = OrderedDict()
_readings_lock = threading.Lock()


def job_slots(engine: Engine | None = None) -> int:
    """How many engine jobs may run at once on this engine (the app's queue lets that many through)."""
    engine = engine or _engine
    return 1 if engine is None or engine.lm.serial else SERVER_JOBS


def set_engine(engine: Engine) -> None:
    global _engine
    _engine = engine
    clear()


def clear() -> None:
    with _readings_lock:
        _readings.clear()


def cached_sessions() -> list[str]:
    with _readings_lock:
        return list(_readings)


def forget(session_id: str) -> None:
    with _readings_lock:
        _readings.pop(session_id, None)


def signature(text: str, settings: Settings, page_starts, model: str) -> str:
    """What a Reading depends on: the same signature means the same segments and the same cache."""
    blob = json.dumps([hashlib.sha256(text.encode()).hexdigest(), settings.to_dict(), page_starts, model],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _reading(job: dict) -> Reading:
    sig = signature(job["text"], job["settings"], job["page_starts"], _engine.lm.name)
    sid = job["session_id"]
    with _readings_lock:
        hit = _readings.get(sid)
        if hit and hit[0] == sig:
            _readings.move_to_end(sid)
            return hit[1]
        _readings.pop(sid, None)
        while len(_readings) >= max(MAX_READINGS, job_slots()):
            old, _ = _readings.popitem(last=False)
            log.info("dropping the cached reading of session %s", old)
    # The app segmented the document already (app/layouts.py): the job carries its segments.
    reading = _engine.open(job["text"], job["settings"], job["page_starts"], segmented=job["segmented"])
    with _readings_lock:
        _readings[sid] = (sig, reading)
    return reading


# ZeroGPU: a call asks for its duration up front, is counted against the visitor's quota on what it asks, and is
# aborted past it; a duration above the platform's per-call maximum is refused (the `spaces` client reports only
# "larger than the maximum allowed"; the platform's docs use 120 s as their example of a long call).
GPU_MAX_SECONDS = int(os.environ.get("MARGINALIA_GPU_MAX_SECONDS", "120"))
GPU_START_SECONDS = 10  # a fresh worker: the fork, the model's first touch of the GPU, a saved cache loaded
GPU_SLACK = 1.5         # the estimate comes from rates measured on earlier texts, not this one


def gpu_seconds(estimate_s: float) -> int:
    """The duration a call with `estimate_s` seconds of engine work asks for (before GPU_MAX_SECONDS)."""
    return math.ceil(GPU_START_SECONDS + GPU_SLACK * max(estimate_s, 0.0))


def fits_one_call(estimate_s: float) -> bool:
    return gpu_seconds(estimate_s) <= GPU_MAX_SECONDS


def _gpu_seconds(job: dict, stop=None) -> int:
    """The duration this job asks ZeroGPU for: job["estimate_s"], from the app's measured rates and the work
    (the caller refuses a job that does not fit one call, so the cap here never cuts a job short)."""
    return min(GPU_MAX_SECONDS, gpu_seconds(float(job.get("estimate_s") or 0.0)))


def engine_job(job: dict, stop: threading.Event | None = None) -> Iterator[Event]:
    """job["kind"] == "read": read the document (skipping job["skip"] margins) and write margins.
    job["kind"] == "answer": make sure segments 0..job["last"] are in the cache (loaded from the reading
    saved in job["cache_dir"] after a restart, else re-read without writing margins), then answer from
    job["selection"] (segment index -> margin text). A finished read is saved to job["cache_dir"] before its
    last event (Stats) is yielded."""
    if _engine is None:
        raise RuntimeError("the engine is not loaded")
    reading = _reading(job)
    try:
        if job["kind"] == "read":
            skip = {int(k): v for k, v in (job.get("skip") or {}).items()}
            for ev in reading.read(job["query"], stop, skip=skip):
                # Saved before the reading's last event reports it done: this process may be gone by the next
                # call (a ZeroGPU worker, a restart), and the saved cache is all a follow-up then finds.
                if isinstance(ev, Stats) and not ev.stopped and job.get("cache_dir") and len(
                        reading.read_segments) == len(reading.segments):
                    _save(reading, job["cache_dir"])
                yield ev
            return
        last = int(job["last"])
        if not reading.read_segments and job.get("cache_dir"):
            try:  # a restart: the saved cache, if it is this reading's
                reading.restore(job["cache_dir"])
            except Exception:  # a damaged file: read the document again instead
                log.exception("could not load the saved cache in %s", job["cache_dir"])
        if not reading.read_segments or max(reading.read_segments) < last:
            skip = {i: "" for i in range(last + 1)}
            skip.update({int(k): v for k, v in (job.get("skip") or {}).items()})
            events = reading.read(job["query"], stop, skip=skip)
            try:
                for ev in events:
                    if isinstance(ev, Stats):
                        if ev.stopped:
                            yield ev
                            return
                        break
                    if isinstance(ev, SegmentRead):
                        yield ev
                        if ev.index >= last:
                            break
            finally:
                events.close()
        selection = {int(k): v for k, v in (job.get("selection") or {}).items()}
        yield from reading.answer(job["question"], margins=selection, stop=stop)
    except BaseException:
        forget(job["session_id"])  # a cache left half-written is not worth keeping
        raise


# Disk a session's saved cache may take: a whole novel is ~40 windows of up to 360 MiB (SmolLM2, fp32). Past the
# cap the earliest windows are not saved, and a follow-up on them reads that part again.
SAVED_CACHE_BYTES = int(float(os.environ.get("MARGINALIA_SAVED_CACHE_MB", "2048")) * 2**20)


def _save(reading: Reading, folder: str) -> None:
    """Save a finished reading's cache for follow-ups after a restart; a failure costs only that."""
    try:
        reading.save(folder, max_bytes=SAVED_CACHE_BYTES)
    except (OSError, RuntimeError):
        log.exception("could not save the cache of a reading to %s", folder)


if spaces is not None:
    engine_job = spaces.GPU(duration=_gpu_seconds)(engine_job)


def run(job: dict, stop: threading.Event) -> Iterator[Event]:
    """Drive engine_job for a request handler. Off ZeroGPU the engine sees `stop` itself (a Stop takes
    effect within one forward pass); on ZeroGPU the job runs in another process, so the handler stops
    taking events and closes the generator instead."""
    events = engine_job(job, None if ZERO_GPU else stop)
    try:
        for ev in events:
            yield ev
            if ZERO_GPU and stop.is_set():
                yield Stats(0, 0, 0.0, 0.0, 0, phase=job["kind"], stopped=True)
                return
    finally:
        events.close()
