"""Does the `fp8-hopper` mode of `device_mxfp8` slow down when a rank's row count grows?

Shape suffixes: see te_mixtral/__init__.py (its GEMM letters: Q padded rows, I input and N
output features, G groups = local experts).

One step of a 3-sequence-per-GPU EP=4 run of `device_mxfp8` once took many times longer than
its others (docs/results/2026-11-21-h200-x4-larger-all-tiers.md): its quantisers were then
`torch.compile`d with dynamic shapes, and they compiled again when an operand grew past
2**31 elements. The casts are now Triton kernels (quant/fp8_cast.py), which compile once per
shape of their fixed dims: the row count is an argument, and Triton specialises an integer
argument only on being a multiple of 16, which every padded row count is. This script
checks it: the three FP8 GEMMs of a gate/up projection (fprop, dgrad, wgrad) at
Mixtral-8x7B sizes (I 4096, N 2 x 14336, 2 local experts as at EP=4), called twice per row
count, each call timed on its own with a synchronised host clock (not benchmarks/common.py's
timer: the first call, compilation included, is what is measured, which a warm-up would
hide). The counts grow past 2**31 elements of one operand, then
one smaller count checks that the kernels compiled for the larger ones serve it.

    python3 -m benchmarks.fp8_row_counts

Needs an sm_90 GPU (Hopper's FP8 tensor cores, through the tier's Triton GEMMs).
"""

import argparse
import sys
import time

import torch

from benchmarks import common
from benchmarks.common import FAMILIES
from te_mixtral.experts.quant.fp8_hopper import FP8HopperGemms
from te_mixtral.experts.quant.fp8_swiglu import FP8SwiGLUExperts

I, N, G = FAMILIES["8x7b"].hidden, 2 * FAMILIES["8x7b"].ffn, 2
ROW_COUNTS = (16384, 32768, 49152, 65536, 73728, 81920, 98304, 90112, 114688)


def timed_call(gemms: FP8HopperGemms, rows: int, w_GNI: torch.Tensor) -> float:
    x_QI = torch.randn(rows, I, device="cuda", dtype=torch.bfloat16)
    dy_QN = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16)
    offsets_G = torch.tensor([rows // 2, rows], device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    start = time.perf_counter()
    weight = gemms.weight(w_GNI)  # quantised on the first call only: the weight does not change
    gemms.fprop(x_QI, weight, offsets_G)
    gemms.dgrad(dy_QN, weight, offsets_G)
    gemms.wgrad(dy_QN, x_QI, offsets_G)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    device = common.cuda_or_refuse("fp8_row_counts")
    if device is None:
        return 2
    gemms = FP8SwiGLUExperts().gemms  # the tier's GEMMs, with its Triton casts
    w_GNI = torch.randn(G, N, I, device="cuda", dtype=torch.bfloat16)
    print(common.header_line(common.run_header(device)))
    print(f"I {I}, N {N}, G {G}")
    print(f"{'rows Q':>8} {'Q x N elements':>15} {'first call (s)':>15} {'second call (s)':>16}")
    for rows in ROW_COUNTS:
        first, second = timed_call(gemms, rows, w_GNI), timed_call(gemms, rows, w_GNI)
        print(f"{rows:>8} {rows * N:>15,} {first:>15.3f} {second:>16.3f}"
              + ("   <- over 2**31 elements" if rows * N >= 2**31 else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
