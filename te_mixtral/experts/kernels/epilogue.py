"""Register-tile helpers that the grouped GEMMs' epilogues share (`grouped_gemm.py`,
`wgrad_gemm.py`): an accumulator tile is scaled and stored here, after the reduction.

Shape suffixes: see te_mixtral/__init__.py.
"""

import triton
import triton.language as tl


@triton.jit
def scale_tile(acc, row_scale_ptr, row_ok, col_scale_ptr, col_ok, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """acc[r, c] * row_scale[r] * col_scale[c]: the scales of row-wise scaled operands."""
    row_scale = tl.load(row_scale_ptr + tl.arange(0, BLOCK_M), mask=row_ok, other=0.0)
    col_scale = tl.load(col_scale_ptr + tl.arange(0, BLOCK_N), mask=col_ok, other=0.0)
    return acc * row_scale[:, None] * col_scale[None, :]


@triton.jit
def column_part(t, part: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Column block `part` of PARTS (1, 2 or 4) of t [BLOCK_M, BLOCK_N]. Triton cannot
    slice a register tile, so the columns are split in halves (twice for 4)."""
    if PARTS > 1:
        lo, hi = tl.split(t.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1))
        t = lo if part < PARTS // 2 else hi
        if PARTS == 4:
            lo, hi = tl.split(t.reshape(BLOCK_M, 2, BLOCK_N // 4).permute(0, 2, 1))
            t = lo if part % 2 == 0 else hi
    return t
