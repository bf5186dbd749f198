"""FP8 (E4M3) grouped GEMMs on Hopper tensor cores, rowwise scaled, split sizes on the device.

Shape suffixes: see te_mixtral/experts/base.py.

Hopper (sm_90) has FP8 tensor cores but no MXFP8 (block-scaled) instructions; those
arrive with Blackwell. The finest scaling its grouped GEMM offers through PyTorch is
rowwise: `torch._scaled_grouped_mm` multiplies each output element by one float32 scale
of its row of A and one of its column of B, in the epilogue. So every operand row (A) and
every operand column (B) gets its own scale, taken over the GEMM's reduction dim:

    fprop  y = x w^T    x: one scale per row (over I); w: one per expert and output channel
    dgrad  dx = dy w    dy: one per row (over N);       w: one per expert and input channel
    wgrad  dw = dy^T x  dy, x: one per expert and channel, over that expert's rows only

Each scale is amax / 448, so the largest value of its row lands on E4M3's largest finite
value (an all-zero row gets a tiny scale instead of a division by zero). All operands are
E4M3, in backward too: this kernel takes no E5M2, and per-row scales leave gradients less
need of E5M2's range than one scale per tensor would. Accumulation is float32 in the
tensor cores (`use_fast_accum=False`), the output bfloat16.

What `torch._scaled_grouped_mm` (PyTorch 2.11, CUDA) requires, and where we meet it:
- A row-major, B column-major (`w_GNI.transpose(-2, -1)` of a contiguous w is).
- I and N multiples of 16 (Mixtral's 4096 and 14336 are).
- `offs` int32, the running end of each group's rows.
- Scales float32: A's 1-D over its rows; B's [G, N] for a 3-D B. When both operands are
  2-D (wgrad, groups cut along the reduction dim) scales are 1-D, group-major: A's
  [G * M], B's [G * N].
- In the 2-D x 2-D case a group's row count must be a positive multiple of 16 (each group
  starts a new TMA tile, 16-byte aligned in FP8, and CUTLASS rejects an empty group), a
  device-side assert, not a Python error. Hence `row_align = min_rows = 16`.
Everything stays on the device: the kernel reads `offs` on the GPU, so no split size ever
reaches the host.
"""

import torch

E4M3_MAX = 448.0
# Rows whose amax is 0 would get scale 0 and divide by it; any positive scale quantises
# zeros to zeros.
_MIN_AMAX = 1e-12
_ROWS_PER_CHUNK = 16


def quantize_rowwise(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values of `x` (made contiguous) and float32 scales, one per slice along `dim`
    (that dim removed). x may be a transposed view: the copy happens in 8 bits."""
    x32 = x.float()
    scale = x32.abs().amax(dim, keepdim=True).clamp(min=_MIN_AMAX) / E4M3_MAX
    values = (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.contiguous(), scale.squeeze(dim)


def quantize_columns_per_group(x_QC: torch.Tensor, offsets_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For wgrad: x_CQ, the transpose of x in E4M3, and scales_GC (flattened, group-major):
    one scale per column per group, over that group's rows only.

    Every group's rows are a multiple of 16, so the per-group amax is a max over 16-row
    chunks, each wholly inside one group; a scatter-max (no host sync) folds the chunks
    of a group together.
    """
    rows_Q, cols_C = x_QC.shape
    num_groups = offsets_G.numel()
    chunks = x_QC.float().reshape(rows_Q // _ROWS_PER_CHUNK, _ROWS_PER_CHUNK, cols_C)
    chunk_starts = torch.arange(0, rows_Q, _ROWS_PER_CHUNK, device=x_QC.device, dtype=offsets_G.dtype)
    group_of_chunk = torch.searchsorted(offsets_G, chunk_starts, right=True).clamp(max=num_groups - 1)

    amax_GC = chunks.new_zeros(num_groups, cols_C).scatter_reduce_(
        0, group_of_chunk[:, None].expand(-1, cols_C), chunks.abs().amax(1), reduce="amax"
    )
    scale_GC = amax_GC.clamp(min=_MIN_AMAX) / E4M3_MAX
    values = (chunks / scale_GC[group_of_chunk][:, None, :]).clamp(-E4M3_MAX, E4M3_MAX)
    values_CQ = values.to(torch.float8_e4m3fn).reshape(rows_Q, cols_C).t().contiguous()
    return values_CQ, scale_GC.reshape(-1)


class FP8HopperGemms:
    """The three GEMMs of a grouped linear in FP8 E4M3 with rowwise scales, on sm_90.

    `scaled_grouped_mm` is the kernel, `torch._scaled_grouped_mm` unless a test passes a
    stand-in with its semantics. `compile` runs the quantisers through `torch.compile`:
    each is a reduction and an elementwise pass that eager PyTorch spreads over about
    six kernels and float32 temporaries the size of the operand, which would cost a good
    part of what FP8 saves (docs/results/2026-11-21-fp8-hopper-notes.md has both timings).
    """

    recipe = "fp8-rowwise"
    row_align = _ROWS_PER_CHUNK
    min_rows = _ROWS_PER_CHUNK

    def __init__(self, scaled_grouped_mm=None, compile: bool = True):
        self._mm = scaled_grouped_mm or torch._scaled_grouped_mm
        self._quantize_rows, self._quantize_columns = quantize_rowwise, quantize_columns_per_group
        if compile:
            self._quantize_rows = torch.compile(quantize_rowwise, dynamic=True)
            self._quantize_columns = torch.compile(quantize_columns_per_group, dynamic=True)

    @property
    def kernel(self) -> str:
        return "torch._scaled_grouped_mm (CUTLASS sm90 FP8 rowwise), E4M3 in fprop, dgrad and wgrad"

    def _gemm(self, a, b, scale_a, scale_b, offsets_G):
        return self._mm(a, b, scale_a, scale_b, offs=offsets_G, out_dtype=torch.bfloat16, use_fast_accum=False)

    def fprop(self, x_QI, w_GNI, offsets_G):
        x_q, x_scale_Q = self._quantize_rows(x_QI)
        w_q, w_scale_GN = self._quantize_rows(w_GNI)
        return self._gemm(x_q, w_q.transpose(-2, -1), x_scale_Q, w_scale_GN, offsets_G)

    def dgrad(self, dy_QN, w_GNI, offsets_G):
        dy_q, dy_scale_Q = self._quantize_rows(dy_QN)
        # B must be column-major [G, N, I]: quantise w^T ([G, I, N], made contiguous) along N.
        wt_q, wt_scale_GI = self._quantize_rows(w_GNI.transpose(-2, -1))
        return self._gemm(dy_q, wt_q.transpose(-2, -1), dy_scale_Q, wt_scale_GI, offsets_G)

    def wgrad(self, dy_QN, x_QI, offsets_G):
        dy_NQ, dy_scale_GN = self._quantize_columns(dy_QN, offsets_G)
        x_IQ, x_scale_GI = self._quantize_columns(x_QI, offsets_G)
        return self._gemm(dy_NQ, x_IQ.t(), dy_scale_GN, x_scale_GI, offsets_G)
