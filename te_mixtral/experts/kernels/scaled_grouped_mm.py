"""FP8 grouped GEMMs with row-wise scales on this package's Triton kernels: the two cases of
`torch._scaled_grouped_mm` that the expert FFN calls (`quant/fp8_hopper.py`), with the same
arguments and results, run by `_rows_gemm` and `_wgrad_gemm` with their `SCALED` epilogue.

Why not `torch._scaled_grouped_mm` (CUTLASS) itself, which the FP8 path used before: on an
H100 at Mixtral-8x7B and 8x22B shapes, 4 experts x 4096 or 8192 rows, it took 1.18-1.45x
these kernels' time on each of the six GEMMs in its exact mode (`python3 -m
benchmarks.fp8_gemms`; docs/precision.md has the table). Most of that is accumulation:
Triton multiplies FP8 on Hopper the way the tensor cores do natively, adding products in a
narrower accumulator before they reach the fp32 sum, as CUTLASS does with
`use_fast_accum=True`; the exact mode promotes every few products. In its fast mode CUTLASS
took 0.96-1.26x these kernels' time, with the same error to two digits. That error is small
beside FP8's own: a GEMM of already quantised operands lands 2.1-5.0e-3 off float64
(growing with the reduction, 4096 to 32768), against 1.7e-3 for the bf16 rounding of its
output alone, where E4M3 rounding puts the whole MLP 6.6e-2 off.

Split sizes stay on the device, as in every kernel here: `offs` is read by the kernels.
Rows past `offs[-1]` of a 2-D x 3-D product are left unwritten, and a group with no rows
gets a zero weight gradient. Unlike torch's kernel these take a group of any row count; the
2-D x 2-D operands may be views whose rows are padded to 16 bytes (as
`quant/fp8_cast.quantize_columns` writes them), which keeps the TMA loads for any count.
"""

import torch

from te_mixtral.experts.kernels.grouped_gemm import rows_gemm
from te_mixtral.experts.kernels.schedule import FP32_TILE, tile_config
from te_mixtral.experts.kernels.tma_host import tma_ok
from te_mixtral.experts.kernels.wgrad_gemm import wgrad_gemm

KERNEL = ("Triton grouped GEMMs (experts/kernels), E4M3 with row-wise scales, "
          "Hopper's native FP8 accumulation")

# One tile for all six GEMMs: in a sweep of five tiles on an H100, within 7 % of each GEMM's best.
# Its tiles walked 16 row tiles at a time (GROUP_M) where 8 ran before: the fprop gate_up
# GEMM at 8x7B shapes, 4 x 4096 rows, 2.99 -> 2.86 ms, 4-5 % at 8x22B and 8192 rows too; the
# other five within 3 % either way (on an H100, by a sweep outside the repository). The
# weight gradients store in two column blocks: adding into .grad at 8 experts x 2048 rows of
# 8x7B, gate_up 3.93 -> 3.88 ms and down 2.15 -> 1.98 against four blocks, level when
# writing a new gradient (one block: 4.62 and 2.36).
_FP8_TILE = tile_config(128, 256, 128, 8, 3, group=16, parts=2)


def scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=torch.bfloat16, add_into=None, add=None):
    """`torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=...,
    use_fast_accum=True)` for row-wise scales, in two cases:

    - 2-D x 3-D (fprop, dgrad): mat_a [Q, I] row-major split by rows, mat_b [G, I, N]
      column-major, scale_a [Q], scale_b [G, N]; returns [Q, N], plus `add` (a contiguous
      [Q, N] tensor, not in torch's signature) where given, added before the output's rounding.
    - 2-D x 2-D (wgrad): mat_a [M, Q] row-major and mat_b [Q, N] column-major, both split
      along Q; scale_a [G * M] and scale_b [G * N], group-major; returns [G, M, N]. With
      `add_into` (a contiguous [G, M, N] tensor of any float dtype, not in torch's
      signature) it adds the product into that tensor and returns it.
    """
    if mat_a.stride(-1) != 1 or mat_b.stride(-2) != 1:
        raise ValueError("scaled_grouped_mm takes mat_a row-major and mat_b column-major")
    counts_G = torch.diff(offs, prepend=offs.new_zeros(1))
    tile = FP32_TILE if mat_a.dtype == torch.float32 else _FP8_TILE  # float32: the tests' unrounded values
    if mat_b.dim() == 3:
        w_GNI = mat_b.transpose(-2, -1)
        out = torch.empty(mat_a.shape[0], w_GNI.shape[1], dtype=out_dtype, device=mat_a.device)
        if add is not None and (add.shape != out.shape or not add.is_contiguous()):
            raise ValueError(f"scaled_grouped_mm's add must be contiguous of shape {tuple(out.shape)}")
        rows_gemm(mat_a, w_GNI, counts_G, out, n=w_GNI.shape[1], b_icontig=True, cfg=tile,
                  use_tma=tma_ok(mat_a, w_GNI), scales=(scale_a, scale_b), add=add)
        return out
    if add is not None:
        raise ValueError("scaled_grouped_mm adds a tensor to 2-D x 3-D products only")
    x_NQ = mat_b.t()
    out = add_into
    if out is None:
        out = torch.empty(offs.numel(), mat_a.shape[0], x_NQ.shape[0], dtype=out_dtype, device=mat_a.device)
    wgrad_gemm(mat_a, x_NQ, counts_G, out, cfg=tile, use_tma=tma_ok(mat_a, x_NQ), k_major=True,
               scales=(scale_a, scale_b), accumulate=add_into is not None)
    return out

