"""Passes of many rows (prefill) through int8 matmuls: opt-in (`--prefill-weights int8`,
MARGINALIA_PREFILL_WEIGHTS=int8), for CPUs that multiply int8 faster than bf16 (AVX-512 VNNI without AMX).

Why: a prefill pass is matmuls, and on such a CPU torch's bf16 matmul runs at ~210 GFLOP/s a core where its int8
one (`torch._int_mm`, oneDNN, vpdpbusd) runs at ~400 (AMD EPYC, 512 rows, bench/results/epyc-no-amx/int8-prefill/);
llama.cpp prefills in int8 there. Each linear's weight gets an int8 copy with one scale per output row
(w ~ scale[n] * q[n, k], |error| <= scale / 2), each pass's rows are rounded to int8 with one scale per row
(engine/kernels' quantize_rows), and the int32 sums are scaled back with the bias added in one pass
(dequantize_rows). Passes of at most DECODE_ROWS rows keep the decode path.

Not every linear: the MLP's down projection takes SiLU(gate) * up, whose few outlier channels make one scale per
row too coarse (on 2,048 tokens of a novel, greedy tokens agreed with bf16's at 96.0% without it and 93.1% with
it). A numeric change: the default stays the full weights until `bench.eval` says the answers hold
(docs/speed-and-memory.md).
"""
from __future__ import annotations

import os

import torch

from .decode_copy import DECODE_ROWS, DecodeCopy

PREFILL_WEIGHTS = ("full", "int8")
PREFILL_WEIGHTS_HELP = ("int8: passes of many rows (prefill) multiply int8 weights by int8-rounded inputs (faster "
                        "on CPUs with VNNI and no AMX; a numeric change); full: the loaded weights [env "
                        "MARGINALIA_PREFILL_WEIGHTS; default full]")
INT8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")  # not down_proj: see above


def pick_prefill_weights(choice: str | None, device: torch.device) -> str:
    choice = choice or os.environ.get("MARGINALIA_PREFILL_WEIGHTS") or "full"
    if choice not in PREFILL_WEIGHTS:
        raise ValueError(f"prefill weights must be {' or '.join(PREFILL_WEIGHTS)}, not {choice!r}")
    if choice == "int8" and device.type != "cpu":
        raise ValueError(f"int8 prefill weights need a CPU (here {device.type})")
    return choice


class FullLinear(DecodeCopy):
    """A plain linear (no decode copy) that can take an int8 copy for passes of many rows."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear)

    def few_rows(self, x: torch.Tensor) -> None:
        return None


def int8_copy(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale fp32 [N]) with weight ~ scale[:, None] * q, each row's largest value at +-127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous(), scale


def add_prefill_int8(model: torch.nn.Module) -> dict:
    """Give each decoder layer's INT8_LINEARS an int8 copy for passes of many rows; {matrices, bytes}."""
    matrices = size = 0
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            for name in INT8_LINEARS:
                linear = getattr(part, name, None)
                if linear is None:
                    continue
                if not isinstance(linear, DecodeCopy):
                    linear = FullLinear(linear)
                    setattr(part, name, linear)
                q, scale = int8_copy(linear.weight)
                linear.register_buffer("prefill_q", q, persistent=False)
                linear.register_buffer("prefill_scale", scale, persistent=False)
                matrices += 1
                size += q.numel() + scale.numel() * 4
    return {"matrices": matrices, "bytes": size, "rows_above": DECODE_ROWS}
