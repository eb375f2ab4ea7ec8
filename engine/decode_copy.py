"""A linear layer that keeps a second copy of its weight for passes of a few rows (a decode step), beside the full
weight for passes of many rows: engine/packed.py's GGUF blocks and engine/prefill_int8.py's int8 copies are both
kinds of it, and int8_matmul is the product the int8 copy takes."""
from __future__ import annotations

import torch
import torch.nn.functional as F

DECODE_ROWS = 4     # passes of at most this many rows use the packs (the crossover: bench/results/decode_weights/)


class DecodeCopy(torch.nn.Linear):
    """A linear layer with its full weight (passes of many rows) and a second copy of the same values, in
    buffers that are not saved with the model, for passes of at most DECODE_ROWS rows (`few_rows`; None there
    means the full weight after all); passes of more rows take engine/prefill_int8.py's int8 copy where one was
    added (`prefill_q`, through int8_matmul), or the full weight prepacked for oneDNN where engine/packed.py's
    `prepack_full_weights` replaced it (`prefill_packed`)."""

    @property
    def weight(self) -> torch.Tensor:
        """The full weight; where it was prepacked, a dense copy made for the caller (a fallback's rare path:
        passes of many rows use the packed one)."""
        weight = self._parameters.get("weight")
        return weight if weight is not None else self.prefill_packed.to_dense()

    def __init__(self, linear: torch.nn.Linear, **copy: torch.Tensor):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        for name, tensor in copy.items():
            self.register_buffer(name, tensor, persistent=False)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        y = self.few_rows(x.reshape(rows, x.shape[-1])) if rows <= DECODE_ROWS else None
        if y is not None:
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        if getattr(self, "prefill_packed", None) is not None:  # also a few rows whose copy declined (no kernels)
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self.prefill_packed, self.bias,
                                                   "none", [], "")
            return y.reshape(*x.shape[:-1], self.out_features)
        if rows > DECODE_ROWS and getattr(self, "prefill_q", None) is not None:  # engine/prefill_int8.py's copy
            y = int8_matmul(x.reshape(rows, x.shape[-1]), self.prefill_q, self.prefill_scale, self.bias)
            if y is not None:
                return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor | None:
    """x [rows, K] (bf16 or fp32) times the int8 copy (q [N, K], scale [N]) plus bias -> [rows, N] in x's
    dtype; None where engine/kernels are unavailable (the caller's full weight then)."""
    from .kernels import GEMV
    if GEMV.load() is None:
        return None
    ops = torch.ops.marginalia_gemv
    rows, row_scale = ops.quantize_rows(x.contiguous())
    sums = torch._int_mm(rows, q.t())  # q stored [N, K]: oneDNN takes the transposed view as is, the faster layout
    empty = scale.new_empty(0)
    return ops.dequantize_rows(sums, row_scale, scale, empty if bias is None else bias.float(), x.dtype)
