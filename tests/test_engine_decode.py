"""engine/attention.py's decode and short-pass paths: the model uses them, and they give what transformers' SDPA
gives."""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine import attention as attention_paths
from engine.attention import NAME, grouped_decode, grouped_rows, grouped_sdpa
from engine.cache import make_cache
from engine.generate import Runner
from tests.conftest import TOLERANCE, shared


def _tokens(engine, n: int) -> list[int]:
    text = shared("books", "pg84.txt").read_text(encoding="utf-8")[20000:60000]
    return engine.lm.tokenizer(text, add_special_tokens=False)["input_ids"][:n]


def _filled_cache(engine, n: int = 700):
    """A real cache holding `n` tokens of a book; (cache, config, head_dim, group)."""
    model = engine.lm.model
    cache = make_cache(model, 1024)
    Runner(model, engine.lm.tokenizer, engine.lm.device).prefill(_tokens(engine, n), cache)
    cfg = model.config
    return cache, cfg, cfg.hidden_size // cfg.num_attention_heads, cfg.num_attention_heads // cfg.num_key_value_heads


@contextlib.contextmanager
def _attention(model, name: str):
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def test_cpu_models_load_with_the_decode_path(engine):
    assert engine.lm.attention == NAME == engine.lm.model.config._attn_implementation


def test_grouped_decode_equals_sdpa_on_the_cache(engine):
    """The kernel alone, over the real cache's keys and values (views of the preallocated buffers), against the
    library's SDPA with the key/value heads repeated: fp32 rounding only."""
    cache, cfg, head_dim, group = _filled_cache(engine)
    assert group > 1  # grouped-query: the case worth checking
    query = torch.randn(1, cfg.num_attention_heads, 1, head_dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for layer in cache.layers[::7]:
            keys, values = layer.keys[:, :, :cache.length], layer.values[:, :, :cache.length]
            ours = grouped_decode(query, keys, values, head_dim ** -0.5)
            theirs = torch.nn.functional.scaled_dot_product_attention(
                query, keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1),
                scale=head_dim ** -0.5).transpose(1, 2)
            assert ours.shape == theirs.shape
            assert (ours - theirs).abs().max().item() <= 1e-5


def test_decoding_with_it_equals_sdpa(engine):
    """Whole decode steps: the next-token logits after 700 cached tokens agree within fp32 tolerance, and greedy
    decoding picks the same 16 tokens."""
    model = engine.lm.model
    runner, ids = Runner(model, engine.lm.tokenizer, engine.lm.device), _tokens(engine, 700)
    cache = make_cache(model, 1024)
    logits = runner.prefill(ids[:-1], cache)
    runs = {}
    for name in (NAME, "sdpa"):
        with _attention(model, name):
            cache.truncate(len(ids) - 1)
            step = runner.forward([ids[-1]], cache)
            cache.truncate(len(ids) - 1)
            tokens = [t for t, _ in runner.decode(cache, logits, 16)]
        runs[name] = step, tokens
    assert (runs[NAME][0] - runs["sdpa"][0]).abs().max().item() <= TOLERANCE["engine"]
    assert runs[NAME][1] == runs["sdpa"][1] and len(runs[NAME][1]) == 16


@pytest.mark.parametrize("kernel", [grouped_rows, grouped_sdpa])
def test_grouped_passes_equal_sdpa_with_a_causal_and_a_scratch_mask(engine, kernel):
    """A pass of several tokens after the cache, with the key/value heads grouped (rows per head, or torch's own
    grouped heads past the rows' bound), against the library's SDPA with the heads repeated, over the real cache's
    keys and values: a causal mask (boolean, as transformers makes it) and a scratch mask (additive, hiding part
    of the document as Scratch does). fp32 rounding only."""
    cache, cfg, head_dim, group = _filled_cache(engine)
    q, context = 12, cache.length
    query = torch.randn(1, q, cfg.num_attention_heads, head_dim, generator=torch.Generator().manual_seed(1))
    query = query.transpose(1, 2)  # as the model hands it over: a view, not contiguous
    causal = (torch.arange(context)[None, :] <= torch.arange(context - q, context)[:, None])[None, None]
    scratch = torch.zeros(1, 1, q, context).masked_fill_(~causal, float("-inf"))
    scratch[..., 300:context - q] = float("-inf")  # rows that see the document up to 300 and their own tokens
    with torch.inference_mode():
        for layer in cache.layers[::7]:
            keys, values = layer.keys[:, :, :context], layer.values[:, :, :context]
            for mask in (causal, scratch):
                ours = kernel(query, keys, values, mask, head_dim ** -0.5)
                theirs = torch.nn.functional.scaled_dot_product_attention(
                    query, keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1),
                    attn_mask=mask, scale=head_dim ** -0.5).transpose(1, 2)
                assert ours.shape == theirs.shape == (1, q, cfg.num_attention_heads, head_dim)
                assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("bound", ["rows", "past the rows' bound"])
def test_short_passes_with_it_equal_sdpa(engine, bound, monkeypatch):
    """Whole passes of 2, 9 and 40 tokens after 600 cached tokens (the sizes of copied sentences and margin
    instructions): the logits of every position agree with the library's `sdpa` within fp32 tolerance. Past the
    bound on repeated rows (there from 512-token passes over a few thousand tokens), the same passes take
    torch's grouped heads."""
    taken = []
    if bound != "rows":
        monkeypatch.setattr(attention_paths, "ROWS_MASK_ELEMENTS", 0)
        monkeypatch.setattr(attention_paths, "grouped_sdpa", lambda *a: taken.append(1) or grouped_sdpa(*a))
    model = engine.lm.model
    runner, ids = Runner(model, engine.lm.tokenizer, engine.lm.device), _tokens(engine, 700)
    cache = make_cache(model, 1024)
    runner.prefill(ids[:600], cache)
    taken.clear()  # the prefill's own pass took it too
    for n in (2, 9, 40):
        out = {}
        for name in (NAME, "sdpa"):
            with _attention(model, name):
                out[name] = runner.forward(ids[600:600 + n], cache, all_logits=True)
                cache.truncate(600)
        assert (out[NAME] - out["sdpa"]).abs().max().item() <= TOLERANCE["engine"]
    assert len(taken) == (0 if bound == "rows" else 3 * engine.lm.model.config.num_hidden_layers)
