"""The path a CUDA device takes, run on this CPU: a whole reading loaded with a GPU's choices (load_model's
`runs_as="cuda"`: the library's attention, transformers' forward, nothing from engine/kernels, no decode packs), in
bf16 where the CPU has bf16 matrix units (fp32 elsewhere, where bf16 is emulated and ~100x slower); and bench/gpu.py,
the script a GPU session runs, smoke-run here with the small model and small lengths."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from engine import Answer, Engine, Margin, SegmentRead, Settings, Stats
from engine.generate import Runner
from engine.model import cpu_has_bf16_matrix_units, load_model, pick_attention
from tests.conftest import ROOT

DTYPE = "bf16" if cpu_has_bf16_matrix_units() else "fp32"
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}[DTYPE]


@pytest.fixture(scope="module")
def gpu_path():
    if pick_attention(torch.device("cuda")) != "sdpa":
        pytest.skip("flash-attn imports here: a GPU's choice would be its kernels, which need a GPU")
    return Engine(load_model("embedded", device="cpu", dtype=DTYPE, runs_as="cuda"))


def test_the_gpu_path_is_chosen_by_the_same_code_as_on_cuda(gpu_path):
    lm = gpu_path.lm
    assert lm.runs_as == "cuda" and lm.device.type == "cpu" and lm.dtype == TORCH_DTYPE
    # the library's attention, as on a GPU without flash-attn; not engine/attention.py's `marginalia`
    assert lm.attention == lm.model.config._attn_implementation == "sdpa"
    assert lm.packs is None and lm.prefill_int8 is None and lm.prepacked is None
    # no module of the engine's inside the model (decode packs, int8 copies): transformers' and torch's only
    assert {type(m).__module__.split(".")[0] for m in lm.model.modules()} == {"torch", "transformers"}
    runner = lm.runner()
    assert runner.prefill_step is None and runner.decode_step is None  # transformers' forward for every pass
    # A Runner made for a CUDA device by hand chooses alike: the written-out prefill merges its passes with
    # torch's CPU flash kernel, which has no CUDA kernel.
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_dot_product_flash_attention_for_cpu",
                                                              "CUDA")
    assert Runner(lm.model, lm.tokenizer, torch.device("cuda")).prefill_step is None
    assert Runner(lm.model, lm.tokenizer, lm.device).prefill_step is not None  # a CPU's own path writes it out
    # Asked for a CPU kernel, the GPU's path refuses as CUDA does.
    with pytest.raises(ValueError, match="need a CPU"):
        load_model("embedded", device="cpu", dtype=DTYPE, decode_weights="gguf4", runs_as="cuda")


def test_a_whole_reading_down_the_gpu_path(gpu_path):
    sample = (ROOT / "data" / "sample" / "alice-down-the-rabbit-hole.md").read_text(encoding="utf-8")
    text = sample[:sample.rindex("\n\n", 0, 3600)]  # ~900 tokens: three or four segments
    query = "What ran close by Alice?"
    settings = Settings(segment_tokens=300, margin_tokens=24, answer_tokens=16, classifier="margin")
    reading = gpu_path.open(text, settings)
    assert reading.runner.prefill_step is None and reading.runner.decode_step is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        events = list(reading.read(query)) + list(reading.answer(query))
    ops = {e.name for e in profile.events()}
    # nothing from engine/kernels ran (its ops are registered as marginalia::* and marginalia_gemv::*)
    assert not [name for name in ops if name.startswith("marginalia")]
    assert "aten::scaled_dot_product_attention" in ops and "aten::linear" in ops
    segments = [e for e in events if isinstance(e, SegmentRead)]
    margins = [e for e in events if isinstance(e, Margin)]
    answers = [e for e in events if isinstance(e, Answer)]
    n = len(reading.segments)
    assert n >= 3 and [s.index for s in segments] == [m.index for m in margins] == list(range(n))
    assert any(m.text for m in margins)  # copied sentences: each one is the document's own text
    for m in margins:
        assert all(0 <= a < b <= len(text) for a, b in m.spans)
    assert len(answers) == 1 and answers[0].text.strip()  # what the 135M answers is not its test: that it answers
    read, answer = [e for e in events if isinstance(e, Stats)]
    assert read.prefill_tokens > len(reading.doc.token_ids) and answer.decode_tokens > 0
    assert reading.cache.length == reading.doc_end


@pytest.mark.slow
def test_bench_gpu_smoke(tmp_path):
    out = tmp_path / "gpu.md"
    cmd = [sys.executable, "-m", "bench.gpu", "--lengths", "128,256,16384", "--decode-tokens", "8", "--model",
           "embedded", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    md = out.read_text()
    assert "error" not in md, md
    assert "| device | CPU: " in md and "SmolLM2-135M" in md and "torch's SDPA (`sdpa`" in md
    assert f"| dtype | {'bfloat16' if DTYPE == 'bf16' else 'float32'} |" in md
    assert re.search(r"\| matmul rate \| [\d.]+ TFLOP/s", md)
    assert "| engine/prefill_step.py, engine/decode_step.py (a CPU's) | not used |" in md
    for n in ("128", "256"):  # tokens, seconds, tokens/s, TFLOP/s, share of the matmul rate
        assert re.search(rf"\| {n} \| [\d.]+ \| [\d,]+ \| [\d.e+-]+ \| [\d.]+% \|", md), n
    assert "| 16,384 | skipped: over the model's context window (8,192 tokens) |" in md
    assert re.search(r"\| 128 \| 8 \| [\d.]+ \|", md)  # decode: context, tokens, ms per token
    assert re.search(r"\| WiM \| [\d.]+ \| \d+ \| \d+ \| [1-9]\d* \|", md)
    assert re.search(r"\| plain reading \| [\d.]+ \| \d+ \| \d+ \| 0 \|", md)
    assert re.search(r"\| WiM / plain \| [\d.]+x \|", md)
