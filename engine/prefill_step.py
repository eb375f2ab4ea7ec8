"""A pass of many tokens after a preallocated cache, written out (gpt-fast's way) for a llama- or qwen2-layout
model: the same layers as transformers' forward, with less work around the matrices.

- **Attention without a mask.** A pass of n tokens after p cached ones is causal over the pass and sees all of the
  past. transformers builds an [n x (p + n)] mask for it and torch's kernel reads that mask at every score; here
  the past and the pass are two calls with no mask, merged by their log-sum-exp: the past one with each key/value
  head's `group` query heads laid out as its rows (one [group * n x dim] @ [dim x p] product per key/value head,
  nothing copied), the pass itself causal. On a CPU where engine/kernels' fused kernel is the default (AVX-512
  BF16; on AMX's tiles where the CPU has them) that kernel takes the whole pass, computing the causal offset
  itself.
- **The cache written in place**: the rotated keys go straight into their cache slots, the values are copied
  there once, no [n x (p + n)] mask is made and no module plumbing runs.
- **The elementwise work in one pass each** (bf16, engine/kernels/prefill_rows.cpp, rounded where transformers
  rounds): each norm with the residual add before it, the rotary, silu times up in place on the gate's output;
  elsewhere (fp32, no kernels) torch's ops, in place where they can be.
- **No LM head on a pass whose logits nobody reads** (every pass of a prefill but its last).

The linear layers are the model's own modules, so a decode copy, an int8 prefill copy or a plain weight is used
exactly as transformers' forward would use it. The values are transformers' up to the order of a few sums (the
merged attention, the norms' statistics): tests/test_prefill_step.py checks the logits and the cache
against transformers' forward; bench.prefill measures both ways in one run, bench.eval the answers.
MARGINALIA_PREFILL_PASS=forward keeps transformers' forward for every pass (the other side of a comparison:
bench.speed checks the reference pattern's margins and answer against a WiM reading made that way).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .attention import fused_enabled
from .cache import CacheFull, PreallocatedLayer
from .decode_step import DecodeStep, written_out_layout


def _flash_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scaling: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash kernel, which also returns each row's log-sum-exp ([batch, heads, rows] fp32)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scaling)
    return out[0], out[1]


def split_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int, scaling: float
                    ) -> torch.Tensor:
    """query [1, heads, n, dim] (heads-major, contiguous), keys/values [1, kv_heads, past + n, dim] (the cache's
    views) -> [n, heads * dim] in the query's dtype: row i sees keys 0 .. past + i."""
    _, heads, n, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    cur_k, cur_v = keys[:, :, past:], values[:, :, past:]
    if group > 1:  # the pass's own keys, one copy per query head: n rows, small next to the past
        cur_k, cur_v = cur_k.repeat_interleave(group, dim=1), cur_v.repeat_interleave(group, dim=1)
    if past == 0:
        out = torch.nn.functional.scaled_dot_product_attention(query, cur_k, cur_v, is_causal=True, scale=scaling)
        return out.transpose(1, 2).reshape(n, heads * dim)
    now, now_lse = _flash_with_lse(query, cur_k, cur_v, True, scaling)
    rows = query.view(1, kv_heads, group * n, dim)  # head h's rows under its key/value head h // group
    before, before_lse = _flash_with_lse(rows, keys[:, :, :past], values[:, :, :past], False, scaling)
    before, before_lse = before.reshape(1, heads, n, dim), before_lse.reshape(1, heads, n)
    # softmax over both parts = each part's softmax weighted by its share of the total exp-sum
    wide = torch.promote_types(query.dtype, torch.float32)  # bf16's sums in fp32, fp64's in fp64
    share = torch.sigmoid(before_lse - now_lse).unsqueeze(-1).to(wide)  # [1, heads, n, 1]
    merged = now.to(wide).lerp_(before.to(wide), share)
    return merged.transpose(1, 2).reshape(n, heads * dim).to(query.dtype)


class _Layer:
    def __init__(self, layer, config):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q, self.k, self.v, self.o = attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.head_dim, self.scaling = attention.head_dim, float(attention.scaling)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads


