"""The written-out prefill pass (engine/prefill_step.py): its elementwise kernels give torch's values, its
attention without a mask gives the masked attention's, and a prefill through it gives transformers' logits and
cache on the real model."""
from __future__ import annotations

import sys

import pytest
import torch

from bench.common import rss_bytes
from engine import Engine, kernels
from engine.cache import make_cache
from engine.generate import Runner
from engine.prefill_step import PrefillStep, split_attention

needs_kernels = pytest.mark.skipif(kernels.GEMV.load() is None, reason="engine/kernels unavailable (no AVX2)")
BF16 = torch.bfloat16


def hf_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (llama, qwen2)."""
    h = hidden.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(hidden.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@needs_kernels
def test_elementwise_kernels_give_torch_values():
    """Each kernel rounds where transformers rounds: the norms, the residual add and the rotary equal torch's
    ops bit for bit here; silu's exp is a polynomial, so a value may land one bf16 step away (rarely)."""
    ops = torch.ops.marginalia_gemv
    torch.manual_seed(0)
    rows, hidden, inner, heads, dim = 37, 576, 1000, 3, 64  # 1,000 leaves a tail after the 16-wide vectors
    x = (torch.randn(rows, hidden) * 3).to(BF16)
    weight = (torch.rand(hidden) + 0.5).to(BF16)
    assert torch.equal(ops.rms_norm_rows(x, weight, 1e-6), hf_norm(x, weight, 1e-6))

    delta = torch.randn(rows, hidden).to(BF16)
    summed = x.clone()
    normed = ops.add_rms_norm_rows(summed, delta, weight, 1e-5)
    assert torch.equal(summed, x + delta) and torch.equal(normed, hf_norm(x + delta, weight, 1e-5))

    gate, up = (torch.randn(rows, inner) * 6).to(BF16), torch.randn(rows, inner).to(BF16)
    gate[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # past exp's clamp, and zero
    expected = torch.nn.functional.silu(gate) * up
    ops.silu_mul_rows(gate, up)
    apart = gate != expected
    assert apart.float().mean() < 1e-3
    assert ((gate.float() - expected.float()).abs()[apart] <= expected.float().abs()[apart] / 64).all()

    q = (torch.randn(rows, heads, dim) * 5).to(BF16)
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * (1e4 ** -(torch.arange(0, dim, 2) / dim))[None]
    cos, sin = torch.cat([angles, angles], -1).cos().to(BF16), torch.cat([angles, angles], -1).sin().to(BF16)
    out = torch.empty(heads, rows + 5, dim, dtype=BF16)[:, 2:rows + 2].transpose(0, 1)  # a cache's slots
    ops.rotary_rows(q, cos[:, :dim // 2].contiguous(), sin[:, :dim // 2].contiguous(), out)
    assert torch.equal(out, q * cos[:, None] + rotate_half(q) * sin[:, None])


@pytest.mark.parametrize("past", [0, 45])
def test_attention_without_a_mask_is_the_masked_attention(past):
    """The past and the pass attended separately and merged by their log-sum-exp: the causal attention over
    the whole cache that transformers computes with its mask (fp32, grouped heads)."""
    torch.manual_seed(past)
    heads, kv_heads, n, dim = 6, 2, 19, 64
    query = torch.randn(1, heads, n, dim)
    keys, values = torch.randn(1, kv_heads, past + n, dim), torch.randn(1, kv_heads, past + n, dim)
    mask = torch.arange(past + n)[None, :] <= torch.arange(past, past + n)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1), attn_mask=mask, scale=0.125)
    got = split_attention(query, keys, values, past, 0.125)
    assert got.shape == (n, heads * dim)
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(n, heads * dim), atol=2e-6, rtol=1e-5)


def prefill_both_ways(lm, ids: list[int], cut: int):
    """The same prefill (in passes, then a short pass after them) through the written-out pass and through
    transformers' forward: their last logits and caches."""
    written = Runner(lm.model, lm.tokenizer, lm.device)
    forward = Runner(lm.model, lm.tokenizer, lm.device)
    forward.prefill_step = None
    assert written.prefill_step is not None
    out = []
    for runner in (written, forward):
        cache = make_cache(lm.model, len(ids) + 8)
        runner.prefill(ids[:cut], cache)
        out.append((runner.prefill(ids[cut:], cache), cache))
    return out


