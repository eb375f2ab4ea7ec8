"""Shared fixtures: the real embedded model (fp32, so equalities can be exact) and the shared data folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Tests read with the 135M for speed (app.py and the CLI, run as child processes, inherit this); the ones that
# read with the default Qwen 1.5B name it with --model.
os.environ["MARGINALIA_MODEL"] = "embedded"


def pytest_collection_modifyitems(items):
    """Tests marked disk_heavy run first (a stable sort: the rest keep their order). The Space's clean venv takes
    ~11 GB while pip installs its CUDA torch (measured 2026-12-07); at the end of the suite the model cache has
    grown by ~7 GB more than at its start, and a CI machine's disk once could not hold both."""
    items.sort(key=lambda item: item.get_closest_marker("disk_heavy") is None)


def shared(*parts: str) -> Path:
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"fixture {path} is missing (../shared/data beside the checkout)")
    return path


@pytest.fixture(scope="session")
def engine():
    """The 135M in fp32, its decode passes on the GGUF's 4-bit blocks with fp32 sums (`gguf4`). The tests that
    use it compare two ways of computing the same thing within 1e-4; the default `gguf-q8` rounds a pass's inputs
    to int8 blocks, which turns a 1e-6 difference upstream into a whole rounding step (logits apart by ~0.5), so
    those comparisons would measure the rounding, not the paths. gguf-q8 itself is checked bit for bit against
    transformers' forward in tests/test_engine_packed.py."""
    from engine import Engine
    return Engine.load("embedded", device="cpu", dtype="fp32", decode_weights="gguf4")


@pytest.fixture(scope="session")
def engine64():
    """The same model in float64: there, chunked and one-pass prefill must agree to 1e-5 with no rounding slack."""
    from engine import Engine
    return Engine.load("embedded", device="cpu", dtype="fp64")


# fp32 attention kernels sum in a different order for a 200-token chunk than for a 900-token pass: measured
# differences reach 3.3e-5 on logits of magnitude ~10 (relative 3e-6); layer 0's keys/values are bit-identical.
TOLERANCE = {"engine64": 1e-5, "engine": 1e-4}


@pytest.fixture(params=["engine64", "engine"])
def any_engine(request):
    """(engine, tolerance) in float64 (the strict check) and in float32 (what users run)."""
    return request.getfixturevalue(request.param), TOLERANCE[request.param]


# ---------------------------------------------------------------- the app as a real server, and a real browser
# Generic helpers for tests/test_app_*.py: start `python app.py` on a free 127.0.0.1 port with its own data
# directory, and drive Debian's Chromium through Playwright (never `playwright install`).

import socket
import subprocess
import sys
import time
import urllib.request

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppServer:
    """`python app.py` in a subprocess. restart() keeps the data directory and the port (the browser's
    localStorage, hence its identity, belongs to the origin)."""

    def __init__(self, data_dir: Path, *args: str, port: int | None = None, log_path: Path | None = None,
                 python: str = sys.executable, env: dict | None = None):
        self.data_dir, self.args, self.python, self.extra_env = Path(data_dir), list(args), python, env or {}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or self.data_dir.parent / f"app-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> "AppServer":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
               "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1", **self.extra_env}
        cmd = [self.python, str(ROOT / "app.py"), "--no-browser", "--host", "127.0.0.1", "--port",
               str(self.port), "--data-dir", str(self.data_dir), *self.args]
        deadline = time.monotonic() + timeout
        for attempt in range(3):  # right after a kill the port can take a moment to come free
            self.log = open(self.log_path, "a", encoding="utf-8")
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(self.url + "/config", timeout=5) as r:
                        if r.status == 200:
                            return self
                except OSError:
                    time.sleep(0.5)
            self.log.close()
            if self.proc.poll() is None:
                self.stop()
                raise RuntimeError(f"app did not start in {timeout:.0f} s:\n{self.tail()}")
            if "address already in use" not in self.tail().lower() and "cannot find empty port" not in \
                    self.tail().lower():
                raise RuntimeError(f"app exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(2)
        raise RuntimeError(f"port {self.port} stayed busy:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc and not self.log.closed:
            self.log.close()

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the app can tell."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def restart(self) -> "AppServer":
        self.stop()
        return self.start()


@pytest.fixture(scope="session")
def chromium():
    """A headless Chromium (Debian's package) driven by Playwright; skips when it is not installed."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test does it as root)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


# ---------------------------------------------------------------- one app server and browser profile per module

@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """`python app.py` for the module, started with the module's SERVER_ARGS on its own data folder."""
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    app = AppServer(tmp_path_factory.mktemp(f"marginalia-{name}"), *request.module.SERVER_ARGS).start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def context(chromium, server):
    """One browser profile for the module: its localStorage holds the browser's identity."""
    ctx = chromium.new_context(viewport={"width": 1400, "height": 1000})
    yield ctx
    ctx.close()


@pytest.fixture
def page(context, server):
    page = context.new_page()
    page.goto(server.url)
    wait_ready(page)
    yield page
    page.close()


def wait_ready(page) -> None:
    """The page has loaded and the load event has run (the browser's id is known)."""
    page.wait_for_selector('#margin-panel .mg-panel[data-ready="1"]', timeout=60_000)


def reopen_page(page, url: str):
    """Load the app afresh in the same tab after a restart. Gradio may be reloading the tab itself as it finds
    the server back, which aborts or holds up our navigation (in CI: net::ERR_ABORTED once, a load event past
    30 s once): then navigate again. Only the DOM is waited for; the panel's ready flag says the app is up.
    (Opening a new tab and closing the old one instead hung in page.close() twice in 8 runs.)"""
    from playwright.sync_api import Error as PlaywrightError
    for attempt in range(3):
        try:
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            break
        except PlaywrightError:
            if attempt == 2:
                raise
            time.sleep(1)
    wait_ready(page)
    return page
