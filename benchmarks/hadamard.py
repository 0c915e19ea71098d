"""Eager cost of the random Hadamard transform's defined arithmetic (butterflies in a fixed
order) against the same transform as one matrix product (what a BLAS call computes, with its
own order of the sums), on the CPU or a GPU, side by side in one run.

    python benchmarks/hadamard.py [--size 4096] [--repeats 5] [--device cpu]

Per dtype, block (16, 128) and axis (-1: fprop/dgrad operands; 0: the weight gradient's):
median ms of alternating calls, and the ratio butterflies / matrix product.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from megatron.quantization.formats import hadamard_sign_vector  # noqa: E402
from megatron.quantization.formats import random_hadamard_transform  # noqa: E402


def matrix_form(x: torch.Tensor, axis: int, block: int, seed: int) -> torch.Tensor:
    """The same transform as a product of each block with (H / sqrt(b)) diag(d), in float32."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    qt = (hadamard_sign_vector(block, seed).double()[:, None] * h / math.sqrt(block))
    qt = qt.to(device=x.device, dtype=torch.float32)
    rows = x.movedim(axis, -1).float()
    y = (rows.unflatten(-1, (rows.shape[-1] // block, block)) @ qt).flatten(-2)
    return y.movedim(-1, axis).to(x.dtype)


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=4096, help="Square tensor side (default 4096).")
    p.add_argument("--repeats", type=int, default=5, help="Timed calls of each (default 5).")
    p.add_argument("--device", default="cpu", help="Device of the tensors (default cpu).")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(args.size, args.size, generator=g).to(device)
    print(f"{args.size} x {args.size} on {device}, median of {args.repeats} alternating calls")
    print(f"{'dtype':<10}{'block':>6}{'axis':>6}{'butterflies ms':>16}{'matrix ms':>11}"
          f"{'ratio':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        x = base.to(dtype)
        for block in (16, 128):
            for axis in (-1, 0):
                times = {"butterflies": [], "matrix": []}
                for _ in range(args.repeats):
                    times["butterflies"].append(timed(
                        lambda: random_hadamard_transform(x, axis, block, 3), device))
                    times["matrix"].append(timed(lambda: matrix_form(x, axis, block, 3), device))
                ours, matrix = (statistics.median(times[k]) for k in ("butterflies", "matrix"))
                print(f"{str(dtype).split('.')[1]:<10}{block:>6}{axis:>6}{ours * 1e3:>16.1f}"
                      f"{matrix * 1e3:>11.1f}{ours / matrix:>8.2f}")


if __name__ == "__main__":
    main()
