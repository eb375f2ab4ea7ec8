"""`python -m bench.gpu`: the engine on a GPU in one call of a few minutes, written to bench/results/gpu.md.

What a first GPU session needs to know: the device's name and its measured matmul rate in the model's dtype (bf16
on a GPU: an 8192-cube product), prefill tokens/s at 4k, 16k and 32k tokens with its FLOP/s as a share of that
rate, decode ms per token, and a WiM reading's wall time against a plain reading's of the same document, with the
attention that ran (flash-attn where it imports, else torch's SDPA). The model loads with `runs_as="cuda"`: the
choices a GPU makes (engine/model.py's load_model), so `--device cpu` runs the same path on a CPU, which is how
tests/test_gpu_path.py smoke-tests this script. Each section is written to the file as soon as it is measured and
a failing one is written as its error, so a run cut short still leaves what it measured.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from .common import BOOKS, ROOT, RESULTS, cpu_name, fixed_length, md_table
from .flops import Shape

LENGTHS = (4096, 16384, 32768)
DECODE_TOKENS = 64
BOOK = "pg84.txt"  # what bench.speed reads; the GPU machine has no shared data, so there the repository's prose
QUERY = "What is this text about, and what does its writer hope for?"


def default_dtype(device) -> str | None:
    """None on a GPU (the engine's choice there: bf16); on a CPU bf16 only where it has bf16 matrix units, since
    elsewhere bf16 is emulated (~100x slower) and fp32 runs the same path."""
    from engine.model import cpu_has_bf16_matrix_units
    if device.type != "cpu":
        return None
    return "bf16" if cpu_has_bf16_matrix_units() else "fp32"


def source_text() -> tuple[str, str]:
    """(what it is, the text): Frankenstein where the shared data is (bench.speed's book), else this repository's
    Markdown (README.md, docs/, the sample chapter), which travels to a GPU machine with the working tree."""
    if (BOOKS / BOOK).exists():
        text = (BOOKS / BOOK).read_text(encoding="utf-8")
        return f"{BOOK} (Frankenstein)", text[text.index("_To Mrs. Saville, England._"):]
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "data" / "sample" /
             "alice-down-the-rabbit-hole.md"]
    return "this repository's Markdown", "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.exists())


def at_least(text: str, n: int) -> str:
    """The text's first 8n characters (always more than n tokens of prose or Markdown), repeated where shorter."""
    return ((text + "\n\n") * (n * 8 // len(text) + 1))[:n * 8]


def token_ids(tokenizer, text: str, n: int) -> list[int]:
    """The text's first `n` tokens."""
    return tokenizer(at_least(text, n), add_special_tokens=False)["input_ids"][:n]


def document(tokenizer, text: str, n: int) -> str:
    """The text cut to at most `n` tokens, at a line's end where one is near."""
    text = at_least(text, n)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    cut = enc["offset_mapping"][n][0] if len(enc["input_ids"]) > n else len(text)
    line = text.rfind("\n", 0, cut)
    return text[:line if line > cut // 2 else cut].rstrip()


def synchronize(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device, dtype, size: int, reps: int = 10) -> float:
    """A size^3 product's rate on random data, the mean of `reps` after three warm-ups."""
    import torch
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    synchronize(device)
    return 2 * size ** 3 * reps / (time.perf_counter() - start) / 1e12


def prefill_row(runner, ids: list[int], shape: Shape, matmul: float, reps: int = 2) -> list:
    """[tokens, seconds, tokens/s, TFLOP/s, share of the matmul rate]: the best of `reps` prefills into a new
    cache, as a reading prefills (passes of PREFILL_CHUNK tokens through runner.prefill)."""
    best = float("inf")
    for _ in range(reps):
        cache = runner.new_cache(len(ids))
        synchronize(runner.device)
        start = time.perf_counter()
        runner.prefill(ids, cache)
        synchronize(runner.device)
        best = min(best, time.perf_counter() - start)
        del cache
    tflops = shape.prefill_flops(len(ids)) / best / 1e12
    return [f"{len(ids):,}", f"{best:.3f}", f"{len(ids) / best:,.0f}", f"{tflops:.3g}", f"{tflops / matmul:.1%}"]


def decode_row(runner, ids: list[int], tokens: int) -> list:
    """[context tokens, tokens decoded, ms per token]: `tokens` greedy steps after a prefill of `ids`, every one
    decoded (no stop token, bench.common.fixed_length)."""
    cache = runner.new_cache(len(ids) + tokens + 1)
    logits = runner.prefill(ids, cache)
    with fixed_length(runner):
        before = runner.meter.decode_tokens
        synchronize(runner.device)
        start = time.perf_counter()
        for _ in runner.decode(cache, logits, tokens):
            pass
        synchronize(runner.device)
        seconds = time.perf_counter() - start
        done = runner.meter.decode_tokens - before
    return [f"{len(ids):,}", done, f"{seconds / done * 1e3:.2f}"]


def reading_rows(engine, text: str, tokens: int) -> list[list]:
    """WiM and plain reading of one document (read and answer), wall time each, and their ratio. The prefill and
    decode sections before it have paid the model's first calls' one-time costs."""
    from engine import Margin, Settings, Stats
    common = dict(segment_tokens=max(32, tokens // 4), margin_tokens=48, answer_tokens=32, classifier="margin")
    rows, seconds = [], {}
    for label, mode in (("WiM", "wim"), ("plain reading", "llm")):
        start = time.perf_counter()
        events = list(engine.run(text, QUERY, Settings(mode=mode, **common)))
        seconds[label] = time.perf_counter() - start
        stats = [e for e in events if isinstance(e, Stats)]
        rows.append([label, f"{seconds[label]:.2f}", sum(s.prefill_tokens for s in stats),
                     sum(s.decode_tokens for s in stats), sum(isinstance(e, Margin) for e in events)])
    rows.append(["WiM / plain", f"{seconds['WiM'] / seconds['plain reading']:.2f}x", "", "", ""])
    return rows


class Report:
    """gpu.md, written whole (through a temporary file) after every section, so a run cut short leaves what it
    measured. `errors` counts the sections that failed (each written as its error)."""

    def __init__(self, path: Path, head: list[str]):
        self.path, self.parts, self.errors = path, list(head), 0
        self.write()

    def add(self, title: str, make, header: list[str]) -> None:
        print(f"[bench.gpu] {title} ...", flush=True)
        try:
            body = md_table(header, make())
        except Exception as error:  # one failing section (out of memory at 32k, say) must not lose the others
            self.errors += 1
            body = f"error: {error_line(error)}"
        self.parts.append(f"## {title}\n\n{body}")
        self.write()
        print(body, flush=True)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text("\n\n".join(self.parts) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def error_line(error: Exception) -> str:
    """The error's first line for gpu.md; its whole traceback to stderr, for the session that reads the log."""
    traceback.print_exception(error)
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def attention_label(attention: str) -> str:
    if attention == "flash_attention_2":
        return f"flash-attn {importlib.metadata.version('flash_attn')} (`flash_attention_2`)"
    return f"torch's SDPA (`{attention}`; flash-attn does not import here)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="anything --model takes (default: the Qwen 1.5B where its "
                        "parts are installed, else the embedded SmolLM2 135M)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.md")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prefill lengths in tokens, "
                        "comma-separated; the first that fits the model's window is also the decode context and "
                        "the WiM document's length")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="steps the decode row times")
    parser.add_argument("--device", default="auto", help="auto (cuda where there is one), cuda or cpu")
    parser.add_argument("--dtype", default=None, help="default: bf16 on a GPU; on a CPU bf16 only with bf16 "
                        "matrix units, else fp32")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]

    import torch
    import transformers
    from engine import Engine
    from engine.model import default_model, dtype_name, load_model, pick_device, pick_dtype

    model_spec = args.model or default_model()
    device = pick_device(args.device)
    dtype = args.dtype or default_dtype(device)
    command = " ".join(["python -m bench.gpu", *(sys.argv[1:] if argv is None else argv)])
    when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    report = Report(args.out, ["# The engine on a GPU's path", f"`{command}`, {when}. The model runs with a GPU's "
                               "choices (load_model's `runs_as=\"cuda\"`): the library's attention, transformers' "
                               "forward, nothing from engine/kernels, no decode packs."])
    matmul_dtype, matmul_size = pick_dtype(dtype, torch.device("cuda")), 8192 if device.type == "cuda" else 1024
    matmul = matmul_tflops(device, matmul_dtype, matmul_size)  # in the dtype the model loads in (below)
    report.add("Device", lambda: [
        ["device", torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_name()}"],
        ["matmul rate", f"{matmul:.3g} TFLOP/s ({dtype_name(matmul_dtype)}, {matmul_size}^3, mean of 10)"],
        ["torch, transformers", f"{torch.__version__}, {transformers.__version__}"]], ["", ""])

    loaded = []

    def model_rows():
        loaded.append(load_model(model_spec, device=str(device), dtype=dtype, runs_as="cuda"))
        lm, runner = loaded[0], loaded[0].runner()
        return [["model", f"{lm.name} (`--model {model_spec}`)"],
                ["context window", f"{lm.context_length:,} tokens"],
                ["dtype", dtype_name(lm.dtype)],
                ["attention", attention_label(lm.attention)],
                ["engine/prefill_step.py, engine/decode_step.py (a CPU's)",
                 "not used" if runner.prefill_step is None and runner.decode_step is None else "used"],
                ["document", source_text()[0]],
                ["load", f"{lm.load_seconds:.1f} s"]]

    report.add("Model", model_rows, ["", ""])
    if not loaded:
        return 1
    lm = loaded[0]
    engine, runner, shape = Engine(lm), lm.runner(), Shape.of(lm.model)
    text = source_text()[1]
    # The decode context and the WiM document: the first length that fits the window
    first = next((n for n in lengths if n <= lm.context_length), lm.context_length // 2)

    def prefill_rows():
        rows = []
        for n in lengths:
            if n > lm.context_length:
                rows.append([f"{n:,}", f"skipped: over the model's context window ({lm.context_length:,} tokens)",
                             "", "", ""])
                continue
            try:
                rows.append(prefill_row(runner, token_ids(lm.tokenizer, text, n), shape, matmul))
            except Exception as error:  # out of memory at 32k, say: the shorter rows stand
                report.errors += 1
                rows.append([f"{n:,}", f"error: {error_line(error)}", "", "", ""])
        return rows

    report.add("Prefill", prefill_rows, ["tokens", "seconds", "tokens/s", "TFLOP/s", "of the matmul rate"])
    report.add("Decode", lambda: [decode_row(runner, token_ids(lm.tokenizer, text, first), args.decode_tokens)],
               ["context tokens", "tokens decoded", "ms per token"])
    report.add(f"WiM against plain reading ({first:,} tokens, read and answered)",
               lambda: reading_rows(engine, document(lm.tokenizer, text, first), first),
               ["reading", "seconds", "prefill tokens", "decode tokens", "margins"])
    print(f"[bench.gpu] wrote {args.out}", flush=True)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
