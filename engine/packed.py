"""Decode steps on the GGUF file's own 4-bit weights: its Q4_0, Q4_1 and Q4_K blocks packed for torch's int4
CPU kernel, used by passes of a few rows (a decode step, a margin's copy decision); longer passes keep the
full weights.

Why: a decode step reads every weight once, so its time is the weights' bytes. The layers of the Qwen 1.5B are
1.1 G values stored as Q4_K in its GGUF: 2.2 GB in bf16, 0.56 GB as 4-bit groups of 32 with a scale and an
offset each. torch's `_weight_int4pack_mm_for_cpu` multiplies one row by them in ~0.35x the time of bf16's
matmul, but 32 rows take it 3.5-4.5x as long and 512 rows 6-17x (`python -m bench.decode_weights`), so the
full weights stay for prefill: the packs are memory added to the weights (0.625 bytes per value, against bf16's
2: 663 MiB for the 1.5B, 63 MiB for the 135M).

The packs hold the file's values, not a re-quantization of them: a Q4_1 block is `d * q + m`, a Q4_K sub-block
`d * sc * q - dmin * m`, and each is one affine group of 32 (the kernel's `(q - 8) * scale + zero`). Each packed
matrix is checked against the weight transformers de-quantized from the same file (equal up to the dtype's
rounding) when the packs are built, once per converted model (kept beside its folder); a matrix that is not
(another architecture's row order, other values) stays unpacked.
Q6_K and Q8_0 tensors (the 1.5B's output matrix and half its value and down projections) stay unpacked too.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

GROUP = 32          # values per scale and offset: a Q4_0/Q4_1 block, a Q4_K sub-block
DECODE_ROWS = 4     # passes of at most this many rows use the packs (the crossover measured by bench.decode_weights)
INNER_K_TILES = 1   # the packing's innerKTiles argument (a CUDA tiling); the CPU layout was measured with 1

# GGUF tensor names (per block) -> the module transformers loads them into, for llama and qwen2 layouts.
_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


class PackedLinear(torch.nn.Linear):
    """A linear layer with its full weight (passes of many rows) and the same values in 4-bit groups (few rows)."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor, scales_zeros: torch.Tensor):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > DECODE_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(rows, x.shape[-1]), self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def groups_of(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, scale, low) of a 4-bit GGUF tensor's raw blocks [rows, bytes]: q [rows, cols] in 0..15, scale and low
    [rows, cols / 32] float32, so that value = scale * q + low (exactly gguf-py's de-quantization)."""
    rows = blocks.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = blocks.reshape(rows, -1, size)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        qs = b[..., size - 16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)           # low nibbles: values 0-15, high: 16-31
        low = (-8 * d) if kind == "Q4_0" else b[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        return q.reshape(rows, -1), d, low
    if kind == "Q4_K":
        from gguf.quants import Q4_K
        b = blocks.reshape(rows, -1, 144)                            # 256 values: d, dmin, 12 bytes of scales, 128 of q
        n = b.shape[1]
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(b[..., 4:16].reshape(rows * n, 12))
        scale = d * sc.reshape(rows, n, 8).astype(np.float32)
        low = -(dmin * m.reshape(rows, n, 8).astype(np.float32))
        qs = b[..., 16:].reshape(rows, n, 4, 1, 32)                  # 4 chunks of 64 values: low nibbles, then high
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)
        return q.reshape(rows, -1), scale.reshape(rows, -1), low.reshape(rows, -1)
    raise ValueError(f"not a 4-bit block type: {kind}")


def _llama_rows(rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives a llama q/k matrix from GGUF (its `_reverse_permute_weights`)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


PACKS_SUFFIX = ".decode-gguf4.safetensors"


def packs_path(folder: Path) -> Path:
    """Where a converted model's packs live: beside its folder, not in it (a server such as vLLM loads every
    *.safetensors file in a model folder as weights, and refuses the packs' names)."""
    return folder.with_name(folder.name + PACKS_SUFFIX)


def add_decode_packs(model: torch.nn.Module, gguf: Path, folder: Path) -> dict:
    """Give each linear layer of `model` whose GGUF tensor is 4-bit its packs (PackedLinear). The packs are
    built once, beside the model's converted folder (reading the GGUF's header alone takes ~18 s for the
    1.5B's 151k-token vocabulary), and loaded from there afterwards. Returns: matrices packed, their bytes."""
    from safetensors.torch import load_file, save_file

    path = packs_path(folder)
    if path.exists():
        packs = load_file(path)
    else:
        packs = build_packs(model, gguf)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # two processes may build it at once
        save_file(packs, tmp)
        tmp.rename(path)  # atomic: a half-written file is never taken for a finished one
    modules = dict(model.named_modules())
    packed = nbytes = 0
    for key, pack in packs.items():
        name, _, what = key.rpartition(".")
        linear = modules.get(name)
        if what != "packed" or not isinstance(linear, torch.nn.Linear):
            continue
        scales_zeros = packs[f"{name}.scales_zeros"].to(linear.weight.dtype)
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, PackedLinear(linear, pack, scales_zeros))
        packed += 1
        nbytes += pack.numel() * pack.element_size() + scales_zeros.numel() * scales_zeros.element_size()
    return {"packed": packed, "bytes": nbytes}


def build_packs(model: torch.nn.Module, gguf: Path) -> dict[str, torch.Tensor]:
    """`{module}.packed` (uint8, the kernel's layout) and `{module}.scales_zeros` (fp32 [cols / 32, rows, 2]) for
    every linear layer whose GGUF tensor is 4-bit and matches the loaded weight."""
    from gguf import GGUFReader

    cfg = model.config.get_text_config()
    arch = getattr(cfg, "model_type", "")
    modules = dict(model.named_modules())
    packs = {}
    for tensor in GGUFReader(gguf).tensors:
        parts = tensor.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _MODULES or parts[3] != "weight":
            continue
        name = f"model.layers.{parts[1]}.{_MODULES[parts[2]]}"
        linear = modules.get(name)
        kind = tensor.tensor_type.name
        if not isinstance(linear, torch.nn.Linear) or kind not in ("Q4_0", "Q4_1", "Q4_K"):
            continue
        q, scale, low = groups_of(kind, np.asarray(tensor.data))
        if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if parts[2] == "attn_q" else cfg.num_key_value_heads
            order = _llama_rows(q.shape[0], heads)
            q, scale, low = q[order], scale[order], low[order]
        if not _matches(linear.weight, q, scale, low):
            log.warning("%s: the GGUF's %s values do not match the loaded weight; left unpacked", name, kind)
            continue
        scales_zeros = torch.from_numpy(np.stack([scale, low + 8 * scale], axis=-1)).transpose(0, 1).contiguous()
        packs[f"{name}.scales_zeros"] = scales_zeros
        packs[f"{name}.packed"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(q).to(torch.int32), INNER_K_TILES)
    return packs


def _matches(weight: torch.Tensor, q: np.ndarray, scale: np.ndarray, low: np.ndarray) -> bool:
    """Whether the loaded weight is these groups' values up to its dtype's rounding (every row: the packs are
    built once; ~20 s for the 1.5B's 1.1 G values)."""
    if tuple(weight.shape) != q.shape or q.shape[1] % GROUP:
        return False
    eps = torch.finfo(weight.dtype).eps
    for start in range(0, q.shape[0], 1024):  # in slices: the fp32 copies of a whole matrix would be ~100 MB
        rows = slice(start, start + 1024)
        values = (torch.from_numpy(q[rows]).reshape(-1, q.shape[1] // GROUP, GROUP).float()
                  * torch.from_numpy(scale[rows])[..., None] + torch.from_numpy(low[rows])[..., None])
        values = values.reshape(-1, q.shape[1])
        if not bool(((weight[rows].float() - values).abs() <= values.abs() * eps + 1e-7).all()):
            return False
    return True
