"""A reading's context windows, and the caches of those it has left behind, kept for follow-up questions: in
memory up to a budget, then on disk, and written to a folder when the reading is saved."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .events import Notice


@dataclass
class Window:
    """One context window of a reading: what remargin() needs to write new margins in it without reading
    its segments again. The live window is in the reading's cache; a window left behind keeps its cache in
    `tensors` (memory) or at `path` (safetensors), or nowhere (then a follow-up re-reads it)."""
    index: int
    prefix_ids: list[int]
    doc_end: int = 0                                           # cache length after its last segment
    boundaries: dict[int, int] = field(default_factory=dict)   # segment index -> cache length after it
    tensors: dict[str, torch.Tensor] | None = None
    path: str | None = None

    @property
    def segments(self) -> list[int]:
        return list(self.boundaries)

    @property
    def kept(self) -> bool:
        return self.tensors is not None or self.path is not None


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Windows:
    """Every window of one reading, in order (the last is the one being read), and where the caches of the
    others are kept. `keep_windows` off: none is kept (the caller asks no follow-ups); `disk`: past
    `budget_bytes` in memory, caches go to safetensors in a temporary folder removed with this object."""

    def __init__(self, budget_bytes: int, disk: bool, keep_windows: bool):
        self.budget_bytes, self.disk, self.keep_windows = budget_bytes, disk, keep_windows
        self.all: list[Window] = []
        self.kept_bytes = 0                                      # window caches held in memory
        self._spill: tempfile.TemporaryDirectory | None = None

    def start(self, index: int, prefix_ids: list[int], doc_end: int) -> Window:
        self.all.append(Window(index, list(prefix_ids), doc_end))
        return self.all[-1]

    def keep(self, window: Window, cache, sliding: bool) -> Notice | None:
        """Keep the cache (which holds `window`, up to its last segment) for remargin(): in memory while the
        budget allows, else on disk; a Notice when neither can take it."""
        if not self.keep_windows:  # no follow-up will be asked: keeping would cost for nothing
            return None
        if not hasattr(cache, "state") or sliding:
            return Notice(f"The cache of window {window.index + 1} is not kept ({cache.kind} cache): a "
                          "follow-up question will read that part again.")
        cache.truncate(window.doc_end)
        state = cache.state()
        size = state_bytes(state)
        if self.kept_bytes + size <= self.budget_bytes:
            window.tensors = {k: v.clone() for k, v in state.items()}
            self.kept_bytes += size
            return None
        why = f"{(self.kept_bytes + size) / 2**20:,.0f} MiB would pass the memory budget of " \
              f"{self.budget_bytes / 2**20:,.0f} MiB"
        if self.disk:
            try:
                if self._spill is None:
                    self._spill = tempfile.TemporaryDirectory(prefix="marginalia-windows-")
                free = shutil.disk_usage(self._spill.name).free
                if free < size + 256 * 2**20:
                    raise OSError(f"only {free / 2**20:,.0f} MiB free on disk")
                path = os.path.join(self._spill.name, f"window-{window.index}.safetensors")
                cache.save(path)
                window.path = path
                return None
            except OSError as e:
                why += f", and it could not be saved to disk ({e})"
        else:
            why += " and saving to disk is off"
        return Notice(f"The cache of window {window.index + 1} is not kept ({why}): a follow-up question will "
                      f"read segments {window.segments[0] + 1}-{window.segments[-1] + 1} again.")

    @staticmethod
    def load(window: Window, cache, device) -> None:
        """Put a kept window's cache back into `cache` (from disk: memory-mapped by safetensors and copied once
        into the preallocated buffers)."""
        if window.tensors is not None:
            tensors = window.tensors
        else:
            from safetensors.torch import load_file
            tensors = load_file(window.path)
        cache.load_state(tensors, device)

    def forget(self) -> None:
        for window in self.all:
            if window.path and self._spill and window.path.startswith(self._spill.name):
                Path(window.path).unlink(missing_ok=True)
        self.all.clear()
        self.kept_bytes = 0

    # ---- a saved reading's cache files ---------------------------------------------------------------
    def save(self, folder: Path, cache, max_bytes: int | None) -> list[dict]:
        """Write the windows' caches to `folder` (the last window's from `cache`, which holds it); their
        descriptions for the reading's saved metadata. `max_bytes` caps the files: the last window is always
        saved (answers need it), earlier ones newest first while the cap allows; the rest get no file."""
        from safetensors.torch import save_file
        last = self.all[-1]
        cache.truncate(last.doc_end)
        left = float("inf") if max_bytes is None else max_bytes - state_bytes(cache.state())
        saved = {last.index}
        for window in reversed(self.all[:-1]):
            size = (state_bytes(window.tensors) if window.tensors is not None
                    else os.path.getsize(window.path) if window.path else None)
            if size is not None and size <= left:
                saved.add(window.index)
                left -= size
        described = []
        for window in self.all:
            name = f"window-{window.index}.safetensors"
            if window.index not in saved:
                name = None  # not kept, or past max_bytes: a follow-up re-reads it
            elif window is last:
                cache.save(folder / name)
            elif window.tensors is not None:
                save_file({k: v.contiguous() for k, v in window.tensors.items()}, str(folder / name))
            else:
                shutil.copyfile(window.path, folder / name)
            described.append({"index": window.index, "prefix_ids": window.prefix_ids, "doc_end": window.doc_end,
                              "boundaries": list(window.boundaries.items()), "file": name})
        return described

    def restore(self, described: list[dict], folder: Path) -> None:
        """The windows of a saved reading, their caches left in `folder` until needed."""
        self.forget()
        for w in described:
            self.all.append(Window(w["index"], w["prefix_ids"], w["doc_end"], dict(map(tuple, w["boundaries"])),
                                   path=str(folder / w["file"]) if w["file"] else None))
