"""One decode step's attention, three ways, side by side: `python -m bench.attention [--threads N]`.

For the key/value shapes of SmolLM2-135M and Qwen2.5-1.5B, at 512 and 8,000 tokens of context, in fp32 and
bf16: transformers' sdpa path for one query without a mask (`enable_gqa=True`), engine/attention.py's grouped
decode (the heads of a group as query rows of the fused kernel), and the same grouping done with two explicit
matmuls and an fp32 softmax. Prints microseconds (median and minimum of `--reps`) and the largest difference
from an fp32 reference. The keys are views of a larger preallocated buffer, as in the engine's cache.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from engine.attention import grouped_decode

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Qwen2.5-1.5B": (12, 2, 128)}  # heads, kv heads, head dim


def library_sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)


def explicit_matmuls(q, k, v, scale):
    b, h, _, d = q.shape
    rows = q.reshape(b, k.shape[1], h // k.shape[1], d)
    weights = torch.softmax(torch.matmul(rows, k.transpose(-1, -2)) * scale, dim=-1, dtype=torch.float32)
    return torch.matmul(weights.to(q.dtype), v).reshape(b, 1, h, d)


KERNELS = {"library sdpa (enable_gqa)": library_sdpa, "grouped decode (ours)": grouped_decode,
           "explicit matmuls": explicit_matmuls}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.1f}")
    for dtype in (torch.float32, torch.bfloat16):
        for name, (heads, kv_heads, dim) in SHAPES.items():
            keys = torch.randn(1, kv_heads, 8200, dim, dtype=dtype)
            values = torch.randn(1, kv_heads, 8200, dim, dtype=dtype)
            for context in (512, 8000):
                q = torch.randn(1, heads, 1, dim, dtype=dtype)
                k, v = keys[:, :, :context], values[:, :, :context]
                ref = library_sdpa(q.float(), k.float(), v.float(), dim ** -0.5)
                cells = []
                for label, kernel in KERNELS.items():
                    err = (kernel(q, k, v, dim ** -0.5).float() - ref).abs().max().item()
                    times = []
                    for _ in range(args.reps):
                        t = time.perf_counter()
                        kernel(q, k, v, dim ** -0.5)
                        times.append(time.perf_counter() - t)
                    times.sort()
                    cells.append(f"{label} {times[len(times) // 2] * 1e6:,.0f} us (min {times[0] * 1e6:,.0f}, "
                                 f"err {err:.1e})")
                print(f"{str(dtype).removeprefix('torch.'):8} {name:13} {context:5}: " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
