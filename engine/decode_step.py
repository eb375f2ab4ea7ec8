"""One decode step written out (gpt-fast's way) for a llama- or qwen2-layout model whose linear layers all carry
`gguf-q8` decode copies (engine/packed.py): the same operations transformers' modules run, in the same order and
dtypes, so the logits are theirs bit for bit, with two differences in how they are called:

- a layer's q, k and v go to engine/kernels in one call, and its gate and up in another (gemv_q8_many: the input
  rounded to int8 once, one split of all their rows over the threads), 4 kernel calls a layer instead of 7;
- no module calls, keyword plumbing or mask building: a decode step is one token after the cache, nothing else;
- the loop over the layers runs in C++ where engine/kernels built (decode_layers.cpp: the same kernels and
  attention, the elementwise work rounded where torch rounds it, so the same values bit for bit), without
  Python's cost per op; `_layers` below is the same loop in Python, the reference, and the path for a cache that
  is not a preallocated one or a dtype other than bf16 and fp32.

Why: on a 2-core CPU a step of the 1.5B spent ~15 ms of its ~84 outside the matrices (28 layers through
transformers' Python), the part of the gap to llama.cpp that is not bytes read. Passes of several tokens, masked
scratch rows and other models keep transformers' forward (`DecodeStep.of` returns None for them).
"""
from __future__ import annotations

import torch

from . import packed
from .attention import grouped_decode
from .cache import PreallocatedLayer

ARCHITECTURES = ("llama", "qwen2")


def written_out_layout(model) -> bool:
    """Whether the written-out steps (this one, engine/prefill_step.py's pass) compute what transformers' forward
    would: a llama/qwen2 layout with no sliding-window layers, a silu MLP without bias and no o_proj bias."""
    config = model.config
    return getattr(config, "model_type", "") in ARCHITECTURES and getattr(config, "hidden_act", "") == "silu" \
        and not getattr(config, "mlp_bias", False) and not getattr(config, "use_sliding_window", False) \
        and all(t == "full_attention" for t in (getattr(config, "layer_types", None) or [])) \
        and all(layer.self_attn.o_proj.bias is None for layer in model.model.layers)


class _Layer:
    """One decoder layer's tensors, grouped the way the step calls the kernels."""

    def __init__(self, layer):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = packed.SharedInput([attention.q_proj, attention.k_proj, attention.v_proj])
        self.qkv_bias = [m.bias for m in (attention.q_proj, attention.k_proj, attention.v_proj)]
        self.o = attention.o_proj
        self.gate_up = packed.SharedInput([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.head_dim, self.scaling = attention.head_dim, attention.scaling

    def add_to(self, native) -> None:
        """This layer's tensors into decode_layers.cpp's DecodeLayers (shared, not copied)."""
        def one(m):
            single = packed.SharedInput([m])
            return [single.weights[0], single.scales[0], single.lows[0]]
        none = torch.empty(0)
        native.add_layer(self.input_norm.weight, float(self.input_norm.variance_epsilon), self.post_norm.weight,
                         float(self.post_norm.variance_epsilon), self.qkv.weights, self.qkv.scales, self.qkv.lows,
                         [none if b is None else b for b in self.qkv_bias], one(self.o), self.gate_up.weights,
                         self.gate_up.scales, self.gate_up.lows, one(self.down))


class DecodeStep:
    """`step(token, position, cache)` -> the next token's logits (fp32), appending the token's keys and values
    to `cache` at its next slot."""

    def __init__(self, model, native: bool = True):
        self.model = model
        inner = model.model
        self.embed, self.norm, self.rotary, self.lm_head = inner.embed_tokens, inner.norm, inner.rotary_emb, model.lm_head
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.act = inner.layers[0].mlp.act_fn
        self.native = None  # decode_layers.cpp's DecodeLayers, where engine/kernels built it
        if native and self.embed.weight.dtype in (torch.bfloat16, torch.float32) and self.layers[0].head_dim <= 512:
            from .kernels import decode_layers
            self.native = decode_layers(self.layers[0].head_dim, float(self.layers[0].scaling))
            for layer in self.layers if self.native is not None else ():
                layer.add_to(self.native)

    @classmethod
    def of(cls, model, native: bool = True) -> "DecodeStep | None":
        """The written-out step where it computes what transformers would: a llama/qwen2 layout (no sliding
        window layers, silu MLP without bias, no o_proj bias) whose seven linears a layer are all gguf-q8
        copies; None otherwise."""
        if not written_out_layout(model):
            return None
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                       mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            if not all(isinstance(m, (packed.Q4Linear, packed.Int8Linear)) and m.round_x for m in linears):
                return None
        from .kernels import GEMV
        return cls(model, native) if GEMV.load() is not None else None

    @staticmethod
    def _norm(norm, hidden: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm (llama's and qwen2's): fp32 statistics, the weight in the model's dtype."""
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
        return norm.weight * hidden.to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)

    @torch.inference_mode()
    def __call__(self, token: int, position: int, cache) -> torch.Tensor:
        device = self.embed.weight.device
        hidden = self.embed(torch.tensor([[token]], device=device))  # [1, 1, hidden]
        cos, sin = self.rotary(hidden, torch.tensor([[position]], device=device))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        buffers = self._buffers(cache)
        if buffers is None:
            hidden = self._layers(hidden, cos, sin, cache)
        else:
            keys, values, length = buffers
            hidden = self.native.run(hidden, cos, sin, keys, values, length)
            for layer in cache.layers:
                layer.length = length + 1
        hidden = self._norm(self.norm, hidden)
        return self.lm_head(hidden)[0, -1].float()

    def _buffers(self, cache) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
        """The cache's key and value buffers and its length, where the C++ loop can write them as
        PreallocatedLayer.update would (every layer allocated, one length, room for one more slot); else None."""
        if self.native is None:
            return None
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) != len(self.layers) or not all(isinstance(l, PreallocatedLayer) for l in layers):
            return None
        length = layers[0].length
        if not all(l.is_initialized and l.length == length and length < l.capacity for l in layers):
            return None
        return [l.keys for l in layers], [l.values for l in layers], length

    def _layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """The layers in Python: what decode_layers.cpp computes, value for value (the reference)."""
        dtype = hidden.dtype
        for index, layer in enumerate(self.layers):
            residual = hidden
            x = self._norm(layer.input_norm, hidden).reshape(1, -1).float()
            ys = layer.qkv(x)
            q, k, v = (y.to(dtype) if b is None else y.to(dtype) + b for y, b in zip(ys, layer.qkv_bias))
            q = q.view(1, 1, -1, layer.head_dim).transpose(1, 2)
            k = k.view(1, 1, -1, layer.head_dim).transpose(1, 2)
            v = v.view(1, 1, -1, layer.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            k, v = cache.update(k, v, index)
            out = grouped_decode(q, k, v, layer.scaling).reshape(1, 1, -1).contiguous()
            hidden = residual + layer.o(out)
            residual = hidden
            x = self._norm(layer.post_norm, hidden).reshape(1, -1).float()
            gate, up = (y.to(dtype) for y in layer.gate_up(x))
            hidden = residual + layer.down((self.act(gate) * up).view(1, 1, -1))
        return hidden