def test_a_prefill_gives_transformers_logits_and_cache(engine):
    """fp32, the 135M: 1,290 tokens in three passes (after 512 and 1,024 cached ones), then 7 more; the
    elementwise work in torch's ops (the kernels are bf16's)."""
    lm = engine.lm
    ids = lm.tokenizer("The margins of a long book hold what the reader noticed. " * 120)["input_ids"][:1297]
    assert len(ids) == 1297
    (logits, cache), (expected, expected_cache) = prefill_both_ways(lm, ids, 1290)
    assert cache.length == expected_cache.length == 1297
    torch.testing.assert_close(logits, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)
    for layer, other in zip(cache.layers, expected_cache.layers):
        torch.testing.assert_close(layer.keys[:, :, :1297], other.keys[:, :, :1297], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values[:, :, :1297], other.values[:, :, :1297], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def bf16_lm():
    return Engine.load("embedded", device="cpu", dtype="bf16").lm


@needs_kernels
@pytest.mark.parametrize("attention", ["torch", "fused"])
def test_a_bf16_prefill_predicts_what_transformers_predicts(bf16_lm, attention, monkeypatch):
    """bf16 with the kernels: the same next token and logits within a few bf16 steps (the merged attention and
    the order of the norms' sums round differently); with torch's attention (the split one) and with engine/kernels'
    fused one, which both ways then use."""
    if attention == "fused" and kernels.load() is None:
        pytest.skip("the fused attention kernel needs AVX-512 BF16")
    monkeypatch.setenv("MARGINALIA_ATTENTION", attention)
    lm = bf16_lm
    step = PrefillStep.of(lm.model)
    assert step is not None and step.rows is not None
    ids = lm.tokenizer("Victor wrote to his sister from the north, where the ice had closed around the ship. "
                       * 100)["input_ids"][:1100]
    assert len(ids) == 1100
    (logits, _), (expected, _) = prefill_both_ways(lm, ids, 1090)
    assert logits.argmax() == expected.argmax()
    assert (logits - expected).abs().max() <= 0.05 * expected.abs().max()


def test_a_pass_whose_logits_nobody_reads_returns_none(engine):
    """A prefill's passes before its last skip the LM head, on both paths, and still fill the cache."""
    lm = engine.lm
    ids = lm.tokenizer("One two three four five six seven eight nine ten.")["input_ids"]
    for written_out in (True, False):
        runner = Runner(lm.model, lm.tokenizer, lm.device)
        if not written_out:
            runner.prefill_step = None
        cache = make_cache(lm.model, 64)
        assert runner.forward(ids, cache, logits=False) is None
        assert cache.length == len(ids)


def _mkldnn_bf16() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=BF16), 8)
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _mkldnn_bf16(), reason="this torch has no oneDNN bf16 linear")
def test_prepacked_weights_replace_the_dense_ones(monkeypatch):
    """prepack_full_weights: each layer's full weights move into oneDNN's blocked layout (no second copy: the
    parameters shrink by what the buffers hold, the weights' total stays), the dense values come back on demand,
    and a prefill predicts what the dense weights predict (the 135M's down projection rounds differently in oneDNN's
    packed kernel at 512 rows; the 1.5B's shapes gave the same values bit for bit, docs/speed-and-memory.md)."""
    from engine.packed import prepack_full_weights, weights
    monkeypatch.setenv("MARGINALIA_PREPACK", "off")
    lm = Engine.load("embedded", device="cpu", dtype="bf16").lm
    assert lm.prepacked is None
    ids = lm.tokenizer("The margins of a long book hold what the reader noticed. " * 80)["input_ids"][:700]
    runner = Runner(lm.model, lm.tokenizer, lm.device)
    dense_cache = make_cache(lm.model, 708)
    dense = runner.prefill(ids, dense_cache)
    up = lm.model.model.layers[3].mlp.up_proj
    original = up.weight.detach().clone()
    values, nbytes = weights(lm.model)
    parameters = sum(p.numel() for p in lm.model.parameters())

    before = rss_bytes()
    done = prepack_full_weights(lm.model)
    assert done["matrices"] == 7 * len(lm.model.model.layers)
    if sys.platform.startswith("linux"):  # the dense weights were read from a mapped file: their pages go back
        assert done["released"] >= 0.95 * done["bytes"]
        assert rss_bytes() - before < 0.5 * done["bytes"]  # without it: + the packed copies' bytes
    assert weights(lm.model) == (values, nbytes)
    assert sum(p.numel() for p in lm.model.parameters()) == parameters - done["bytes"] // 2
    assert "weight" not in up._parameters and torch.equal(up.weight, original)
    one_row = torch.randn(1, up.in_features).to(BF16)
    monkeypatch.setattr(type(up), "few_rows", lambda self, x: None)  # a decode copy that declines (no kernels)
    monkeypatch.setattr(type(up), "weight", property(lambda self: pytest.fail("a dense copy made per call")))
    assert torch.allclose(up(one_row), torch.nn.functional.linear(one_row, original), rtol=0.01, atol=1e-3)
    monkeypatch.undo()
    packed_cache = make_cache(lm.model, 708)
    packed = runner.prefill(ids, packed_cache)
    assert packed.argmax() == dense.argmax()
    assert (packed - dense).abs().max() <= 0.05 * dense.abs().max()
    assert packed_cache.length == dense_cache.length == len(ids)


def test_prepacking_is_the_default_on_linux_cpus_with_amx(monkeypatch):
    """Where it was measured (AMX, Linux) the weights load prepacked; elsewhere dense unless asked for. The
    app's model panel says which."""
    from app.render import model_info_html
    from engine.kernels import cpu_flags
    monkeypatch.delenv("MARGINALIA_PREPACK", raising=False)
    lm = Engine.load("embedded", device="cpu", dtype="bf16").lm
    if "amx_bf16" in cpu_flags() and sys.platform.startswith("linux") and _mkldnn_bf16():
        assert lm.prepacked["matrices"] == 7 * len(lm.model.model.layers)
        assert "prepacked" in lm.info["prefill_weights"]
    else:
        assert lm.prepacked is None
    assert f"<dt>Prefill weights</dt><dd>{lm.info['prefill_weights']}</dd>" in model_info_html(lm.info)
