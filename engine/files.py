"""Files and folders built aside and renamed into place, so that a half-written one is never taken for a finished
one, and two processes building the same one at once (two evaluation workers loading a model for the first time)
both end with it."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def partial_path(target: Path) -> Path:
    """Where this process builds `target` before `into_place` renames it there: a name of this process alone.
    What killed processes left half-built beside `target` is removed."""
    for old in target.parent.glob(f"{target.name}.partial*"):
        pid = old.name.rpartition("-")[2]
        if not (pid.isdigit() and _running(int(pid))):
            _remove(old)
    return target.with_name(f"{target.name}.partial-{os.getpid()}")


def into_place(tmp: Path, target: Path, replace: bool = False) -> None:
    """Rename `tmp` to `target` (atomic). Without `replace`, where another process put its copy there first, that
    one stays (it holds the same bytes) and this one goes; with it, what was at `target` goes."""
    if replace and target.exists():
        _remove(target)
    try:
        tmp.rename(target)
    except OSError:
        if not target.exists():
            raise
        _remove(tmp)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
