"""Decode steps on the GGUF file's own 4-bit weights: its Q4_0, Q4_1 and Q4_K blocks packed for torch's int4
CPU kernel, used by passes of a few rows (a decode step, a margin's copy decision); longer passes keep the
full weights.

Why: a decode step reads every weight once, so its time is the weights' bytes. The layers of the Qwen 1.5B are
1.1 G values stored as Q4_K in its GGUF: 2.2 GB in bf16, 0.56 GB as 4-bit groups of 32 with a scale and an
offset each. torch's `_weight_int4pack_mm_for_cpu` multiplies one row by them in ~0.35x the time of bf16's
matmul, but 32 rows take it 3.5-4.5x as long and 512 rows 6-17x (bench/results/decode_weights/), so the
full weights stay for prefill: the packs are memory added to the weights (0.625 bytes per value, against bf16's
2: 663 MiB for the 1.5B, 63 MiB for the 135M).

The packs hold the file's values, not a re-quantization of them: a Q4_1 block is `d * q + m`, a Q4_K sub-block
`d * sc * q - dmin * m`, and each is one affine group of 32 (the kernel's `(q - 8) * scale + zero`). Each packed
matrix is checked against the weight transformers de-quantized from the same file (equal up to the dtype's
rounding) when the packs are built, once per converted model (kept beside its folder); a matrix that is not
(another architecture's row order, other values) stays unpacked.
Q6_K and Q8_0 tensors (the 1.5B's output matrix and half its value and down projections) stay unpacked in
`gguf4`. `gguf` keeps every 4-, 6- and 8-bit tensor, the output matrix included, for engine/kernels' AVX2
kernels instead of torch's: 4-bit values two a byte with an fp32 scale and low per 32 (Q4Linear), and Q6_K and
Q8_0 as int8 with one fp32 scale per group (Q6_K: 16 values, scale d * sub-scale, values q - 32; Q8_0: 32, scale
d; Int8Linear), 0.75, 1.25 and 1.125 bytes a value against fp32's 4 (on a CPU without bf16 matrix units the full
weights are fp32). Checked against the loaded weight the same way.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .decode_copy import DecodeCopy
from .files import into_place, partial_path

log = logging.getLogger(__name__)

GROUP = 32          # values per scale and offset: a Q4_0/Q4_1 block, a Q4_K sub-block
INNER_K_TILES = 1   # the packing's innerKTiles argument (a CUDA tiling); the CPU layout was measured with 1

# GGUF tensor names (per block) -> the module transformers loads them into, for llama and qwen2 layouts.
_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


def weights(model) -> tuple[int, int]:
    """(values, bytes) of the model's weights: its parameters and the full weights prepack_full_weights moved
    into buffers (the decode copies beside them are counted by add_decode_packs)."""
    tensors = [*model.parameters(), *(b for name, b in model.named_buffers() if name.endswith("prefill_packed"))]
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def prepack_full_weights(model, rows: int = 512) -> dict:
    """Each decode-copy linear's full bf16 weight replaced by the same values prepacked in oneDNN's blocked
    layout for passes of `rows` rows (engine/generate.py's PREFILL_CHUNK): {"matrices", "bytes", "released"}
    (bytes of the dense weights' mapped pages handed back).

    Why: torch's bf16 matmul on a CPU hands oneDNN a plain weight, which oneDNN reorders into its blocked layout
    on every call. One layer's weights sit in the cache between calls, so a benchmark that repeats one matrix does
    not see it; a prefill pass reads 28 layers' from memory. Measured on 2 cores of an Intel Xeon with AMX
    (2026-12-05): a 512 x 1536 @ 1536 x 8960 product over the 28 layers' up projections ran at 1,104 GFLOP/s, the
    same matrix 28 times at 1,796, the prepacked ones at 1,884, with the same values bit for bit. The packed weight
    replaces the dense one as a parameter; the rare paths that want a dense weight get one made for them. The
    dense weights were loaded from a memory-mapped file whose mapping the other tensors keep alive, so their pages
    would stay resident beside the packed copies (`python -m engine read` of the 8k BABILong file peaked at 7,397
    MiB against 4,891 without): each one's pages are handed back as it is replaced (`release_mapped_pages`)."""
    matrices = nbytes = released = 0
    mapped = _file_mappings()
    with torch.inference_mode():
        for module in model.model.layers.modules():  # not the LM head: it shares the embeddings' weight
            weight = module._parameters.get("weight") if isinstance(module, DecodeCopy) else None
            if weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" \
                    or getattr(module, "prefill_q", None) is not None:
                continue
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
            except (RuntimeError, AttributeError) as error:  # a torch without oneDNN's bf16 linear: left dense
                log.warning("weights left dense (oneDNN refused to prepack them): %s", str(error).splitlines()[0])
                break
            released += release_mapped_pages(weight, mapped)
            del module._parameters["weight"]
            module.register_buffer("prefill_packed", packed, persistent=False)
            matrices, nbytes = matrices + 1, nbytes + weight.numel() * weight.element_size()
    return {"matrices": matrices, "bytes": nbytes, "released": released}


MADV_DONTNEED = 4  # Linux's value


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's file-backed mappings (an inode other than 0); none off Linux."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 5 and fields[4] != "0":
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def release_mapped_pages(tensor: torch.Tensor, mapped: list[tuple[int, int]]) -> int:
    """Hand back the resident pages of a tensor read from a memory-mapped file, once nothing will read it again
    (the pages wholly inside it; a neighbour's shared page stays): bytes released, 0 where it is not in one of
    `mapped` (_file_mappings). The mapping stays; a page read again comes back from the file, so a tensor in the
    heap is never touched (madvise there would zero it)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(low <= start and end <= high for low, high in mapped):
        return 0
    page = mmap.PAGESIZE
    low, high = -(-start // page) * page, end // page * page
    if high <= low:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(low, high - low, MADV_DONTNEED) != 0:
        log.warning("madvise failed (errno %d): the dense pages stay resident", ctypes.get_errno())
        return 0
    return high - low


class PackedLinear(DecodeCopy):
    """The second copy in 4-bit groups, for torch's int4 kernel (`gguf4`)."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor, scales_zeros: torch.Tensor):
        super().__init__(linear, packed=packed, scales_zeros=scales_zeros)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)


class Q4Linear(DecodeCopy):
    """The second copy as the file's 4-bit values, two a byte, with a scale and a low per group of 32, for
    engine/kernels' gemv_q4 (`gguf`; round_x: the input rounded to int8 blocks first and the scales and lows
    kept in fp16, `gguf-q8`)."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                 round_x: bool = False):
        if round_x:  # its kernel reads them in fp16
            scale, low = scale.half(), low.half()
        super().__init__(linear, packed=packed, scale=scale, low=low)
        self.round_x = round_x

    def few_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        from .kernels import gemv_q4
        return gemv_q4(x, self.packed, self.scale, self.low, self.round_x)


class Int8Linear(DecodeCopy):
    """The second copy as the file's int8 values with group scales, for engine/kernels' gemv_int8 (`gguf`,
    `gguf-q8` as Q4Linear's)."""

    def __init__(self, linear: torch.nn.Linear, q: torch.Tensor, scale: torch.Tensor, round_x: bool = False):
        super().__init__(linear, q=q, scale=scale.half() if round_x else scale)
        self.round_x = round_x

    def few_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        from .kernels import gemv_int8
        return gemv_int8(x, self.q, self.scale, self.round_x)


class SharedInput:
    """Several `gguf-q8` copies that take the same input (a layer's q, k and v; its gate and up), multiplied in
    one kernel call (engine/kernels' gemv_q8_many: the input rounded once, their rows split over the threads
    together) with the same values as their own calls. Biases are the caller's."""

    def __init__(self, linears: list[Q4Linear | Int8Linear]):
        self.linears = linears
        self.weights = [m.packed if isinstance(m, Q4Linear) else m.q for m in linears]
        self.scales = [m.scale for m in linears]
        self.lows = [m.low if isinstance(m, Q4Linear) else m.scale.new_empty(0, 0) for m in linears]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x fp32 [rows <= DECODE_ROWS, K], contiguous -> [rows, N_i] fp32 for each copy."""
        from .kernels import gemv_q8_many
        ys = gemv_q8_many(x, self.weights, self.scales, self.lows)
        if ys is None:  # refused: each copy on its own, else the full weights
            ys = [m.few_rows(x) for m in self.linears]
            if any(y is None for y in ys):
                ys = [F.linear(x.to(m.weight.dtype), m.weight).float() for m in self.linears]
        return ys


INT8_KINDS = {"Q6_K": 16, "Q8_0": 32}  # block type -> values per scale


def int8_groups_of(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) of a Q6_K or Q8_0 tensor's raw blocks [rows, bytes]: q int8 [rows, cols], scale float32
    [rows, cols / INT8_KINDS[kind]], so that value = scale * q (exactly gguf-py's de-quantization)."""
    rows = blocks.shape[0]
    if kind == "Q8_0":
        b = blocks.reshape(rows, -1, 34)                             # d, then 32 int8 values
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        return b[..., 2:].copy().view(np.int8).reshape(rows, -1), d
    if kind == "Q6_K":
        b = blocks.reshape(-1, 210)                                  # 256 values: 128 low nibbles, 64 of high bits,
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]  # 16 scales, d (gguf-py's order)
        scale = d.copy().view(np.float16).astype(np.float32) * sc.copy().view(np.int8).astype(np.float32)
        ql = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        qh = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = (ql.reshape(-1, 2, 4, 32) | (qh.reshape(-1, 2, 4, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return q.reshape(rows, -1), scale.reshape(rows, -1)
    raise ValueError(f"not a 6- or 8-bit block type: {kind}")


def groups_of(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, scale, low) of a 4-bit GGUF tensor's raw blocks [rows, bytes]: q [rows, cols] in 0..15, scale and low
    [rows, cols / 32] float32, so that value = scale * q + low (exactly gguf-py's de-quantization)."""
    rows = blocks.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = blocks.reshape(rows, -1, size)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        qs = b[..., size - 16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)           # low nibbles: values 0-15, high: 16-31
        low = (-8 * d) if kind == "Q4_0" else b[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        return q.reshape(rows, -1), d, low
    if kind == "Q4_K":
        from gguf.quants import Q4_K
        b = blocks.reshape(rows, -1, 144)                            # 256 values: d, dmin, 12 bytes of scales, 128 of q
        n = b.shape[1]
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(b[..., 4:16].reshape(rows * n, 12))
        scale = d * sc.reshape(rows, n, 8).astype(np.float32)
        low = -(dmin * m.reshape(rows, n, 8).astype(np.float32))
        qs = b[..., 16:].reshape(rows, n, 4, 1, 32)                  # 4 chunks of 64 values: low nibbles, then high
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)
        return q.reshape(rows, -1), scale.reshape(rows, -1), low.reshape(rows, -1)
    raise ValueError(f"not a 4-bit block type: {kind}")


def _llama_rows(rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives a llama q/k matrix from GGUF (its `_reverse_permute_weights`)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(rows)


PACKS_SUFFIX = ".decode-gguf4.safetensors"
GGUF_PACKS_SUFFIX = ".decode-gguf.safetensors"


def packs_path(folder: Path, suffix: str = PACKS_SUFFIX) -> Path:
    """Where a converted model's packs live: beside its folder, not in it (a server such as vLLM loads every
    *.safetensors file in a model folder as weights, and refuses the packs' names)."""
    return folder.with_name(folder.name + suffix)


def _packs_file(path: Path, build) -> dict[str, torch.Tensor]:
    """The packs saved at `path`, built by `build()` and saved there the first time."""
    from safetensors.torch import load_file, save_file
    if path.exists():
        return load_file(path)
    packs = build()
    tmp = partial_path(path)
    save_file(packs, tmp)
    into_place(tmp, path)
    return packs


def add_decode_packs(model: torch.nn.Module, gguf: Path, folder: Path, choice: str = "gguf4") -> dict:
    """Give `model`'s linear layers a decode copy of their GGUF tensors. `gguf4`: each 4-bit one its packs for
    torch's int4 kernel (PackedLinear). `gguf`: each 4-, 6- or 8-bit one, the output matrix too, the file's own
    values for engine/kernels (Q4Linear, Int8Linear); `gguf-q8`: the same copies, the input rows rounded to int8
    blocks as llama.cpp rounds them (integer dot products). The copies are built once, beside the model's converted
    folder (reading the GGUF's header alone takes ~18 s for the 1.5B's 151k-token vocabulary), and loaded from
    there afterwards. Returns: matrices packed, their bytes."""
    modules = dict(model.named_modules())
    packed = nbytes = 0
    if choice == "gguf4":
        packs = _packs_file(packs_path(folder), lambda: build_packs(model, gguf))
        layers = {name: PackedLinear(modules[name], pack, packs[f"{name}.scales_zeros"].to(modules[name].weight.dtype))
                  for name, pack in _named(packs, "packed", modules)}
    else:
        packs = _packs_file(packs_path(folder, GGUF_PACKS_SUFFIX), lambda: build_gguf_packs(model, gguf))
        round_x = choice == "gguf-q8"
        layers = {name: Q4Linear(modules[name], pack, packs[f"{name}.q4_scale"], packs[f"{name}.q4_low"], round_x)
                  for name, pack in _named(packs, "q4", modules)}
        layers |= {name: Int8Linear(modules[name], q, packs[f"{name}.q8_scale"], round_x)
                   for name, q in _named(packs, "q8", modules)}
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, layer)
        packed += 1
        nbytes += sum(b.numel() * b.element_size() for b in layer.buffers())
    return {"packed": packed, "bytes": nbytes}


def _named(packs: dict[str, torch.Tensor], what: str, modules: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(module name, tensor) for the packs' `{module}.{what}` entries whose module is a linear layer here."""
    for key, tensor in packs.items():
        name, _, kind = key.rpartition(".")
        if kind == what and isinstance(modules.get(name), torch.nn.Linear):
            yield name, tensor


def build_packs(model: torch.nn.Module, gguf: Path) -> dict[str, torch.Tensor]:
    """`{module}.packed` (uint8, the kernel's layout) and `{module}.scales_zeros` (fp32 [cols / 32, rows, 2]) for
    every linear layer whose GGUF tensor is 4-bit and matches the loaded weight."""

    packs = {}
    for name, linear, kind, blocks, order in _linear_tensors(model, gguf, ("Q4_0", "Q4_1", "Q4_K"), output=False):
        q, scale, low = groups_of(kind, blocks)
        if order is not None:
            q, scale, low = q[order], scale[order], low[order]
        if not _matches(linear.weight, q, scale, low):
            log.warning("%s: the GGUF's %s values do not match the loaded weight; left unpacked", name, kind)
            continue
        scales_zeros = torch.from_numpy(np.stack([scale, low + 8 * scale], axis=-1)).transpose(0, 1).contiguous()
        packs[f"{name}.scales_zeros"] = scales_zeros
        packs[f"{name}.packed"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(q).to(torch.int32), INNER_K_TILES)
    return packs


def build_gguf_packs(model: torch.nn.Module, gguf: Path) -> dict[str, torch.Tensor]:
    """For every linear layer, the output matrix included, whose GGUF tensor matches the loaded weight: a 4-bit
    one's `{module}.q4` (uint8 [rows, cols / 2], two values a byte as gemv_q4 reads them), `.q4_scale` and
    `.q4_low` (fp32 [rows, cols / 32]); a Q6_K or Q8_0 one's `{module}.q8` (int8 [rows, cols]) and `.q8_scale`."""
    packs = {}
    for name, linear, kind, blocks, order in _linear_tensors(model, gguf, ("Q4_0", "Q4_1", "Q4_K", *INT8_KINDS)):
        if kind in INT8_KINDS:
            q, scale = int8_groups_of(kind, blocks)
            low, group = None, INT8_KINDS[kind]
        else:
            (q, scale, low), group = groups_of(kind, blocks), GROUP
        if order is not None:
            q, scale, low = q[order], scale[order], None if low is None else low[order]
        if not _matches(linear.weight, q, scale, low, group):
            log.warning("%s: the GGUF's %s values do not match the loaded weight; left unpacked", name, kind)
            continue
        if low is None:
            packs[f"{name}.q8"] = torch.from_numpy(np.ascontiguousarray(q))
            packs[f"{name}.q8_scale"] = torch.from_numpy(np.ascontiguousarray(scale))
        else:
            halves = q.astype(np.uint8).reshape(q.shape[0], -1, 2, 16)  # byte j: value j, and value j + 16 above it
            packs[f"{name}.q4"] = torch.from_numpy((halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(q.shape[0], -1))
            packs[f"{name}.q4_scale"] = torch.from_numpy(np.ascontiguousarray(scale))
            packs[f"{name}.q4_low"] = torch.from_numpy(np.ascontiguousarray(low))
    return packs


def _linear_tensors(model: torch.nn.Module, gguf: Path, kinds: tuple[str, ...], output: bool = True):
    """(module name, linear layer, block type, raw blocks, row order or None) for each GGUF tensor of one of
    `kinds` that is the weight of one of `model`'s layers' linears and, with `output`, of the output matrix (the
    embedding's, when the model ties them and the file has no output tensor)."""
    from gguf import GGUFReader

    cfg = model.config.get_text_config()
    arch = getattr(cfg, "model_type", "")
    modules = dict(model.named_modules())
    tensors = GGUFReader(gguf).tensors
    names = {t.name for t in tensors}
    for tensor in tensors:
        parts = tensor.name.split(".")
        if output and (tensor.name == "output.weight" or (tensor.name == "token_embd.weight" and "output.weight"
                                                          not in names and getattr(cfg, "tie_word_embeddings", False))):
            name = "lm_head"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _MODULES and parts[3] == "weight":
            name = f"model.layers.{parts[1]}.{_MODULES[parts[2]]}"
        else:
            continue
        linear = modules.get(name)
        kind = tensor.tensor_type.name
        if not isinstance(linear, torch.nn.Linear) or kind not in kinds:
            continue
        order = None
        if arch == "llama" and parts[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if parts[-2] == "attn_q" else cfg.num_key_value_heads
            order = _llama_rows(linear.weight.shape[0], heads)
        yield name, linear, kind, np.asarray(tensor.data), order


def _matches(weight: torch.Tensor, q: np.ndarray, scale: np.ndarray, low: np.ndarray | None,
             group: int = GROUP) -> bool:
    """Whether the loaded weight is these groups' values (scale * q + low) up to its dtype's rounding (every
    row: the packs are built once; ~20 s for the 1.5B's 1.1 G values)."""
    if tuple(weight.shape) != q.shape or q.shape[1] % group:
        return False
    eps = torch.finfo(weight.dtype).eps
    for start in range(0, q.shape[0], 1024):  # in slices: the fp32 copies of a whole matrix would be ~100 MB
        rows = slice(start, start + 1024)
        values = (torch.from_numpy(q[rows]).reshape(-1, q.shape[1] // group, group).float()
                  * torch.from_numpy(scale[rows])[..., None])
        if low is not None:
            values = values + torch.from_numpy(low[rows])[..., None]
        values = values.reshape(-1, q.shape[1])
        if not bool(((weight[rows].float() - values).abs() <= values.abs() * eps + 1e-7).all()):
            return False
    return True
