"""NF4 decoded in Triton: a weight tile in registers, or a whole weight in one pass.

Shape suffixes: see te_mixtral/__init__.py.

te_mixtral/experts/quant/nf4.py defines the format, `nf4_operand.py` is a stacked weight in
it as the grouped GEMMs take it. They read it one of two ways; `grouped_swiglu` takes which
(its `dequantize_whole`, chosen by the tier from rows per expert):

- tile by tile (`b_tile`, called in `grouped_gemm._rows_gemm`'s K loop): each B tile read as
  packed codes and block scales and decoded in registers before its dot. Half a byte per
  weight read, but the decoding (a select tree, about ten instructions a value) is redone by
  every row tile that reads the weight, once per BLOCK_M rows of each expert, and it stands
  between the loads and the tensor cores. With few rows per expert that is once, and the GEMM
  is bound by reading the weights, where reading 0.56 bytes in place of 2 is what pays.
- whole (`dequantize`): one bandwidth-bound pass writes the weight in the rows' dtype (it
  reads 0.56 bytes and writes 2 per weight), and the BF16 GEMMs, at their own tiles and
  through TMA, read that copy as they read a dense base. The caller makes the copy right
  before the GEMM that reads it and drops it once that GEMM is launched: it is never saved
  for the backward, which decodes again.

Both compute CODE[index] * absmax in float32, then round to the dot's dtype: the same numbers.
"""

import torch
import triton
import triton.language as tl

from te_mixtral.experts.kernels.nf4_operand import NF4Operand

# The whole-weight pass's tile: 32 stored rows of 256 values (128 bytes of codes a row, one
# 128-byte line; 512 bytes out in BF16), 4 warps, 64 values a thread. Not yet timed.
DEQUANTIZE_TILE = (32, 256, 4)


@triton.jit
def b_tile(packed_ptr, scale_ptr, code_ptr, row_bytes, row_scales, b_row0, n0, i0, N, I,
           B_ICONTIG: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_I, BLOCK_N] B tile at (i0, n0) of the NF4 weight whose stored rows start at
    b_row0, in float32 (the caller rounds it to its dot's dtype). Stored rows are [N, I] when
    B_ICONTIG (the tile is read as [BLOCK_N, BLOCK_I] and transposed), else [I, N]; rows
    past N, or past I, read as zeros."""
    if B_ICONTIG:
        rn = n0 + tl.arange(0, BLOCK_N)
        return tl.trans(_tile(packed_ptr, scale_ptr, code_ptr, row_bytes, row_scales, b_row0 + n0, rn < N, i0,
                              BLOCK_N, BLOCK_I))
    ri = i0 + tl.arange(0, BLOCK_I)
    return _tile(packed_ptr, scale_ptr, code_ptr, row_bytes, row_scales, b_row0 + i0, ri < I, n0, BLOCK_I, BLOCK_N)


@triton.jit
def _tile(packed_ptr, scale_ptr, code_ptr, row_bytes, row_scales, row0, rows_ok, col0,
          ROWS: tl.constexpr, COLS: tl.constexpr):
    """Rows row0 + [0, ROWS) (those not rows_ok read as zeros), columns col0 + [0, COLS) of
    the weight's stored 2-D view, dequantised from NF4 (quant/nf4.py): CODE[index] * absmax in
    float32. row_bytes and row_scales are the packed codes' and the scales' row strides;
    col0 is a multiple of COLS, so a tile of at most 64 columns lies inside one scale block.

    Each stored byte and scale is loaded once: a row's bytes as one contiguous run (16-byte
    vectors where row_bytes allows), each byte for both its values, one scale per row and
    block; the code is looked up in registers (`_code`). Loading the scale and the code
    per value instead, the software pipeline stages a float32 tile per load per stage in
    shared memory, several times the tile's own size: past any GPU's limit at the BF16 tiles."""
    rows = (row0 + tl.arange(0, ROWS)).to(tl.int64)
    k = col0 // 2 + tl.arange(0, COLS // 2)
    byte = tl.load(packed_ptr + rows[:, None] * row_bytes + k[None, :],
                   mask=rows_ok[:, None] & (k < row_bytes)[None, :], other=0).to(tl.int32)
    values = tl.interleave(_code(code_ptr, byte >> 4), _code(code_ptr, byte & 15))  # value 2k: the high nibble
    if COLS <= 64:
        scale = tl.load(scale_ptr + rows * row_scales + col0 // 64, mask=rows_ok, other=0.0)
        return values * scale[:, None]
    else:
        j = col0 // 64 + tl.arange(0, COLS // 64)
        scale = tl.load(scale_ptr + rows[:, None] * row_scales + j[None, :],
                        mask=rows_ok[:, None] & (j < row_scales)[None, :], other=0.0)
        return tl.reshape(tl.reshape(values, (ROWS, COLS // 64, 64)) * scale[:, :, None], (ROWS, COLS))


@triton.jit
def _code(code_ptr, index, FIRST: tl.constexpr = 0, COUNT: tl.constexpr = 16):
    """CODE[index] for a tensor of 4-bit indices in [FIRST, FIRST + COUNT), the way
    bitsandbytes' CUDA kernels decode NF4: a binary tree of selects on the index bits, 15 in
    all, over the code values held in registers. (tl.gather from the table took one to eight
    warp shuffles a value, as the layout fell, and spilled at some tiles; a load a value from
    the table would be staged in shared memory by the software pipeline.)"""
    if COUNT == 1:
        return tl.load(code_ptr + FIRST)
    else:
        half: tl.constexpr = COUNT // 2
        return tl.where((index & half) != 0, _code(code_ptr, index, FIRST + half, half),
                        _code(code_ptr, index, FIRST, half))


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, code_ptr, out_ptr, rows, I, row_bytes, row_scales,
                       ROWS: tl.constexpr, COLS: tl.constexpr):
    """out [rows, I] = the stored 2-D view decoded, a [ROWS, COLS] tile a program."""
    row0, col0 = tl.program_id(0) * ROWS, tl.program_id(1) * COLS
    r = row0 + tl.arange(0, ROWS)
    c = col0 + tl.arange(0, COLS)
    values = _tile(packed_ptr, scale_ptr, code_ptr, row_bytes, row_scales, row0, r < rows, col0, ROWS, COLS)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * I + c[None, :], values.to(out_ptr.dtype.element_ty),
             mask=(r < rows)[:, None] & (c < I)[None, :])


def dequantize(w: NF4Operand, dtype: torch.dtype) -> torch.Tensor:
    """The weight [L, N, I] in `dtype`, contiguous, from one kernel: the numbers `b_tile` hands
    a dot, and quant/nf4.py's `dequantize_nf4` computes."""
    rows, I = w.shape[0] * w.shape[1], w.shape[2]
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    packed, scale = w.packed.reshape(rows, -1), w.scale.reshape(rows, -1)
    block_rows, block_cols, warps = DEQUANTIZE_TILE
    if out.numel():
        _dequantize_kernel[(triton.cdiv(rows, block_rows), triton.cdiv(I, block_cols))](
            packed, scale, w.code, out, rows, I, packed.stride(0), scale.stride(0),
            ROWS=block_rows, COLS=block_cols, num_warps=warps)
    return out
