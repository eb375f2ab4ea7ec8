"""Attention for new tokens over the cache, registered with transformers as `marginalia`.

A decode step asks one query per head to attend to the whole cache view. transformers' `sdpa` hands that to
`scaled_dot_product_attention(..., enable_gqa=True)` when there is no mask, and on CPU that kernel is slow for
a single query: at 8k tokens of context it took 2.5 ms a layer for SmolLM2's shape in fp32 (9.1 ms for Qwen2.5
1.5B's), where the same work with the grouped heads laid out as query rows took 0.95 ms (2.1 ms). So here the
`group` query heads that share one key/value head become `group` query rows against that head's keys: one
[group x head_dim] @ [head_dim x context] product per key/value head, over the cache view as it is (no
repeat_kv copy of the keys, no mask: every cached slot is visible to the newest token).

The product itself goes to torch's fused kernel rather than two explicit matmuls: on this AMX CPU, measured
side by side, explicit matmuls + softmax tied it in fp32 and were 4-10x slower in bf16 (scripts in
bench/results/attention/attention.py).

A pass of several tokens after the cache (a margin instruction, a copied sentence, scratch rows, a segment)
comes with a mask (causal over the cache, or the scratch's own), and with a mask transformers' `sdpa` first
copies every key/value head `group` times (repeat_kv). Here the pass's query rows are laid out per key/value
head as (head in group, token), and the [q x context] mask is repeated `group` times instead, once per forward
pass (every layer gets the same mask). Measured in bf16 on one thread, SmolLM2's shape at 4k tokens of
context, one layer: 1.84 -> 0.37 ms for 2 tokens, 3.49 -> 1.68 ms for 32, 16.3 -> 11.5 ms for 128 (at 8k);
a whole 32-token pass went from 161 to ~110 ms. The repeated mask is bounded (ROWS_MASK_ELEMENTS).

Past that bound (a segment's pass of up to 512 tokens over a long context), on a CPU, the key/value heads go to
`scaled_dot_product_attention(..., enable_gqa=True)` with the mask as it is: torch's CPU kernel takes grouped
heads and a mask together, so nothing is copied. transformers does not ask for that with a mask, because on
CUDA it would fall back to the slow math kernel; CUDA keeps `sdpa`. One layer, bf16, one thread, a 512-token
pass at 7.5k tokens of context: 118 -> 65 ms for SmolLM2's shape, 219 -> 172 ms for Qwen2.5 1.5B's; at 4k,
46 -> 35 and 123 -> 99 ms; and the per-layer copies (44 MiB for the 1.5B at 7.5k, plus the kernel's own 74 MiB
with repeated heads against 4 MiB) no longer raise the peak memory of a long read. Same result bit for bit in
fp32.

On a CPU with AVX-512 BF16 (MARGINALIA_ATTENTION unset or `auto`; `fused` or `torch` force either): passes of
several tokens (with a mask, or causal with no past) go to the fused bf16 kernel of engine/kernels (online
softmax; bf16 dot products, or AMX's tiles where the CPU has them), where it loaded and takes the call; anything
else keeps the paths above. Without AMX torch's kernel ran attention at a third of the matmul rate and the fused
one at ~4.5x torch's (a 4k prefill 1.43x faster, AMD EPYC). With AMX the kernel's AVX-512 path is slower than
torch's (187 against 777 GFLOP/s at 4k), its tiles faster (~1,500 against ~1,000 GFLOP/s at 4k and 16k, Intel
Xeon, 2 threads), so `auto` takes it there only where its tiles are in use. Quality: docs/speed-and-memory.md
(`bench.eval` at 4k, 48 cases, seed 0, each kernel against torch's).
"""
from __future__ import annotations

import functools
import os

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "marginalia"
ROWS_MASK_ELEMENTS = 4 * 2**20  # group x q x context: 8 MiB in bf16 (see above)


