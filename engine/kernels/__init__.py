"""Native kernels, built from source at first use; every failure means `None` and the caller's torch path.

`flash_attention()` is the fused bf16 attention of attention_bf16.cpp (AVX-512 BF16 CPUs; its products on
AMX's tiles where the CPU has them): it returns the
output [1, q, heads, dim], or None where the kernel is unavailable (no avx512_bf16, no compiler or ninja, a
failed build) or the call is outside what it handles (not bf16, batch > 1, head_dim not a multiple of 64, a
non-boolean mask), so a caller can always fall back to its own path.

`gemv_int8()` and `gemv_q4()` are gemv_gguf.cpp (AVX2 + FMA CPUs): a decode step's few rows times a matrix kept
as the GGUF's own values and group scales (engine/packed.py's `gguf` packs), with the rows in fp32 or rounded
to int8 blocks as llama.cpp rounds them (`gguf-q8`), or None likewise. Where the CPU has AVX-512 VNNI the build
adds its flags and the int8-input kernels take two groups an instruction, the same values bit for bit: a decode
step of the 1.5B 1.25x faster on 2 threads and 1.56x on 1 (bench/results/decode_kernels/, AMD EPYC without AMX).
decode_layers.cpp is built into the same library: `decode_layers()` gives engine/decode_step.py a decode step's
layers run from C++ (the same values as its Python loop, without Python's cost per op).
int8_rows.cpp, in the same library, rounds a pass's rows to int8 and scales int32 sums back for
engine/prefill_int8.py (`quantize_rows`, `dequantize_rows`); prefill_rows.cpp does a bf16 prefill pass's
elementwise work for engine/prefill_step.py (norms, residual adds, rotary, silu times up), one pass over memory
each, with torch's values.

The build goes through torch.utils.cpp_extension.load into $TORCH_EXTENSIONS_DIR or
~/.cache/marginalia/kernels/<torch version>/ (a torch upgrade rebuilds, a changed source rebuilds, otherwise
the built library is just loaded); the first build took 10 s here (2 cores), a cached load 0.6 s.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
# at::parallel_for is an OpenMP pragma in torch's headers: without -fopenmp it compiles to a serial loop. The
# libgomp.so.1 it links resolves to the one torch has already loaded, so torch.set_num_threads governs it.
OPENMP = ["-fopenmp"]
_call_failed = False  # a refused call is logged once


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags (/proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _build_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "marginalia" / "kernels"
    return base / f"torch-{torch.__version__}"


class Native:
    """C++ sources built at first use into one library (its ops named by `op`'s namespace), for CPUs with the
    instructions it is compiled for."""

    def __init__(self, source: str, op: str, flags: list[str], needs: set[str],
                 wider: tuple[list[str], set[str]] = ([], set()), more: tuple[str, ...] = ()):
        """`wider`: more flags, added where this CPU has the instructions they need (the source tests for them).
        `more`: other sources built into the same library (they register into the same namespace)."""
        self.source, self.op, self.flags, self.needs = source, op, flags, needs
        self.more = more
        self.wider = wider
        self._lock = threading.Lock()
        self._op = None
        self._tried = False

    def load(self):
        """The op, built and loaded once per process; None if impossible (logged once)."""
        if self._tried:
            return self._op
        with self._lock:
            if self._tried:
                return self._op
            missing = sorted(self.needs - cpu_flags())
            if missing:  # expected on many CPUs: torch's path, nothing to warn about
                log.info("%s not built: this CPU has no %s", self.source, ", ".join(missing))
                self._tried = True
                return None
            try:
                from torch.utils import cpp_extension
                name = Path(self.source).stem
                build = _build_dir() / name
                build.mkdir(parents=True, exist_ok=True)
                wider_flags, wider_needs = self.wider
                flags = [*self.flags, *(wider_flags if wider_needs <= cpu_flags() else [])]
                cpp_extension.load(name=f"marginalia_{name}", sources=[str(HERE / f) for f in (self.source, *self.more)],
                                   extra_cflags=["-O3", *flags, *OPENMP], extra_ldflags=OPENMP,
                                   build_directory=str(build), is_python_module=False, verbose=False)
                namespace, _, op = self.op.partition("::")
                self._op = getattr(getattr(torch.ops, namespace), op)
            except Exception as error:  # anything at all: the caller keeps torch's path
                log.warning("%s unavailable, using torch's path: %s", self.source,
                            str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)
                self._op = None
            self._tried = True
        return self._op


# With AMX the same kernel runs its tiles' products on the tile unit (the source tests for the flags).
ATTENTION = Native("attention_bf16.cpp", "marginalia::flash_attention_bf16",
                   ["-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
                   {"avx512_bf16", "avx512bw", "avx512vl"},
                   wider=(["-mamx-tile", "-mamx-bf16"], {"amx_tile", "amx_bf16"}))
# -ffp-contract=off: a weight is rebuilt as a product then a sum, as gguf-py de-quantizes it, not as one FMA.
# With AVX-512 VNNI the int8-input kernels take two groups an instruction (the same values bit for bit).
GEMV = Native("gemv_gguf.cpp", "marginalia_gemv::gemv_int8_groups",
              ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"], {"avx2", "fma", "f16c"},
              wider=(["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"],
                     {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}),
              more=("decode_layers.cpp", "int8_rows.cpp", "prefill_rows.cpp"))


def load():
    """The fused attention op, or None (see Native.load)."""
    return ATTENTION.load()


# The causal test of a mask is made once per forward pass: every layer gets the same mask object, and the entry
# keeps it alive, so a new pass's mask can never be taken for it.
_causal_memo: tuple = (None, False)


def _is_causal_at_offset(mask: torch.Tensor) -> bool:
    """Whether mask [1, 1, q, ctx] is exactly "query row i sees keys 0 .. ctx - q + i"."""
    global _causal_memo
    held, verdict = _causal_memo
    if held is not mask:
        q, ctx = mask.shape[-2:]
        causal = torch.arange(ctx)[None, :] <= torch.arange(ctx - q, ctx)[:, None]
        verdict = bool(torch.equal(mask[0, 0], causal))
        _causal_memo = (mask, verdict)
    return verdict


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float | None, causal: bool = False) -> torch.Tensor | None:
    """query [1, heads, q, dim], key/value [1, kv_heads, ctx, dim] (strided views are fine), mask [1, 1, q, ctx]
    bool (True = visible), or mask None with causal=True for "row i sees keys 0 .. ctx - q + i"
    -> [1, q, heads, dim] bf16, or None (unavailable or unsupported: use another path)."""
    if mask is None and not causal:
        return None  # the unmasked case (a decode step) is grouped_decode's
    if not (query.dtype == key.dtype == value.dtype == torch.bfloat16) or query.device.type != "cpu" \
            or query.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1 or value.shape[0] != 1 \
            or query.shape[-1] % 64 or query.shape[-1] > 256 or query.shape[1] % key.shape[1] \
            or key.shape[2] < query.shape[2] or query.requires_grad:
        return None
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 \
                or tuple(mask.shape[2:]) != (query.shape[2], key.shape[2]):
            return None
        if _is_causal_at_offset(mask):
            mask = None  # the kernel computes it from the offset, skipping the blocks nobody sees
    op = ATTENTION.load()
    if op is None:
        return None
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    try:
        return op(query, key, value, mask, scale)
    except RuntimeError as error:  # a check of the kernel's that the tests above missed: torch's path, said once
        global _call_failed
        if not _call_failed:
            log.warning("fused attention kernel refused a call, using torch's: %s", str(error).splitlines()[0])
            _call_failed = True
        return None



def attention_use_amx(enable: bool) -> bool:
    """Turns the fused kernel's AMX tiles on or off (on where built with them and the OS grants them); returns
    whether they are in use. For comparing the two paths: tests and bench.prefill."""
    if ATTENTION.load() is None:
        return False
    return bool(torch.ops.marginalia.attention_use_amx(enable))


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, round_x: bool = False) -> torch.Tensor | None:
    """x [rows <= 4, K] times the matrix scale * q (q int8 [N, K], scale fp32 [N, K / group], groups of 16
    or 32) -> [rows, N] in x's dtype, or None (unavailable or refused: use the full weight). round_x: x's rows
    rounded to int8 in blocks of 32 first (llama.cpp's Q8_0 activations; integer dot products, each x value
    within half its block's step), and the scales in fp16 (fewer bytes to read)."""
    return _gemv("gemv_int8_q8" if round_x else "gemv_int8_groups", x, q, scale)


def gemv_q4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
            round_x: bool = False) -> torch.Tensor | None:
    """x [rows <= 4, K] times the matrix scale * q + low (q 0..15, two a byte: packed uint8 [N, K / 2]; scale,
    low fp32 [N, K / 32]) -> [rows, N] in x's dtype, or None likewise. round_x: as gemv_int8's (scale and low
    in fp16)."""
    return _gemv("gemv_q4_q8" if round_x else "gemv_q4_groups", x, packed, scale, low)


def gemv_q8_many(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor],
                 lows: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """x [rows <= 4, K] fp32 times several matrices at once (gemv_q4's and gemv_int8's with round_x: weights[i]
    uint8 4-bit packs or int8 values, scales[i] and lows[i] fp16, an int8 matrix's low an empty tensor): x rounded
    once, one split of all their output rows over the threads -> [rows, N_i] fp32 each, bit for bit the single
    calls' values; or None likewise."""
    if GEMV.load() is None:
        return None
    try:
        return torch.ops.marginalia_gemv.gemv_q8_many(x, weights, scales, lows)
    except RuntimeError as error:
        global _call_failed
        if not _call_failed:
            log.warning("gemv_q8_many refused a call, using the full weights: %s", str(error).splitlines()[0])
            _call_failed = True
        return None


def _gemv(name: str, x: torch.Tensor, *matrix: torch.Tensor) -> torch.Tensor | None:
    if GEMV.load() is None:
        return None
    try:
        return getattr(torch.ops.marginalia_gemv, name)(x.float().contiguous(), *matrix).to(x.dtype)
    except RuntimeError as error:
        global _call_failed
        if not _call_failed:
            log.warning("%s refused a call, using the full weight: %s", name, str(error).splitlines()[0])
            _call_failed = True
        return None


def decode_layers(head_dim: int, scaling: float):
    """An empty `DecodeLayers` of decode_layers.cpp (a decode step's layers run from C++, the same values as
    engine/decode_step.py's loop), or None where the gemv kernels are unavailable."""
    if GEMV.load() is None:
        return None
    return torch.classes.marginalia_gemv.DecodeLayers(head_dim, scaling)


def use_avx512(enable: bool) -> bool:
    """Turns the int8-input kernels' AVX-512 VNNI path on or off (it is on where it was built); returns whether it
    is in use. For comparing the two paths, which give the same values: tests and bench/results/decode_kernels/."""
    if GEMV.load() is None:
        return False
    return bool(torch.ops.marginalia_gemv.use_avx512(enable))
