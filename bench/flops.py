"""A model's matmul FLOPs per pass (`Shape`) and the rate its own linear layers run at (`linear_gflops`): the
yardstick that bench.speed's row 4 and bench.prefill set a prefill's FLOP/s against."""
from __future__ import annotations

from dataclasses import dataclass

from .common import timed


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model) -> "Shape":
        c = model.config.get_text_config(decoder=True)
        return cls(c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                   getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, c.intermediate_size,
                   c.vocab_size)

    def weight_flops(self) -> int:
        """Matmul FLOPs per token in the transformer layers: q and o (hidden x hidden), k and v (hidden x kv
        width), gate, up and down (hidden x intermediate); 2 FLOPs per multiply-add."""
        d, kv = self.hidden, self.kv_heads * self.head_dim
        return 2 * self.layers * (2 * d * self.heads * self.head_dim + 2 * d * kv + 3 * d * self.intermediate)

    def attention_flops(self, start: int, n: int) -> int:
        """QK^T and AV for n new tokens after `start` cached ones, causal: token p attends to p+1 keys."""
        keys = n * start + n * (n + 1) // 2
        return 4 * self.layers * self.heads * self.head_dim * keys

    def head_flops(self, rows: int) -> int:
        return 2 * self.hidden * self.vocab * rows

    def prefill_flops(self, n: int, logits_rows: int = 1) -> int:
        return n * self.weight_flops() + self.attention_flops(0, n) + self.head_flops(logits_rows)


def layer_linears(model, index: int = 0) -> dict:
    layer = model.model.layers[index]
    a, m = layer.self_attn, layer.mlp
    return {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj, "gate": m.gate_proj, "up": m.up_proj,
            "down": m.down_proj}


def linear_gflops(model, dtype, rows: int, reps: int = 3) -> dict:
    """The model's own matmul rate: one layer's linears at `rows` rows, as a prefill pass calls them (the modules
    themselves: a 4-bit decode pack steps aside for passes this long). GFLOP/s over all seven, and each."""
    import torch
    each, flops, seconds = {}, 0, 0.0
    with torch.inference_mode():
        for name, linear in layer_linears(model).items():
            x = torch.randn(rows, linear.in_features, dtype=dtype)
            s = timed(lambda: linear(x), reps)
            f = 2 * rows * linear.in_features * linear.out_features
            each[name] = f / s / 1e9
            flops, seconds = flops + f, seconds + s
    return {"gflops": flops / seconds / 1e9, "each": each}
