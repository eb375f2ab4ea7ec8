"""The KV cache: chunked prefill equals one pass; a margin cut off leaves no trace; no copies, O(1) cuts."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from engine.cache import PreallocatedCache, make_cache
from engine.generate import Runner
from tests.conftest import shared

def _tokens(engine, n: int) -> list[int]:
    text = shared("books", "pg84.txt").read_text(encoding="utf-8")[20000:60000]
    return engine.lm.tokenizer(text, add_special_tokens=False)["input_ids"][:n]


def _runner(engine):
    return Runner(engine.lm.model, engine.lm.tokenizer, engine.lm.device)


def _max_kv_diff(a: PreallocatedCache, b, length: int) -> float:
    diff = 0.0
    for la, lb in zip(a.layers, b.layers):
        diff = max(diff, (la.keys[:, :, :length] - lb.keys[:, :, :length]).abs().max().item(),
                   (la.values[:, :, :length] - lb.values[:, :, :length]).abs().max().item())
    return diff


def test_chunked_prefill_equals_one_pass(any_engine):
    engine, tol = any_engine
    runner, ids = _runner(engine), _tokens(engine, 900)
    one = make_cache(engine.lm.model, 1024)
    logits_one = runner.prefill(ids, one)
    chunked = make_cache(engine.lm.model, 1024)
    for start in range(0, len(ids), 200):
        logits_chunked = runner.prefill(ids[start:start + 200], chunked)
    assert chunked.length == one.length == len(ids)
    assert (logits_chunked - logits_one).abs().max().item() <= tol
    assert _max_kv_diff(chunked, one, len(ids)) <= tol
    # ...and both agree with transformers' own DynamicCache over the same tokens.
    with torch.inference_mode():
        theirs = DynamicCache(config=engine.lm.model.config)
        out = engine.lm.model(input_ids=torch.tensor([ids]), use_cache=True, **{runner.cache_keyword: theirs})
    assert (out.logits[0, -1].float() - logits_one).abs().max().item() <= tol
    assert _max_kv_diff(one, theirs, len(ids)) <= tol


def test_margin_cut_off_leaves_cache_bit_identical(any_engine):
    engine, tol = any_engine
    runner, ids = _runner(engine), _tokens(engine, 700)
    first, second = ids[:400], ids[400:]
    cache = make_cache(engine.lm.model, 1024)
    runner.prefill(first, cache)
    before = {k: v.clone() for k, v in cache.state().items()}
    instruction = engine.layout.suffix("margin", query="Who is speaking?")
    logits = runner.prefill(instruction, cache)
    generated = [t for t, _ in runner.decode(cache, logits, 20)]
    assert generated and cache.length > len(first)
    cache.truncate(len(first))
    after = cache.state()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The next chunk sees exactly what a single pass over first+second would.
    logits_next = runner.prefill(second, cache)
    reference = make_cache(engine.lm.model, 1024)
    logits_ref = runner.prefill(ids, reference)
    assert (logits_next - logits_ref).abs().max().item() <= tol
    assert _max_kv_diff(cache, reference, len(ids)) <= tol


def test_decode_writes_in_place_and_never_reallocates(engine):
    runner, ids = _runner(engine), _tokens(engine, 300)
    cache = make_cache(engine.lm.model, 2048)
    runner.prefill(ids, cache)
    buffers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    nbytes = cache.nbytes()
    # Many margins written and cut: no growth, same buffers (a torch.cat cache would reallocate every step).
    for _ in range(5):
        logits = runner.prefill(engine.layout.suffix("margin", query="What happens?"), cache)
        for _ in runner.decode(cache, logits, 8):
            pass
        cache.truncate(len(ids))
    assert [(l.keys.data_ptr(), l.values.data_ptr()) for l in cache.layers] == buffers
    assert cache.nbytes() == nbytes
    # What attention reads is a view of the buffer, not a copy.
    k = torch.randn(1, cache.layers[0].keys.shape[1], 1, cache.layers[0].keys.shape[-1])
    with torch.inference_mode():
        keys, values = cache.layers[0].update(k, k.clone())
    assert keys.untyped_storage().data_ptr() == cache.layers[0].keys.untyped_storage().data_ptr()
    cache.truncate(len(ids))


def test_truncate_is_o1_at_any_length(engine):
    """Cutting back runs no tensor operation at all, whether the cache holds 1k or 8k tokens."""
    runner = _runner(engine)
    for length in (1024, 8000):
        cache = PreallocatedCache(engine.lm.model.config.num_hidden_layers, 8192)
        ids = (_tokens(engine, 1024) * 8)[:length]
        runner.prefill(ids, cache)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            cache.truncate(length - 500)
        ops = [e.name for e in prof.events() if e.name.startswith("aten::")]
        assert ops == [], f"truncate ran tensor ops at {length} tokens: {ops}"
        assert cache.length == length - 500


def test_truncate_rejects_growing(engine):
    cache = make_cache(engine.lm.model, 64)
    _runner(engine).prefill(_tokens(engine, 10), cache)
    try:
        cache.truncate(11)
    except ValueError:
        return
    raise AssertionError("truncate to a longer length must fail")
