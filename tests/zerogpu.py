"""A test double of ZeroGPU's process model, shaped like the `spaces` package (`spaces.GPU`): each call of a wrapped
function runs in a worker process forked from this one, its arguments and every value it yields are pickled on
the way, and between calls the worker is kept or replaced at random, as the platform may do, so nothing the
worker changed in its own memory can be relied on. A call that runs past the duration it asked for is aborted.

Not a mock of the model or the app: the real worker code runs, on the real model, in a real separate process.
The platform's own rules (huggingface.co/docs/hub/spaces-zerogpu): `@spaces.GPU` calls run in a forked worker,
arguments and results cross by pickling, a worker may be reused or replaced between calls, `duration` (seconds,
or a function of the call's arguments) is asked for up front and the call is aborted past it.
"""
from __future__ import annotations

import functools
import inspect
import multiprocessing
import pickle
import random
import time
import traceback

# The functions GPU wrapped, by name: registered in this process before any worker forks, so a worker finds the
# function a call names in its own (copied) memory, as a ZeroGPU worker does.
FUNCTIONS: dict[str, object] = {}
MAX_DURATION_S = 120  # the per-call maximum the double enforces (a `duration` above it is refused), as the app assumes


class Aborted(RuntimeError):
    """What the platform does to a call that runs past its duration (or asks for more than the maximum)."""


def _serve(conn) -> None:
    """A worker: run the calls sent down `conn` one after another, sending back each value pickled."""
    # On a CPU (here) torch computes with an OpenMP thread pool, which does not survive a fork: a child of a
    # parent that has computed hangs in its first parallel region unless it computes on one thread. (On
    # ZeroGPU the parent never computes, and the worker's work is on the GPU.)
    import torch
    torch.set_num_threads(1)
    while True:
        try:
            key, args, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            out = FUNCTIONS[key](*args, **kwargs)
            if inspect.isgenerator(out):
                for value in out:
                    conn.send_bytes(pickle.dumps(("yield", value)))
            else:
                conn.send_bytes(pickle.dumps(("return", out)))
            conn.send_bytes(pickle.dumps(("end", None)))
        except BaseException as e:  # reported to the caller, as the platform re-raises a worker's error
            conn.send_bytes(pickle.dumps(("error", "".join(traceback.format_exception(e)))))


class Worker:
    def __init__(self):
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)
        self.conn.close()


class Platform:
    """The double's state: the one worker (a ZeroGPU Space has one GPU slice a call), the random choice of
    keeping it between calls, and a record of every call."""

    def __init__(self, seed: int = 0, keep: float = 0.5, abort: bool = True, max_duration: int = MAX_DURATION_S):
        self.rng, self.keep, self.abort, self.max_duration = random.Random(seed), keep, abort, max_duration
        self.worker: Worker | None = None
        self.calls: list[dict] = []   # per call: name, duration asked, seconds taken, worker (fresh|reused), end

    def reset(self, seed: int = 0, keep: float = 0.5, abort: bool = True, max_duration: int = MAX_DURATION_S) -> None:
        """`abort` off: a call past its duration is recorded ("overran") instead of aborted, for a test on a
        shared CPU, whose speed is not the GPU's."""
        self.shutdown()
        self.rng, self.keep, self.abort, self.max_duration, self.calls = (random.Random(seed), keep, abort,
                                                                         max_duration, [])

    def shutdown(self) -> None:
        """Every worker gone (a restart of the Space, or the end of a test)."""
        if self.worker is not None:
            self.worker.kill()
            self.worker = None

    def _worker(self) -> tuple[Worker, str]:
        if self.worker is not None and self.worker.process.is_alive():
            return self.worker, "reused"
        self.worker = Worker()
        return self.worker, "fresh"

    def call(self, key: str, duration, args: tuple, kwargs: dict):
        asked = duration(*args, **kwargs) if callable(duration) else duration
        payload = pickle.dumps((key, args, kwargs))  # an argument that does not pickle fails here, as there
        record = {"name": key, "duration": asked, "seconds": None, "worker": None, "end": "running"}
        self.calls.append(record)
        if not 0 < asked <= self.max_duration:
            record["end"] = "refused"
            raise Aborted(f"{key} asked for {asked} s of GPU; the maximum is {self.max_duration} s")
        worker, record["worker"] = self._worker()
        started = time.monotonic()
        worker.conn.send_bytes(payload)
        try:
            while True:
                left = asked - (time.monotonic() - started)
                if self.abort and (left <= 0 or not worker.conn.poll(left)):
                    record["end"] = "aborted"
                    raise Aborted(f"{key} ran past the {asked} s it asked for")
                kind, value = pickle.loads(worker.conn.recv_bytes())
                if kind == "yield":
                    yield value
                elif kind == "return":
                    yield value
                elif kind == "error":
                    record["end"] = "error"
                    raise RuntimeError(f"the GPU worker failed:\n{value}")
                else:
                    record["end"] = "done"
                    return
        finally:
            record["seconds"] = time.monotonic() - started
            record["overran"] = record["seconds"] > asked
            if record["end"] == "running":
                record["end"] = "closed"  # the caller stopped taking values: the platform cancels the call
            if record["end"] != "done" or self.rng.random() >= self.keep:
                self.shutdown()  # its memory is gone; the next call forks a fresh worker from this process


PLATFORM = Platform()


def GPU(fn=None, *, duration=60, **_):
    """`@spaces.GPU` or `@spaces.GPU(duration=seconds or fn(*args, **kwargs))`."""
    def wrap(fn):
        key = f"{fn.__module__}.{fn.__qualname__}"
        FUNCTIONS[key] = fn

        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def stream(*args, **kwargs):
                yield from PLATFORM.call(key, duration, args, kwargs)
            return stream

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return list(PLATFORM.call(key, duration, args, kwargs))[0]
        return call

    return wrap(fn) if callable(fn) else wrap
