"""app.py's default model on a Hugging Face Space follows the hardware it finds (no GPU here: the fallback, and
ZeroGPU known from its environment variable, since its main process must not touch CUDA)."""
from __future__ import annotations

import importlib.util

from conftest import ROOT


def load_app_py():
    spec = importlib.util.spec_from_file_location("marginalia_app_py", ROOT / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_space_default_follows_the_hardware(monkeypatch):
    app_py = load_app_py()
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert app_py.space_model() == app_py.SPACE_MODEL == "Qwen/Qwen2.5-Coder-1.5B-Instruct"  # this CPU
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    assert app_py.space_model() == app_py.SPACE_GPU_MODEL == "Qwen/Qwen2.5-7B-Instruct"
    monkeypatch.setenv("SPACE_ID", "someone/marginalia")
    monkeypatch.delenv("MARGINALIA_MODEL", raising=False)
    assert app_py.parse_args([]).model == "Qwen/Qwen2.5-7B-Instruct"
    monkeypatch.setenv("MARGINALIA_MODEL", "embedded")
    assert app_py.parse_args([]).model == "embedded"  # the variable still wins
    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("---\n")[1]
    for model in (app_py.SPACE_MODEL, app_py.SPACE_GPU_MODEL):
        assert readme.count(f"  - {model}\n") == 2  # listed in models: and preload_from_hub:
