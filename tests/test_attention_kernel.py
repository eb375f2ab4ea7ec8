"""engine/kernels' fused bf16 attention against torch's scaled_dot_product_attention in fp32 on the same bf16
inputs: its error must stay within twice that of torch's own bf16 kernel (both round P and the output to bf16),
on its AVX-512 path and, where the CPU has AMX, on its tiles. Skipped where the kernel does not load (no
avx512_bf16, no compiler or ninja)."""
from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.attention import attention

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="fused attention kernel unavailable here")

SHAPES = [(12, 2, 128), (9, 3, 64)]  # Qwen2.5-1.5B, SmolLM2-135M
LENGTHS = [(1, 1), (1, 300), (7, 7), (7, 1000), (64, 64), (64, 777), (512, 512), (512, 5000)]


def inputs(heads, kv_heads, dim, q, ctx, seed=0):
    """A transposed query view (as the model makes it) and key/value views of a larger cache buffer."""
    g = torch.Generator().manual_seed(seed)
    capacity = ctx + 41
    query = torch.randn(1, q, heads, dim, generator=g).bfloat16().transpose(1, 2)
    key = (2 * torch.randn(1, kv_heads, capacity, dim, generator=g)).bfloat16()[:, :, :ctx]
    value = torch.randn(1, kv_heads, capacity, dim, generator=g).bfloat16()[:, :, :ctx]
    return query, key, value


def causal_mask(q, ctx):
    return (torch.arange(ctx)[None, :] <= torch.arange(ctx - q, ctx)[:, None])[None, None]


def random_mask(q, ctx, seed=1):
    mask = torch.rand(1, 1, q, ctx, generator=torch.Generator().manual_seed(seed)) < 0.3
    mask[..., 0] = True  # every row sees something
    return mask


def window_mask(q, ctx, width=150):
    """Causal over a window of `width` keys plus key 0: whole key blocks invisible to a row, on either side."""
    mask = causal_mask(q, ctx) & (torch.arange(ctx)[None, :] > torch.arange(ctx - q, ctx)[:, None] - width)
    mask[..., 0] = True
    return mask


def errors(query, key, value, mask, fused):
    scale = query.shape[-1] ** -0.5
    group = query.shape[1] // key.shape[1]
    reference = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float().repeat_interleave(group, 1), value.float().repeat_interleave(group, 1),
        attn_mask=mask, scale=scale).transpose(1, 2)
    theirs = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                              enable_gqa=True).transpose(1, 2)
    assert fused.shape == reference.shape and fused.dtype == torch.bfloat16 and fused.is_contiguous()
    return (fused.float() - reference).abs().max().item(), (theirs.float() - reference).abs().max().item()


@pytest.fixture(params=["avx512", "amx"])
def path(request):
    """The kernel's AVX-512 path, or its AMX tiles (skipped on a CPU without them); AMX back on afterwards."""
    if request.param == "amx" and not kernels.attention_use_amx(True):
        pytest.skip("no AMX tiles here")
    kernels.attention_use_amx(request.param == "amx")
    yield request.param
    kernels.attention_use_amx(True)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("q,ctx", LENGTHS)
@pytest.mark.parametrize("kind", ["causal", "causal-mask", "random-mask", "window-mask"])
def test_matches_fp32_reference(shape, q, ctx, kind, path):
    query, key, value = inputs(*shape, q, ctx)
    mask = {"random-mask": random_mask, "window-mask": window_mask}.get(kind, causal_mask)(q, ctx)
    fused = kernels.flash_attention(query, key, value, None if kind == "causal" else mask, None,
                                    causal=kind == "causal")
    ours, theirs = errors(query, key, value, mask, fused)
    print(f"{path} {shape} q={q} ctx={ctx} {kind}: max abs error {ours:.2e} (torch bf16 {theirs:.2e})")
    assert ours <= 2 * theirs + 1e-4, (ours, theirs)


def test_unsupported_calls_fall_back():
    query, key, value = inputs(12, 2, 128, 8, 100)
    mask = causal_mask(8, 100)
    assert kernels.flash_attention(query.float(), key.float(), value.float(), mask, None) is None  # fp32
    assert kernels.flash_attention(query, key, value, torch.zeros(1, 1, 8, 100), None) is None  # additive mask
    assert kernels.flash_attention(query, key, value, None, None) is None  # no mask, not causal: decode's case
    q2, k2, v2 = inputs(4, 2, 96, 8, 100)
    assert kernels.flash_attention(q2, k2, v2, causal_mask(8, 100), None) is None  # head_dim 96


def test_engine_attention_takes_the_kernel_where_it_is_the_faster(monkeypatch):
    """MARGINALIA_ATTENTION=fused routes a masked pass to the kernel and `torch` keeps torch's path; unset (auto),
    the kernel runs on a CPU with AVX-512 BF16: without AMX on its AVX-512 path, with AMX on its tiles (where its
    AVX-512 path would be the slower)."""
    query, key, value = inputs(12, 2, 128, 512, 2048)
    mask = causal_mask(512, 2048)
    monkeypatch.setenv("MARGINALIA_ATTENTION", "torch")
    plain, _ = attention(None, query, key, value, mask, scaling=None)
    monkeypatch.setenv("MARGINALIA_ATTENTION", "fused")
    fused, _ = attention(None, query, key, value, mask, scaling=None)
    assert torch.equal(fused, kernels.flash_attention(query, key, value, mask, None))
    assert not torch.equal(fused, plain)  # a different kernel: the same values within bf16 rounding only
    assert (fused.float() - plain.float()).abs().max().item() < 0.02
    monkeypatch.delenv("MARGINALIA_ATTENTION")
    automatic, _ = attention(None, query, key, value, mask, scaling=None)
    tiles_or_none = "amx_bf16" not in kernels.cpu_flags() or kernels.attention_use_amx(True)
    assert torch.equal(automatic, fused if tiles_or_none else plain)
