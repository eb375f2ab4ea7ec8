"""Decode steps on the GGUF's own 4-bit blocks (engine/packed.py): the groups are the file's values, the packs
are checked against the loaded weights, and the real model decodes the same tokens with them."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine import packed
from engine.decode_copy import DECODE_ROWS
from engine.generate import Runner
from engine.model import embedded_gguf, load_model, pick_decode_weights
from engine import kernels
from engine.packed import (GROUP, INT8_KINDS, Int8Linear, PackedLinear, Q4Linear, add_decode_packs, build_packs,
                           groups_of, int8_groups_of)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_groups_are_the_files_values(kind):
    """scale * q + low equals gguf-py's own de-quantization of the same blocks, bit for bit. Q4_0/Q4_1 blocks
    from gguf-py's quantizer; Q4_K (it has none) random bytes under valid scales: every bit pattern counts."""
    rng = np.random.default_rng(0)
    if kind == "Q4_K":
        blocks = rng.integers(0, 256, (48, 2, 144), dtype=np.uint8)
        blocks[..., 0:4] = rng.uniform(1e-4, 1e-2, (48, 2, 2)).astype(np.float16).view(np.uint8)  # d, dmin
        blocks = blocks.reshape(48, -1)
    else:
        values = (rng.standard_normal((48, 512)) * rng.uniform(0.01, 0.2, (48, 1))).astype(np.float32)
        blocks = quants.quantize(values, GGMLQuantizationType[kind])
    expected = quants.dequantize(blocks, GGMLQuantizationType[kind])
    q, scale, low = groups_of(kind, blocks)
    assert q.min() >= 0 and q.max() <= 15 and scale.shape == (48, 512 // GROUP)
    got = (q.reshape(48, -1, GROUP).astype(np.float32) * scale[..., None] + low[..., None]).reshape(48, 512)
    np.testing.assert_array_equal(got, expected)


def greedy_steps(lm, prompt: list[int], steps: int = 32) -> list[tuple[int, torch.Tensor]]:
    """(token, logits) of `steps` greedy decode steps after `prompt`."""
    runner = Runner(lm.model, lm.tokenizer, lm.device)
    cache = runner.new_cache(len(prompt) + steps + 1)
    logits = runner.prefill(prompt, cache)
    out = []
    for _ in range(steps):
        token = int(logits.argmax())
        out.append((token, logits.float()))
        logits = runner.forward([token], cache)  # the last position's logits, [vocab]
    return out


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_int8_groups_are_the_files_values(kind):
    """scale * q equals gguf-py's de-quantization bit for bit: Q8_0 from gguf-py's quantizer, Q6_K (it has none)
    random bytes under valid scales."""
    rng = np.random.default_rng(1)
    if kind == "Q6_K":
        blocks = rng.integers(0, 256, (48, 2, 210), dtype=np.uint8)
        blocks[..., 208:210] = rng.uniform(1e-4, 1e-2, (48, 2, 1)).astype(np.float16).view(np.uint8)  # d
        blocks = blocks.reshape(48, -1)
    else:
        values = (rng.standard_normal((48, 512)) * rng.uniform(0.01, 0.2, (48, 1))).astype(np.float32)
        blocks = quants.quantize(values, GGMLQuantizationType[kind])
    expected = quants.dequantize(blocks, GGMLQuantizationType[kind])
    q, scale = int8_groups_of(kind, blocks)
    group = INT8_KINDS[kind]
    assert q.dtype == np.int8 and scale.shape == (48, 512 // group)
    if kind == "Q6_K":
        assert q.min() >= -32 and q.max() <= 31
    got = (q.reshape(48, -1, group).astype(np.float32) * scale[..., None]).reshape(48, 512)
    np.testing.assert_array_equal(got, expected)


needs_gemv = pytest.mark.skipif(kernels.GEMV.load() is None, reason="gemv_gguf kernels unavailable (no AVX2)")


@needs_gemv
@pytest.mark.parametrize("group", [16, 32])
def test_the_int8_kernel_is_a_matmul_of_the_same_values(group):
    """1-4 rows times scale * q: a matmul of the de-quantized matrix up to the order of fp32 sums; bf16 rows
    come back in bf16; what it does not take (5 rows, groups of 8) is None, never a wrong answer."""
    torch.manual_seed(0)
    q = torch.randint(-128, 128, (1000, 768), dtype=torch.int8)
    scale = torch.rand(1000, 768 // group) * 0.01
    weight = scale.repeat_interleave(group, 1) * q.float()
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 768)
        exact = x.double() @ weight.double().T
        got = kernels.gemv_int8(x, q, scale)
        assert got.dtype == torch.float32 and got.shape == (rows, 1000)
        assert (got.double() - exact).abs().max() <= 4 * (x @ weight.T - exact).abs().max() + 1e-6
    assert kernels.gemv_int8(x.bfloat16(), q, scale).dtype == torch.bfloat16
    assert kernels.gemv_int8(torch.randn(5, 768), q, scale) is None
    assert kernels.gemv_int8(torch.randn(1, 768), q, torch.rand(1000, 96)) is None  # groups of 8


@needs_gemv
def test_the_q4_kernel_is_a_matmul_of_the_same_values():
    """1-4 rows times scale * q + low, q two a byte (value j low, value j + 16 high in a group's byte j): a
    matmul of the de-quantized matrix up to the order of fp32 sums."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (1000, 768), dtype=torch.uint8)
    scale, low = torch.rand(1000, 24) * 0.01, torch.randn(1000, 24) * 0.05
    halves = q.reshape(1000, 24, 2, 16)
    packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(1000, 384)
    weight = (q.float().reshape(1000, 24, 32) * scale[..., None] + low[..., None]).reshape(1000, 768)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 768)
        exact = x.double() @ weight.double().T
        got = kernels.gemv_q4(x, packed, scale, low)
        assert got.shape == (rows, 1000)
        assert (got.double() - exact).abs().max() <= 4 * (x @ weight.T - exact).abs().max() + 1e-6
    assert kernels.gemv_q4(torch.randn(1, 760), packed, scale, low) is None  # K not the matrix's


def rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far y = x @ weight.T may move when x is rounded to int8 in blocks of 32 (step d = max|x| / 127 a
    block, each value within d / 2): sum over k of |weight[n, k]| * d(k) / 2."""
    step = x.abs().reshape(x.shape[0], -1, 32).amax(-1).repeat_interleave(32, 1).double() / 127
    return (step / 2) @ weight.abs().double().T


@needs_gemv
@pytest.mark.parametrize("group", [16, 32])
def test_the_int8_input_kernels_are_within_the_rounding_of_x(group):
    """round_x (`gguf-q8`): each product is an integer dot product of x's int8 blocks, so y is the exact matmul
    up to the rounding of x (rounding_bound) plus fp32 sums; its error is larger than the fp32 kernel's (the
    rounding is real), but within the bound, on rows with one large value too (a block's step grows with it).
    The scales come in fp16: here values fp16 holds exactly, so the bound is x's rounding alone."""
    torch.manual_seed(0)
    q8 = torch.randint(-128, 128, (1000, 768), dtype=torch.int8)
    scale8 = (torch.rand(1000, 768 // group) * 0.01).half().float()  # scales as fp16 holds them
    weight8 = scale8.repeat_interleave(group, 1) * q8.float()
    q4 = torch.randint(0, 16, (1000, 768), dtype=torch.uint8)
    scale4, low4 = (torch.rand(1000, 24) * 0.01).half().float(), (torch.randn(1000, 24) * 0.05).half().float()
    halves = q4.reshape(1000, 24, 2, 16)
    packed4 = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(1000, 384)
    weight4 = (q4.float().reshape(1000, 24, 32) * scale4[..., None] + low4[..., None]).reshape(1000, 768)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 768)
        x[0, 5] = 40.0  # an outlier: its block's step is 40 / 127
        for weight, got in ((weight8, kernels.gemv_int8(x, q8, scale8.half(), round_x=True)),
                            (weight4, kernels.gemv_q4(x, packed4, scale4.half(), low4.half(), round_x=True))):
            exact = x.double() @ weight.double().T
            error = (got.double() - exact).abs()
            assert got.shape == (rows, 1000)
            assert (error <= rounding_bound(x, weight) + 1e-3).all()
            assert error.max() > 4 * (x @ weight.T - exact).abs().max()  # x was rounded: not the fp32 kernel
    x = torch.randn(1, 768).bfloat16()
    assert kernels.gemv_q4(x, packed4, scale4.half(), low4.half(), round_x=True).dtype == torch.bfloat16
    assert kernels.gemv_int8(torch.randn(5, 768), q8, scale8.half(), round_x=True) is None
    assert kernels.gemv_int8(x, q8, scale8, round_x=True) is None  # fp32 scales: refused, not misread


@needs_gemv
def test_one_call_for_several_matrices_gives_their_own_calls_values():
    """gemv_q8_many (a layer's q, k and v, or gate and up, in one call): each matrix's output is its own
    gemv_q4/gemv_int8 call's, bit for bit, for a mix of 4-bit and int8 (groups of 16 and 32) matrices whose rows
    do not fall on the threads' grain of 64; too many rows are refused."""
    torch.manual_seed(1)
    K = 512
    q4 = torch.randint(0, 256, (200, K // 2), dtype=torch.uint8)
    scale4, low4 = (torch.rand(200, K // 32) * 0.01).half(), (torch.randn(200, K // 32) * 0.05).half()
    q16, scale16 = torch.randint(-128, 128, (70, K), dtype=torch.int8), (torch.rand(70, K // 16) * 0.01).half()
    q32, scale32 = torch.randint(-128, 128, (130, K), dtype=torch.int8), (torch.rand(130, K // 32) * 0.01).half()
    empty = scale16.new_empty(0, 0)
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (1, 3, 4):
            x = torch.randn(rows, K)
            ys = kernels.gemv_q8_many(x, [q4, q16, q32], [scale4, scale16, scale32], [low4, empty, empty])
            alone = [kernels.gemv_q4(x, q4, scale4, low4, round_x=True),
                     kernels.gemv_int8(x, q16, scale16, round_x=True), kernels.gemv_int8(x, q32, scale32, round_x=True)]
            assert [y.shape for y in ys] == [(rows, 200), (rows, 70), (rows, 130)]
            assert all(torch.equal(a, b) for a, b in zip(ys, alone))
    torch.set_num_threads(before)
    assert kernels.gemv_q8_many(torch.randn(5, K), [q4], [scale4], [low4]) is None


@needs_gemv
def test_the_avx512_path_gives_the_avx2_paths_values():
    """Where the CPU has AVX-512 VNNI the int8-input kernels take two groups an instruction; their outputs are the
    AVX2 path's bit for bit (the same integer sums, the same FMAs in the same order per lane), for 4-bit and int8
    (groups of 16 and 32) matrices, an odd number of groups (the last one through the AVX2 code), 1-4 rows, 1 and
    2 threads, and the extremes of the values (weights -128 and 15, x rounded to +-127)."""
    if not kernels.use_avx512(True):
        pytest.skip("this CPU (or build) has no AVX-512 VNNI")
    torch.manual_seed(2)
    K = 32 * 15
    q4 = torch.randint(0, 256, (150, K // 2), dtype=torch.uint8)
    q4[0] = 255  # every value 15
    scale4, low4 = (torch.rand(150, K // 32) * 0.01).half(), (torch.randn(150, K // 32) * 0.05).half()
    q16, scale16 = torch.randint(-128, 128, (70, K), dtype=torch.int8), (torch.rand(70, K // 16) * 0.01).half()
    q32, scale32 = torch.randint(-128, 128, (130, K), dtype=torch.int8), (torch.rand(130, K // 32) * 0.01).half()
    q16[0], q32[0] = -128, -128
    empty = scale16.new_empty(0, 0)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4):
                x = torch.randn(rows, K)
                x[0, :32] = torch.where(torch.arange(32) % 2 == 0, -3.0, 3.0)  # a block of +-127 after rounding
                outputs = {}
                for wide in (True, False):
                    assert kernels.use_avx512(wide) == wide
                    outputs[wide] = [*kernels.gemv_q8_many(x, [q4, q16, q32], [scale4, scale16, scale32],
                                                           [low4, empty, empty]),
                                     kernels.gemv_q4(x, q4, scale4, low4, round_x=True),
                                     kernels.gemv_int8(x, q16, scale16, round_x=True),
                                     kernels.gemv_int8(x, q32, scale32, round_x=True)]
                assert all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False]))
    finally:
        torch.set_num_threads(before)
        kernels.use_avx512(True)


@needs_gemv
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_written_out_decode_step_gives_transformers_logits(dtype):
    """engine/decode_step.py, taken for every one-token step when all linears carry gguf-q8 copies: 24 greedy
    steps give transformers' logits and cache keys bit for bit (the same operations in the same order; q, k and v
    in one kernel call), with its layers run from C++ (decode_layers.cpp, the default) and in Python alike.
    Other decode weights keep transformers' forward."""
    from engine.decode_step import DecodeStep
    lm = load_model("embedded", "cpu", dtype, decode_weights="gguf-q8")
    written_out = Runner(lm.model, lm.tokenizer, lm.device)
    assert written_out.decode_step is not None and written_out.decode_step.native is not None
    python_loop = Runner(lm.model, lm.tokenizer, lm.device)
    python_loop.decode_step = DecodeStep(lm.model, native=False)
    transformers_forward = Runner(lm.model, lm.tokenizer, lm.device)
    transformers_forward.decode_step = None
    prompt = lm.tokenizer("Mary went to the kitchen. John moved to the garden. Where is Mary? Mary is in").input_ids
    runs = []
    for runner in (written_out, python_loop, transformers_forward):
        cache = runner.new_cache(len(prompt) + 25)
        logits, steps = runner.prefill(prompt, cache), []
        for _ in range(24):
            steps.append(logits)
            logits = runner.forward([int(logits.argmax())], cache)
        runs.append((steps, cache.layers[-1].keys[:, :, :cache.length].clone(), cache.length))
    (a, keys_a, length_a), *others = runs
    for b, keys_b, length_b in others:
        assert length_a == length_b == len(prompt) + 24
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(keys_a, keys_b)
    assert a[0].dtype == torch.float32
    for weights in ("gguf", "full"):
        other = load_model("embedded", "cpu", dtype, decode_weights=weights)
        assert Runner(other.model, other.tokenizer, other.device).decode_step is None


def forced_steps(lm, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits before each of `tokens`, fed one decode step at a time after `prompt` (teacher forcing: one
    near-tie decided the other way does not change every later step)."""
    runner = Runner(lm.model, lm.tokenizer, lm.device)
    cache = runner.new_cache(len(prompt) + len(tokens) + 1)
    out = [runner.prefill(prompt, cache)]
    for token in tokens[:-1]:
        out.append(runner.forward([token], cache))
    return out


@needs_gemv
def test_int8_inputs_keep_the_greedy_tokens():
    """`gguf-q8` against the full weights (135M, fp32), both fed the full weights' 32 greedy tokens on three
    prompts: the same top token at >= 90% of the 96 steps, logits within 2 (the inputs' rounding, as llama.cpp's:
    93/96 and 1.07 measured here, the top logit ~15-27; free-running, the first prompt parted at its third token)."""
    both = [load_model("embedded", "cpu", "fp32", decode_weights=w) for w in ("full", "gguf-q8")]
    assert "int8 inputs" in both[1].info["decode_weights"]
    assert all(m.round_x for m in both[1].model.modules() if isinstance(m, (Q4Linear, Int8Linear)))
    chat = both[0].tokenizer.apply_chat_template([{"role": "user", "content": "Write two sentences about the sea."}],
                                                 tokenize=False, add_generation_prompt=True)
    same = steps = 0
    worst = 0.0
    for text in ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing "
                 "to do", "Mary went to the kitchen. John moved to the garden. Where is Mary? Mary is in", chat):
        prompt = both[0].tokenizer(text).input_ids
        tokens = [t for t, _ in greedy_steps(both[0], prompt)]
        full, rounded = (forced_steps(lm, prompt, tokens) for lm in both)
        same += sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(full, rounded))
        steps += len(tokens)
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(full, rounded)))
    print(f"same top token {same}/{steps}, worst logit difference {worst:.3f}")
    assert same >= 0.9 * steps
    assert 0 < worst < 2


@needs_gemv
def test_gguf_decode_copies_give_the_same_tokens():
    """`gguf`: the 135M's Q4_1 matrices go to gemv_q4 and its Q8_0 embedding, tied to the output matrix, to
    gemv_int8; 32 greedy steps give the same tokens as the full weights, logits within 5e-3 (fp32: the same values,
    other sums; 3.4e-3 measured over the 32 steps, logits up to ~27, where torch's int4 kernel gave 1.4e-3)."""
    both = [load_model("embedded", "cpu", "fp32", decode_weights=w) for w in ("full", "gguf")]
    head = both[1].model.lm_head
    assert isinstance(head, Int8Linear) and head.weight is both[1].model.model.embed_tokens.weight
    layers = both[1].model.config.num_hidden_layers
    assert sum(isinstance(m, Q4Linear) for m in both[1].model.modules()) == 7 * layers
    assert not any(isinstance(m, PackedLinear) for m in both[1].model.modules())
    assert both[1].packs["packed"] == 7 * layers + 1 and "8-bit" in both[1].info["decode_weights"]
    assert both[0].packs is None
    prompt = both[0].tokenizer("It was the best of times, it was the worst of times, it was the age of wisdom, "
                               "it was the age of foolishness").input_ids
    runs = [greedy_steps(lm, prompt) for lm in both]
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    worst = max((a - b).abs().max().item() for (_, a), (_, b) in zip(*runs))
    assert 0 < worst < 5e-3  # not 0: the head's kernel ran


@pytest.fixture(scope="module")
def models():
    """The embedded model in fp32 with and without the packs (fp32: the packs and the weights hold the file's
    values exactly, so only the kernels' summation order differs)."""
    return (load_model("embedded", "cpu", "fp32", decode_weights="gguf4"),
            load_model("embedded", "cpu", "fp32", decode_weights="full"))


def test_every_4bit_matrix_is_packed(models):
    with_packs, full = models
    layers = full.model.config.num_hidden_layers
    # SmolLM2's GGUF: every q, k, v, o, gate, up and down matrix is Q4_1 (its embedding, tied to the head, Q8_0).
    assert with_packs.packs["packed"] == 7 * layers
    assert sum(isinstance(m, PackedLinear) for m in with_packs.model.modules()) == 7 * layers
    assert not any(isinstance(m, PackedLinear) for m in full.model.modules())
    assert "4-bit" in with_packs.info["decode_weights"] and full.info["decode_weights"] == "full"


def test_long_passes_keep_the_full_weights(models):
    layer = next(m for m in models[0].model.modules() if isinstance(m, PackedLinear))
    x = torch.randn(1, DECODE_ROWS + 1, layer.in_features)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    few = x[:, :2]
    assert not torch.equal(layer(few), torch.nn.functional.linear(few, layer.weight, layer.bias))  # the kernel ran
    torch.testing.assert_close(layer(few), torch.nn.functional.linear(few, layer.weight, layer.bias),
                               rtol=1e-4, atol=1e-4)


def test_decoding_with_packs_gives_the_same_tokens(models):
    """32 greedy steps after a prompt: the same tokens, logits within 2e-3 at every step (torch's int4 kernel sums
    in another order on each CPU: up to 1.4e-3 here on an AMD EPYC with AVX2 only, logits up to ~27)."""
    prompt = models[1].tokenizer("Alice was beginning to get very tired of sitting by her sister on the bank, "
                                 "and of having nothing to do: once or twice she had peeped into the book").input_ids
    runs = [greedy_steps(lm, prompt) for lm in models]
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    worst = max((a - b).abs().max().item() for (_, a), (_, b) in zip(*runs))
    assert worst < 2e-3


def test_a_matrix_that_does_not_match_stays_unpacked(caplog):
    """A weight that is not the file's (another row order, a re-saved model): left unpacked, with a warning."""
    lm = load_model("embedded", "cpu", "fp32", decode_weights="full")
    proj = lm.model.model.layers[3].mlp.up_proj
    with torch.no_grad():
        proj.weight[7] = proj.weight[7].flip(0)
    with caplog.at_level(logging.WARNING, logger="engine.packed"):
        packs = build_packs(lm.model, embedded_gguf())
    assert "model.layers.3.mlp.up_proj.packed" not in packs
    assert "model.layers.3.mlp.gate_proj.packed" in packs and "model.layers.4.mlp.up_proj.packed" in packs
    assert "layers.3.mlp.up_proj" in caplog.text


def test_the_packs_are_built_once(tmp_path, monkeypatch):
    lm = load_model("embedded", "cpu", "fp32", decode_weights="full")
    folder = tmp_path / "model"  # the converted model's folder: the packs go beside it, never into it
    folder.mkdir()
    first = add_decode_packs(lm.model, embedded_gguf(), folder)
    assert packed.packs_path(folder).exists() and not list(tmp_path.glob("*.partial*"))
    assert not list(folder.iterdir())

    def no_build(*args):
        raise AssertionError("built again")
    monkeypatch.setattr(packed, "build_packs", no_build)
    again = load_model("embedded", "cpu", "fp32", decode_weights="full")
    assert add_decode_packs(again.model, embedded_gguf(), folder) == first


def test_where_packs_are_used(monkeypatch):
    from engine import model
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(model, "cpu_has_avx512", lambda: True)
    assert pick_decode_weights("auto", cpu, torch.bfloat16) == ("gguf-q8" if kernels.GEMV.load() else "gguf4")
    monkeypatch.setattr(kernels.GEMV, "load", lambda: None)  # no compiler: torch's int4 kernel
    assert pick_decode_weights("auto", cpu, torch.bfloat16) == "gguf4"
    monkeypatch.undo()
    monkeypatch.setattr(model, "cpu_has_avx512", lambda: False)   # torch's int4 kernel is slow without it
    assert pick_decode_weights("auto", cpu, torch.float32) == "full"
    assert pick_decode_weights("gguf4", cpu, torch.float32) == "gguf4"
    monkeypatch.setattr(model, "cpu_has_avx512", lambda: True)
    assert pick_decode_weights("auto", cpu, torch.float64) == "full"   # the kernel has no fp64
    assert pick_decode_weights("auto", cuda, torch.bfloat16) == "full"
    assert pick_decode_weights("full", cpu, torch.float32) == "full"
    assert pick_decode_weights("gguf", cpu, torch.float32) == "gguf"     # opt-in only
    assert pick_decode_weights("gguf-q8", cpu, torch.bfloat16) == "gguf-q8"
    with pytest.raises(ValueError, match="need a CPU"):
        pick_decode_weights("gguf4", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="need a CPU"):
        pick_decode_weights("gguf", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="must be auto"):
        pick_decode_weights("int3", cpu, torch.float32)