def grouped_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
                   ) -> torch.Tensor:
    """query [batch, heads, 1, dim], key/value [batch, kv_heads, context, dim] -> [batch, 1, heads, dim].

    Head h reads key/value head h // group (transformers' repeat_kv order), so viewing the heads as
    [kv_heads, group] puts each group's queries on the rows of its own key/value head."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    rows = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, scale=scaling)
    return out.reshape(batch, 1, heads, value.shape[-1])


# Every layer of one forward pass gets the same mask object: its repeated, additive form is made once per pass
# (converting and repeating it in each of SmolLM2's 30 layers cost 8 of a 32-token pass's 140 ms).
# Keyed on the object itself, which the entry keeps alive, so a new pass's mask can never be taken for it.
_rows_memo: tuple = (None, 0, None)


def _rows_mask(mask: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    global _rows_memo
    held, held_group, rows = _rows_memo
    if held is not mask or held_group != group or rows.dtype != (dtype if mask.dtype == torch.bool else mask.dtype):
        if mask.dtype == torch.bool:  # as scaled_dot_product_attention converts a boolean mask itself
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        else:
            additive = mask
        rows = additive.repeat(1, 1, group, 1)
        _rows_memo = (mask, group, rows)
    return rows


def grouped_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
    """query [batch, heads, q, dim], key/value [batch, kv_heads, context, dim], mask [batch or 1, 1, q, context]
    (bool or additive) -> [batch, q, heads, dim].

    Viewing the heads as [kv_heads, group] puts the queries of key/value head k on rows (g, i) = g * q + i; every
    head of a group sees what its token sees, so the mask's q rows repeat once per head in the group."""
    batch, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    rows = query.reshape(batch, kv_heads, group * q, dim)
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=_rows_mask(mask, group, query.dtype),
                                                           scale=scaling)
    return out.reshape(batch, heads, q, value.shape[-1]).transpose(1, 2).contiguous()


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:
    """query [batch, heads, q, dim], key/value [batch, kv_heads, context, dim], mask [batch or 1, 1, q, context]
    -> [batch, q, heads, dim]: torch's kernel reads head h's keys from key/value head h // group itself."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def fused_enabled() -> bool:
    """Whether passes of several tokens try engine/kernels' fused kernel (see the module's docstring)."""
    choice = os.environ.get("MARGINALIA_ATTENTION", "auto")
    if choice == "auto":
        return _fused_is_faster_here()
    return choice == "fused"


@functools.cache
def _fused_is_faster_here() -> bool:
    from .kernels import attention_use_amx, cpu_flags
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return attention_use_amx(True)  # its tiles beat torch's kernel there; its AVX-512 path does not
    return "avx512_bf16" in flags


def _fused(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """engine/kernels' output for a pass of several tokens, or None (not enabled, not loaded, not its case)."""
    if not fused_enabled() or query.shape[2] < 2 or dropout != 0.0 or query.device.type != "cpu" \
            or any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "position_bias", "sliding_window")):
        return None
    from .kernels import flash_attention
    if attention_mask is not None:
        return flash_attention(query, key, value, attention_mask, scaling)
    if key.shape[2] == query.shape[2] and kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return flash_attention(query, key, value, None, scaling, causal=True)  # what sdpa's is_causal means here
    return None


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    """transformers' attention-function signature; returns (output [batch, q, heads, dim], None)."""
    fused = _fused(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if fused is not None:
        return fused, None
    if query.shape[2] == 1 and attention_mask is None and dropout == 0.0 and kwargs.get("softcap") is None \
            and kwargs.get("s_aux") is None:
        return grouped_decode(query, key, value, scaling), None
    if query.shape[2] > 1 and attention_mask is not None and attention_mask.dim() == 4 \
            and attention_mask.shape[1] == 1 and query.shape[1] > key.shape[1] and dropout == 0.0 \
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None \
            and kwargs.get("position_bias") is None:
        if query.shape[1] // key.shape[1] * query.shape[2] * key.shape[2] <= ROWS_MASK_ELEMENTS:
            return grouped_rows(query, key, value, attention_mask, scaling), None
        if query.device.type == "cpu":
            return grouped_sdpa(query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(NAME, attention)
# The same masks as sdpa: none at all for a plain causal step (the case `attention` takes over), explicit
# ones (scratch rows) passed through.
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
