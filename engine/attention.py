"""Attention for one new token over the cache, registered with transformers as `marginalia`.

A decode step asks one query per head to attend to the whole cache view. transformers' `sdpa` hands that to
`scaled_dot_product_attention(..., enable_gqa=True)` when there is no mask, and on CPU that kernel is slow for
a single query: at 8k tokens of context it took 2.5 ms a layer for SmolLM2's shape in fp32 (9.1 ms for Qwen2.5
1.5B's), where the same work with the grouped heads laid out as query rows took 0.95 ms (2.1 ms). So here the
`group` query heads that share one key/value head become `group` query rows against that head's keys: one
[group x head_dim] @ [head_dim x context] product per key/value head, over the cache view as it is (no
repeat_kv copy of the keys, no mask: every cached slot is visible to the newest token).

The product itself goes to torch's fused kernel rather than two explicit matmuls: on this AMX CPU, measured
side by side, explicit matmuls + softmax tied it in fp32 and were 4-10x slower in bf16 (scripts in
bench/attention.py). Anything else (prefill, masked scratch rows) is plain `sdpa`.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "marginalia"


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


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    """transformers' attention-function signature; returns (output [batch, q, heads, dim], None)."""
    if query.shape[2] == 1 and attention_mask is None and dropout == 0.0 and kwargs.get("softcap") is None \
            and kwargs.get("s_aux") is None:
        return grouped_decode(query, key, value, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(NAME, attention)
# The same masks as sdpa: none at all for a plain causal step (the case `attention` takes over), explicit
# ones (scratch rows) passed through.
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
