"""int8 prefill (engine/prefill_int8.py): its two kernels give torch's reference values exactly, an int8 matmul is
within its rounding of the full one, and the real model loaded with int8 copies prefills with them, keeps its
decode path, and predicts what the full weights predict."""
from __future__ import annotations

import pytest
import torch

from conftest import shared
from engine import kernels
from engine.generate import Runner
from engine.model import load_model
from engine.decode_copy import DECODE_ROWS, int8_matmul
from engine.prefill_int8 import INT8_LINEARS, int8_copy, pick_prefill_weights

needs_kernels = pytest.mark.skipif(kernels.GEMV.load() is None, reason="engine/kernels unavailable (no AVX2)")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_are_rounded_as_torch_rounds_them(dtype):
    """scale = max|x| / 127 and q = x * (127 / max|x|) rounded half to even, per row; the last row is all zeros
    and K = 1,000 leaves a tail of 8 after the 32-value blocks."""
    torch.manual_seed(0)
    x = (torch.randn(7, 1000) * torch.tensor([0.01, 1, 30, 1e3, 0.5, 2, 0])[:, None]).to(dtype)
    x[1, 5] = 40.0  # an outlier sets its row's scale
    x[2, :64] = torch.arange(64) - 31.5  # values that land on halves after scaling
    q, scale = torch.ops.marginalia_gemv.quantize_rows(x)
    top = x.float().abs().amax(dim=1)
    # a true division (torch's `127.0 / top` is a reciprocal times 127, a rounding apart)
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    assert torch.equal(scale, top / 127)
    assert torch.equal(q, (x.float() * inverse[:, None]).round().to(torch.int8))
    assert q.abs().max() == 127 and not q[6].any()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sums_are_scaled_back_as_torch_scales_them(dtype):
    torch.manual_seed(1)
    sums = torch.randint(-2**20, 2**20, (5, 300), dtype=torch.int32)
    rows, columns, bias = torch.rand(5) * 1e-3, torch.rand(300) * 1e-2, torch.randn(300)
    got = torch.ops.marginalia_gemv.dequantize_rows(sums, rows, columns, bias, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, (sums.float() * rows[:, None] * columns[None, :] + bias).to(dtype))
    plain = torch.ops.marginalia_gemv.dequantize_rows(sums, rows, columns, bias.new_empty(0), dtype)
    assert torch.equal(plain, (sums.float() * rows[:, None] * columns[None, :]).to(dtype))


@needs_kernels
def test_an_int8_matmul_is_within_its_rounding_of_the_full_one():
    """Each x and w value is off by at most half its row's step, so |error| <= sum_k (|x| dw + |w| dx + dx dw)."""
    torch.manual_seed(2)
    x, weight, bias = torch.randn(64, 512), torch.randn(96, 512) * 0.05, torch.randn(96)
    q, scale = int8_copy(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    got = int8_matmul(x, q, scale, bias)
    want = x @ weight.T + bias
    dx = x.abs().amax(dim=1, keepdim=True) / 127 / 2
    dw = (scale / 2)[None, :]
    bound = x.abs() @ torch.ones(512, 96) * dw + dx * (weight.abs().sum(dim=1)[None, :]) + 512 * dx * dw
    assert ((got - want).abs() <= bound + 1e-4).all()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_unknown_prefill_weights_are_refused():
    with pytest.raises(ValueError, match="prefill weights must be full or int8"):
        pick_prefill_weights("int4", torch.device("cpu"))
    assert pick_prefill_weights(None, torch.device("cpu")) in ("full", "int8")


@needs_kernels
def test_the_model_prefills_with_int8_copies_and_decodes_as_before(monkeypatch):
    """The 135M in bf16 with int8 copies: every layer's INT8_LINEARS have one, a pass of many rows goes through
    them (counted), a pass of DECODE_ROWS rows or fewer does not, and the next token after 300 tokens of prose is
    the full weights' with logits close to theirs."""
    lm = load_model("embedded", device="cpu", dtype="bf16", prefill_weights="int8")
    layers = lm.model.config.num_hidden_layers
    assert lm.prefill_int8["matrices"] == layers * len(INT8_LINEARS)
    assert lm.info["prefill_weights"].startswith(f"int8 for {layers * len(INT8_LINEARS)} matrices")
    assert lm.model.model.layers[0].mlp.down_proj.__dict__.get("prefill_q") is None  # kept in full: see the module
    from engine import decode_copy
    calls = []
    real = decode_copy.int8_matmul
    monkeypatch.setattr(decode_copy, "int8_matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    text = shared("books", "pg84.txt").read_text(encoding="utf-8")[20_000:23_000]
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"][:300]
    runner = Runner(lm.model, lm.tokenizer, lm.device)
    cache = runner.new_cache(len(ids) + 8)
    int8_logits = runner.prefill(ids, cache)
    assert len(calls) == layers * len(INT8_LINEARS) * len(range(0, len(ids), 512)) and min(calls) > DECODE_ROWS
    calls.clear()
    runner.forward(ids[-DECODE_ROWS:], cache)
    assert calls == []
    held = [(m, m.prefill_q) for m in lm.model.modules() if getattr(m, "prefill_q", None) is not None]
    for m, _ in held:
        m.prefill_q = None
    try:
        full_logits = runner.prefill(ids, runner.new_cache(len(ids) + 8))
    finally:
        for m, q in held:
            m.prefill_q = q
    assert int(int8_logits.argmax()) == int(full_logits.argmax())
    similarity = float(torch.nn.functional.cosine_similarity(int8_logits.float(), full_logits.float(), dim=0))
    print(f"cosine similarity of the next-token logits: {similarity:.4f}")
    assert similarity > 0.995  # 0.9998 on this prose (AMD EPYC); a wrong scale or layout falls far below
