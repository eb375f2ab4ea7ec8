"""Saves a reading (every window's cache and what follow-up questions need) to a folder, and takes it up again
in this or another process: a finished reading's cache is what spares a follow-up a full re-read."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from .events import Event
from .files import into_place, partial_path
from .margin_writing import MarginNote
from .reading_state import ReadingState

SAVED = "reading.json"
# Settings that shape only the answers, not what a read leaves in the cache: a saved read is taken up whatever
# they say.
ANSWER_ONLY = ("answer_retries",)


def is_saved(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a saved reading (save() puts it in place whole, or not at all)."""
    return (Path(folder) / SAVED).exists()


def fingerprint(reading: ReadingState) -> str:
    """What a saved cache depends on: the model, the document's tokens and the settings."""
    lm = reading.engine.lm
    settings = reading.settings.to_dict()
    for name in ANSWER_ONLY:
        settings.pop(name)
    # a cache prefilled through int8 copies holds other values: its own fingerprint (the others' stay as they were)
    numerics = ["prefill=int8"] if getattr(lm, "prefill_int8", None) else []
    blob = json.dumps([lm.name, str(lm.dtype), settings,
                       hashlib.sha256(str(reading.doc.token_ids).encode()).hexdigest(), *numerics], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def save(reading: ReadingState, folder: str | os.PathLike, last_window_in_cache: Callable[[], Iterator[Event]],
         max_bytes: int | None = None) -> None:
    """Write every window's cache (safetensors) and what follow-up questions need (reading.json) to `folder`,
    replacing what was there; written aside first, so a half-written folder is never loaded. The last window goes
    back into the cache first (`last_window_in_cache()`: an answer's look-up may hold it). `max_bytes` caps the
    cache files: the last window is always saved (answers need it), earlier windows newest first while the cap
    allows; a follow-up re-reads the windows left out."""
    if not hasattr(reading.cache, "save"):
        raise RuntimeError(f"a {reading.cache.kind} cache cannot be saved")
    for _ in last_window_in_cache():  # its notices say nothing the reader needs here
        pass
    folder = Path(folder)
    partial = partial_path(folder)
    partial.mkdir(parents=True)
    windows = reading.window_store.save(partial, reading.cache, max_bytes)
    meta = {"fingerprint": fingerprint(reading), "query": reading.query, "window": reading.window,
            "read_segments": reading.read_segments, "windows": windows,
            "margins": [asdict(m) for m in reading.margins.values()]}
    (partial / SAVED).write_text(json.dumps(meta), encoding="utf-8")
    into_place(partial, folder, replace=True)


def restore_notes(reading: ReadingState, notes: list[MarginNote]) -> None:
    """Take up a reading's notes without its cache (a read whose cache was not kept, only its notes: a record of
    it): every segment counts as read, and the cache stays empty. An answer past the window, which re-reads its
    notes' passages, needs nothing more; one that needs the text in the cache says so."""
    reading.reset()
    reading.read_segments[:] = [s.index for s in reading.segments]
    reading.margins.update({n.index: n for n in notes})


def restore(reading: ReadingState, folder: str | os.PathLike) -> bool:
    """Take up a reading saved by save() (in this or another process): the last window goes into the cache, the
    others stay on disk until remargin() needs them. False if it was saved for another model, text or
    settings, or is missing."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / SAVED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if meta.get("fingerprint") != fingerprint(reading):
        return False
    reading.reset()
    reading.window_store.restore(meta["windows"], folder)
    reading.load_window(reading.windows[-1])
    reading.window, reading.query = meta["window"], meta["query"]
    reading.read_segments[:] = meta["read_segments"]
    reading.margins.update({m["index"]: MarginNote(**m) for m in meta["margins"]})
    return True
