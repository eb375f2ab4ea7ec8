"""What the speed and quality benchmarks share: paths, the model, book prose cut to a token length, fixed-length
decoding, memory readings, and writing results."""
from __future__ import annotations

import json
import os
import platform
import re
import resource
import statistics
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # no model hub on this machine
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "bench" / "results"
BOOKS = SHARED / "books"


def load_engine(device: str | None = None, dtype: str | None = None, model: str = "embedded",
                decode_weights: str | None = None, prefill_weights: str | None = None):
    """The embedded model unless `model` names another (anything `--model` takes). dtype None: the engine's choice
    (fp32 on a CPU without bf16 matrix units); decode_weights and prefill_weights None: the engine's."""
    from engine import Engine
    return Engine.load(model, device=device, dtype=dtype, decode_weights=decode_weights,
                       prefill_weights=prefill_weights)


# ---- documents ---------------------------------------------------------------------------------------------
def book(name: str) -> str:
    return (BOOKS / name).read_text(encoding="utf-8")


_SENTENCE_END = re.compile(r"[.!?][\"'”’)]*\s")


def prose(tokenizer, tokens: int, name: str = "pg84.txt", start_char: int = 0) -> str:
    """About `tokens` tokens of book prose from `start_char` on, ending at a sentence end (never more than
    `tokens`). Wraps round to the start of the book when it runs out."""
    text = book(name)
    text = text[start_char:] + "\n\n" + text[:start_char]
    chunk = text[:tokens * 8]  # ~4.2 characters per token in English prose: 8 is always enough
    enc = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) <= tokens:
        return chunk
    limit = enc["offset_mapping"][tokens][0]
    ends = [m.end() for m in _SENTENCE_END.finditer(chunk, 0, limit)]
    return chunk[:ends[-1]].rstrip() if ends else chunk[:limit]


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def segment_tokens_for(text: str, tokenizer, segments: int) -> int:
    """The smallest segment size (in tokens) at which the engine cuts `text` into at most `segments` segments:
    sentences are packed whole, so the plain quotient usually gives one segment too many."""
    from engine.segment import segment
    size = -(-n_tokens(tokenizer, text) // segments)
    while len(segment(text, tokenizer, size).segments) > segments:
        size += max(8, size // 50)
    return size


# ---- decoding control ----------------------------------------------------------------------------------------
@contextmanager
def environment(name: str, value: str):
    """An engine setting (an environment variable the engine reads when it acts) set for the block, then as it was
    found."""
    held = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if held is None:
            del os.environ[name]
        else:
            os.environ[name] = held


@contextmanager
def fixed_length(*runners):
    """Decode every margin and answer to its full length (no stop token): every row then decodes exactly the
    same number of tokens, so a wall-time ratio compares reading patterns, not where the model chose to stop."""
    saved = [(r.stop_ids, r.early_stops) for r in runners]
    for r in runners:
        r.stop_ids, r.early_stops = set(), False  # nor a loop or a paragraph's end
    try:
        yield
    finally:
        for r, (ids, early) in zip(runners, saved):
            r.stop_ids, r.early_stops = ids, early


# ---- memory ----------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak-RSS mark (VmHWM) to the current RSS, so the next reading
    is the peak of what ran since. False where that is not possible (then the lifetime peak is reported)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024


# ---- numbers and output ----------------------------------------------------------------------------------------
def median(values) -> float:
    return float(statistics.median(values))


def timed(fn, reps: int) -> float:
    """The median seconds of `reps` calls of `fn`, after one warm-up call (first calls pay one-time costs)."""
    import time
    fn()
    seconds = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t)
    return median(seconds)


def machine() -> dict:
    import torch
    import transformers
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_results(out: Path, name: str, data: dict, markdown: str) -> tuple[Path, Path]:
    """`name`.json and `name`.md under `out`, each written whole (a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / f"{name}.json", out / f"{name}.md"
    for path, text in zip(paths, (json.dumps(data, indent=1, default=str), markdown)):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return paths


def cpu_name() -> str:
    """The CPU's model name, family and widest matrix instructions: seconds compare only on one CPU, and "AMD
    EPYC" alone names generations 2x apart (AVX2 only; AVX-512 BF16, no AMX)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines[:40])}
    flags = set(field.get("flags", "").split())
    isa = ("AMX" if "amx_bf16" in flags else "AVX-512 BF16, no AMX" if "avx512_bf16" in flags
           else "AVX-512, no BF16" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
    family = f", family {field['cpu family']}" if "cpu family" in field else ""
    return f"{name}{family} ({isa})"


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"