class PrefillStep:
    """`step(ids, position, cache, logits)` -> the last token's logits (fp32; None when `logits` is False),
    appending the tokens' keys and values to `cache` (a PreallocatedCache) at its next slots."""

    def __init__(self, model, native: bool = True):
        inner = model.model
        self.embed, self.norm, self.rotary, self.lm_head = inner.embed_tokens, inner.norm, inner.rotary_emb, model.lm_head
        self.layers = [_Layer(layer, model.config) for layer in inner.layers]
        self.rows = None  # engine/kernels' prefill_rows.cpp ops, for bf16 where they built
        if native and self.embed.weight.dtype == torch.bfloat16 and self.embed.weight.device.type == "cpu":
            from .kernels import GEMV
            self.rows = torch.ops.marginalia_gemv if GEMV.load() is not None else None

    @classmethod
    def of(cls, model, native: bool = True) -> "PrefillStep | None":
        """The written-out pass where it computes what transformers would: a llama/qwen2 layout (no sliding
        window layers, silu MLP without bias, no o_proj bias, rotary over the whole head); None otherwise."""
        if os.environ.get("MARGINALIA_PREFILL_PASS", "written") == "forward" or not written_out_layout(model) \
                or getattr(model.config, "partial_rotary_factor", 1.0) != 1.0:
            return None
        return cls(model, native)

    @staticmethod
    def takes(cache) -> bool:
        """Whether `cache` is one this pass writes: every layer preallocated, all of one length."""
        layers = getattr(cache, "layers", None)
        return bool(layers) and all(isinstance(l, PreallocatedLayer) for l in layers) \
            and len({l.length for l in layers}) == 1

    @torch.inference_mode()
    def __call__(self, ids: list[int], position: int, cache, logits: bool = True) -> torch.Tensor | None:
        device = self.embed.weight.device
        n = len(ids)
        start = cache.layers[0].length
        if start + n > cache.layers[0].capacity:
            raise CacheFull(f"KV cache full: {start + n} tokens > capacity {cache.layers[0].capacity}")
        hidden = self.embed(torch.tensor(ids, device=device))  # [n, hidden]
        positions = torch.arange(position, position + n, device=device).unsqueeze(0)
        cos, sin = self.rotary(hidden, positions)
        half = cos.shape[-1] // 2
        cos, sin = cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()  # rotary repeats its halves
        fused = fused_enabled()
        x = self._norm(self.layers[0].input_norm, hidden)
        for index, (layer, slot) in enumerate(zip(self.layers, cache.layers)):
            if not slot.is_initialized:
                empty = hidden.new_empty(1, layer.kv_heads, 0, layer.head_dim)
                slot.lazy_initialization(empty, empty)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else None
            x = self._layer(layer, slot, hidden, x, following, cos, sin, start, fused)
        for slot in cache.layers:
            slot.length = start + n
        if not logits:
            return None
        last = self._norm(self.norm, hidden[-1:])
        return self.lm_head(last.unsqueeze(0))[0, -1].float()

    def _norm(self, norm, hidden: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows.rms_norm_rows(hidden, norm.weight, float(norm.variance_epsilon))
        return DecodeStep._norm(norm, hidden)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor, norm) -> torch.Tensor | None:
        """hidden += delta in place; the norm of the sum (None without `norm`: the last layer's)."""
        if self.rows is not None and norm is not None:
            return self.rows.add_rms_norm_rows(hidden, delta, norm.weight, float(norm.variance_epsilon))
        hidden.add_(delta)
        return None if norm is None else DecodeStep._norm(norm, hidden)

    def _rotate_into(self, out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """transformers' x * cos + rotate_half(x) * sin into `out` ([n, heads, dim]; cos, sin [n, dim / 2])."""
        if self.rows is not None:
            self.rows.rotary_rows(x, cos, sin, out)
            return
        half = x.shape[-1] // 2
        x1, x2, cos, sin = x[..., :half], x[..., half:], cos[:, None], sin[:, None]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:] = x2 * cos + x1 * sin

    def _silu_times(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            self.rows.silu_mul_rows(gate, up)
            return gate
        return F.silu(gate, inplace=True).mul_(up)  # `of` took only silu MLPs

    def _layer(self, layer: _Layer, slot: PreallocatedLayer, hidden: torch.Tensor, x: torch.Tensor, following,
               cos: torch.Tensor, sin: torch.Tensor, start: int, fused: bool) -> torch.Tensor | None:
        """One layer: `hidden` updated in place from its input norm `x`; returns the next layer's input norm
        (`following`'s; None after the last layer)."""
        n, dim = hidden.shape[0], layer.head_dim
        q = layer.q(x).view(n, layer.heads, dim)
        k = layer.k(x).view(n, layer.kv_heads, dim)
        v = layer.v(x).view(n, layer.kv_heads, dim)
        end = start + n
        self._rotate_into(slot.keys[0, :, start:end].transpose(0, 1), k, cos, sin)
        slot.values[0, :, start:end].copy_(v.transpose(0, 1))
        query = q.new_empty(1, layer.heads, n, dim)  # heads-major: the grouped-rows view needs it
        self._rotate_into(query[0].transpose(0, 1), q, cos, sin)
        keys, values = slot.keys[:, :, :end], slot.values[:, :, :end]
        out = None
        if fused:
            from .kernels import flash_attention
            out = flash_attention(query, keys, values, None, layer.scaling, causal=True)
            out = None if out is None else out.reshape(n, layer.heads * dim)
        if out is None:
            out = split_attention(query, keys, values, start, layer.scaling)
        x = self._add_norm(hidden, layer.o(out), layer.post_norm)
        gate = self._silu_times(layer.gate(x), layer.up(x))
        return self._add_norm(hidden, layer.down(gate), following)
