"""Triton kernels that cast operands to FP8 E4M3 with the scales of `fp8_hopper.py`, and
fuse the expert MLP's SwiGLU into those casts.

Shape suffixes: see te_mixtral/__init__.py (Q rows, C columns, G groups).

`fp8_hopper.quantize_rowwise` and `quantize_columns_per_group` say what is computed, in
PyTorch, and stay the reference these kernels are tested against (bit for bit on the GPU).
PyTorch spreads each over several kernels with float32 temporaries the size of the operand;
here each reads its operand once or twice and writes the FP8 values once:

- `quantize_rows`: one program per row; a row that fits one block is read once and kept
  in registers, a longer one is read twice (amax, then cast; the second read hits L2).
  With `swiglu=True` it reads gate_up rows [Q, 2C] (gate | up) and quantises
  h = silu(gate) * up, computed in float32 on the way: the SwiGLU output is never written
  (`fp8_swiglu.py` uses this for the down projection's fprop operand).
- `quantize_columns`: one scale per column per group of rows, values written transposed
  (the wgrad operands), optionally of x with each row multiplied by a factor first (how
  `fp8_swiglu.py` moves the other wgrad operand's row scales onto this one). Two kernels
  over the same [BLOCK_R, BLOCK_C] tiles: the first folds each tile's column maxima into
  the group's with an atomic max, the second casts and stores the tile transposed. A tile
  may hold rows of several groups, so each row finds its group by counting the group ends
  at or before it.
- `swiglu_backward_rows`: the row-wise FP8 copy of d(gate_up), computed from d(h) and
  gate_up in one program per row, twice (amax, then cast) rather than written in bf16 and
  read back; optionally also written unquantised (a LoRA adapter's gradient).
- `transpose`: an FP8 tensor transposed, for a wgrad operand that has a row-wise copy.
- `quantize_weight`: both of a weight's FP8 copies (scaled along each of its dims) from
  two reads of it.
- `requantize_transposed`: the dgrad copy of a weight held in FP8 alone (a frozen base,
  frozen_fp8.py), cast again from its row-scaled values, by the same two kernels.

Scales are float32 amax * (1 / 448) (448 is E4M3's largest finite value); an all-zero
slice gets 1e-12 / 448. Values are divided by the scale with IEEE rounding (`tl.div_rn`,
as PyTorch divides two tensors). `q` may be float32 instead of FP8: then the kernels store
the scaled values before the cast, which is how the CPU interpreter (whose FP8 conversion
does not round like the GPU's) tests their indexing and scaling.
"""

import torch
import triton
import triton.language as tl

from te_mixtral.experts.quant.fp8_hopper import INV_E4M3_MAX, MIN_AMAX

_E4M3_MAX = tl.constexpr(448.0)
_INV_MAX = tl.constexpr(INV_E4M3_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)
_MAX_ROW_BLOCK = 16384  # elements of a row one program holds in registers at once (F = 14336 fits)
# (rows, columns, warps) of the tiles of the column-wise and weight casts: the fastest of a
# sweep from 32 x 128 to 256 x 64 on an H100 (docs/precision.md).
COLUMN_TILE = (64, 64, 4)
WEIGHT_TILE = (64, 64, 4)
# The weight's amax: (rows, columns, warps) of a tile, and how many columns one program walks.
# A program walking 512 columns of a 128-row block took an H100 0.376 ms for an 8x7B gate_up
# [4, 28672, 4096] and 0.631 for an 8x22B one [4, 32768, 6144], against 0.414 and 0.695 for
# 512-row walks down one 64-column block (row maxima folded per tile, the earlier kernel);
# taller, wider and 2048-column variants were slower.
WEIGHT_AMAX_TILE = (128, 64, 4)
WEIGHT_AMAX_COLUMNS = 512
# (rows, columns, warps) of the FP8 transpose's tiles: within 3 % of the best of eight tiles,
# 64 x 64 to 256 x 128, on an H100 (a [16384, 32768] transpose at 2.8 TB/s).
TRANSPOSE_TILE = (128, 128, 4)


@triton.jit
def _scale_of(amax):
    return tl.maximum(amax, _MIN_AMAX) * _INV_MAX


@triton.jit
def _cast(v, scale, q_ptr):
    q = tl.minimum(tl.maximum(tl.div_rn(v, scale), -_E4M3_MAX), _E4M3_MAX)
    return q.to(q_ptr.dtype.element_ty)


@triton.jit
def _load(ptrs, mask, C, SWIGLU: tl.constexpr):
    """Float32 values at `ptrs`, or silu(gate) * up with gate at `ptrs`, up C further."""
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(ptrs + C, mask=mask, other=0.0).to(tl.float32)
        v = v * tl.sigmoid(v) * up
    return v


@triton.jit
def _rows_kernel(x_ptr, q_ptr, scale_ptr, values_ptr, K, stride_row, SWIGLU: tl.constexpr,
                 WRITE_VALUES: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row, values_row = x_ptr + row * stride_row, q_ptr + row * K, values_ptr + row * K
    cols = tl.arange(0, BLOCK_K)
    if K <= BLOCK_K:  # the row fits: one read
        v = _load(x_row + cols, cols < K, K, SWIGLU)
        scale = _scale_of(tl.max(tl.abs(v), 0))
        tl.store(q_row + cols, _cast(v, scale, q_ptr), mask=cols < K)
        if WRITE_VALUES:
            tl.store(values_row + cols, v.to(values_ptr.dtype.element_ty), mask=cols < K)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(_load(x_row + k + cols, k + cols < K, K, SWIGLU)))
        scale = _scale_of(tl.max(amax, 0))
        for k in range(0, K, BLOCK_K):
            v = _load(x_row + k + cols, k + cols < K, K, SWIGLU)
            tl.store(q_row + k + cols, _cast(v, scale, q_ptr), mask=k + cols < K)
            if WRITE_VALUES:
                tl.store(values_row + k + cols, v.to(values_ptr.dtype.element_ty), mask=k + cols < K)
    tl.store(scale_ptr + row, scale)


def _row_block(K: int) -> int:
    return min(triton.next_power_of_2(K), _MAX_ROW_BLOCK)


def quantize_rows(x_MK: torch.Tensor, *, swiglu: bool = False, out_dtype=torch.float8_e4m3fn,
                  values_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q contiguous, scale): each row scaled by its own amax. x's last dim must be
    contiguous; leading dims are flattened (a [G, N, K] weight gives scales [G, N]).
    With `swiglu`, rows of x are gate | up and q holds silu(gate) * up (half as wide).
    `values_out` (contiguous, q's shape) also receives the unquantised values, in its dtype,
    from the same pass: the SwiGLU output a LoRA adapter reads."""
    if x_MK.stride(-1) != 1:
        raise ValueError("quantize_rows needs rows with a contiguous last dim")
    lead, K = x_MK.shape[:-1], x_MK.shape[-1] // (2 if swiglu else 1)
    x2 = x_MK.reshape(-1, x_MK.shape[-1])
    q = torch.empty(x2.shape[0], K, dtype=out_dtype, device=x2.device)
    scale = torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device)
    if values_out is not None and (values_out.shape != (*lead, K) or not values_out.is_contiguous()):
        raise ValueError(f"quantize_rows' values_out must be contiguous of shape {(*lead, K)}")
    if x2.shape[0]:
        block = _row_block(K)
        values = q if values_out is None else values_out  # a pointer the kernel ignores without WRITE_VALUES
        _rows_kernel[(x2.shape[0],)](x2, q, scale, values, K, x2.stride(0), SWIGLU=swiglu,
                                    WRITE_VALUES=values_out is not None, BLOCK_K=block,
                                    num_warps=max(4, min(16, block // 512)))  # <= 32 values per thread
    return q.view(*lead, K), scale.view(lead)


@triton.jit
def _swiglu_grads(dh_row, gu_row, k, cols, F):
    """d(gate), d(up) in float32 for columns k + cols of one row: d(gate) = dh * up *
    silu'(gate), d(up) = dh * silu(gate) (zeros past F)."""
    mask = k + cols < F
    dh = tl.load(dh_row + k + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gu_row + k + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_row + F + k + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    return dh * up * sig * (1.0 + gate * (1.0 - sig)), dh * gate * sig


@triton.jit
def _swiglu_bwd_rows_kernel(dh_ptr, gu_ptr, q_ptr, scale_ptr, grad_ptr, F, BLOCK_F: tl.constexpr,
                            WRITE_GRAD: tl.constexpr):
    """The row-wise cast of [d(gate) | d(up)]: their amax over the row, then the same
    gradients computed again and cast (the second read of the row hits L2); with
    WRITE_GRAD also stored unquantised, in grad's dtype."""
    row = tl.program_id(0).to(tl.int64)
    dh_row, gu_row, q_row = dh_ptr + row * F, gu_ptr + row * 2 * F, q_ptr + row * 2 * F
    grad_row = grad_ptr + row * 2 * F
    cols = tl.arange(0, BLOCK_F)
    amax = tl.zeros([BLOCK_F], dtype=tl.float32)
    for k in range(0, F, BLOCK_F):
        d_gate, d_up = _swiglu_grads(dh_row, gu_row, k, cols, F)
        amax = tl.maximum(amax, tl.maximum(tl.abs(d_gate), tl.abs(d_up)))
    scale = _scale_of(tl.max(amax, 0))
    for k in range(0, F, BLOCK_F):
        d_gate, d_up = _swiglu_grads(dh_row, gu_row, k, cols, F)
        tl.store(q_row + k + cols, _cast(d_gate, scale, q_ptr), mask=k + cols < F)
        tl.store(q_row + F + k + cols, _cast(d_up, scale, q_ptr), mask=k + cols < F)
        if WRITE_GRAD:
            tl.store(grad_row + k + cols, d_gate.to(grad_ptr.dtype.element_ty), mask=k + cols < F)
            tl.store(grad_row + F + k + cols, d_up.to(grad_ptr.dtype.element_ty), mask=k + cols < F)
    tl.store(scale_ptr + row, scale)


def swiglu_backward_rows(dh_QF: torch.Tensor, gate_up_Q2F: torch.Tensor, out_dtype=torch.float8_e4m3fn,
                         grad_out_Q2F: torch.Tensor | None = None):
    """(q, scale_Q): the row-wise cast of d(gate_up) [Q, 2F] for SwiGLU's backward, from d(h)
    and gate_up, without writing d(gate_up) itself, unless `grad_out_Q2F` (contiguous) is
    given: then d(gate_up) is also stored there, in its dtype, by the same pass."""
    Q, F = dh_QF.shape
    operands = (dh_QF, gate_up_Q2F) + (() if grad_out_Q2F is None else (grad_out_Q2F,))
    if not all(t.is_contiguous() for t in operands):
        raise ValueError("swiglu_backward_rows needs contiguous operands")
    q = torch.empty(Q, 2 * F, dtype=out_dtype, device=dh_QF.device)
    scale = torch.empty(Q, dtype=torch.float32, device=dh_QF.device)
    if Q:
        # 4096 columns a step: on an H100 at 16384 rows 0.97 ms for F = 14336 and 0.98 for 16384,
        # where 2048 took 1.08 and 1.24 (1024 to 8192 columns, 4 to 16 warps, tried).
        block = min(_row_block(F), 4096)
        grad = q if grad_out_Q2F is None else grad_out_Q2F  # a pointer the kernel ignores without WRITE_GRAD
        _swiglu_bwd_rows_kernel[(Q,)](dh_QF, gate_up_Q2F, q, scale, grad, F, BLOCK_F=block,
                                      WRITE_GRAD=grad_out_Q2F is not None, num_warps=8)
    return q, scale


@triton.jit
def _group_of_rows(rows, ends_ptr, G, BLOCK_G: tl.constexpr):
    """The group of each row: how many group ends are at or before it (at most G - 1)."""
    g = tl.arange(0, BLOCK_G)
    ends = tl.load(ends_ptr + g, mask=g < G, other=2**31 - 1)
    return tl.minimum(tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), 1), G - 1)


@triton.jit
def _load_scaled_rows(x_ptr, rows, row_ok, cols, col_ok, stride_row, row_scale_ptr, ROW_SCALED: tl.constexpr):
    """Float32 x[rows, cols] (zeros where masked), each row times row_scale[row] if ROW_SCALED."""
    v = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if ROW_SCALED:
        v = v * tl.load(row_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    return v


@triton.jit
def _slack_mask(rows, cols, C, stride):
    """Where a transposed store [cols, rows] may write: rows up to the output's row stride,
    past the row count Q into the buffer's slack (zeros are stored there), so the mask is
    the same for every 16 rows and the stores stay vectorised, Q a multiple of 16 or not."""
    return (rows < stride)[:, None] & (cols < C)[None, :]


@triton.jit(do_not_specialize=["Q"])  # the row count: one compile for any
def _column_amax_kernel(x_ptr, row_scale_ptr, ends_ptr, amax_bits_ptr, Q, C, G, stride_row,
                        ROW_SCALED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < Q, cols < C
    v = _load_scaled_rows(x_ptr, rows, row_ok, cols, col_ok, stride_row, row_scale_ptr, ROW_SCALED)
    group = _group_of_rows(rows, ends_ptr, G, BLOCK_G)
    first, last = tl.min(tl.where(row_ok, group, G), 0), tl.max(tl.where(row_ok, group, 0), 0)
    for g in range(first, last + 1):
        in_g = (group == g) & row_ok
        amax = tl.max(tl.where(in_g[:, None], tl.abs(v), 0.0), 0)
        # amax >= 0, and non-negative floats order like their bits as int32.
        tl.atomic_max(amax_bits_ptr + g * C + cols, amax.to(tl.int32, bitcast=True), mask=col_ok)


@triton.jit(do_not_specialize=["Q"])
def _column_cast_kernel(x_ptr, row_scale_ptr, ends_ptr, scale_ptr, q_ptr, Q, C, G, stride_row, stride_q,
                        ROW_SCALED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    v = _load_scaled_rows(x_ptr, rows, rows < Q, cols, cols < C, stride_row, row_scale_ptr, ROW_SCALED)
    group = _group_of_rows(rows, ends_ptr, G, BLOCK_G)
    first, last = tl.min(tl.where(rows < Q, group, G), 0), tl.max(tl.where(rows < Q, group, 0), 0)
    # One [BLOCK_C] row of scales per group in the tile (almost always one group), rather
    # than a [BLOCK_R, BLOCK_C] gather as large as the tile itself.
    q = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for g in range(first, last + 1):
        scale = tl.load(scale_ptr + g * C + cols, mask=cols < C, other=1.0)
        q = tl.where((group == g)[:, None], tl.div_rn(v, scale[None, :]), q)
    q = tl.minimum(tl.maximum(q, -_E4M3_MAX), _E4M3_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + cols[None, :].to(tl.int64) * stride_q + rows[:, None], q,
             mask=_slack_mask(rows, cols, C, stride_q))


def quantize_columns(x_QC: torch.Tensor, ends_G: torch.Tensor, *, row_scale_Q: torch.Tensor | None = None,
                     out_dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_CQ, the transpose of x with rows 16-byte aligned, and scale_GC flattened,
    group-major): one scale per column per group of rows, the groups ending at `ends_G`
    (int32, on the device), as the wgrad GEMM takes them. With `row_scale_Q` (float32)
    what is quantised is x with row q multiplied by row_scale_Q[q].
    """
    Q, C = x_QC.shape
    G = ends_G.numel()
    if x_QC.stride(1) != 1:
        raise ValueError("quantize_columns needs rows with a contiguous last dim")
    amax_bits = torch.zeros(G, C, dtype=torch.int32, device=x_QC.device)
    q = _rows_16_aligned(C, Q, out_dtype, x_QC.device)
    if Q == 0 or G == 0:
        return q, _scale_from_bits(amax_bits).reshape(-1)
    (block_r, block_c, warps), block_g = COLUMN_TILE, max(triton.next_power_of_2(G), 2)
    grid = (triton.cdiv(Q, block_r), triton.cdiv(C, block_c))
    tiles = dict(ROW_SCALED=row_scale_Q is not None, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_G=block_g,
                 num_warps=warps)
    _column_amax_kernel[grid](x_QC, row_scale_Q, ends_G, amax_bits, Q, C, G, x_QC.stride(0), **tiles)
    scale_GC = _scale_from_bits(amax_bits)
    _column_cast_kernel[grid](x_QC, row_scale_Q, ends_G, scale_GC, q, Q, C, G, x_QC.stride(0), q.stride(0), **tiles)
    return q, scale_GC.reshape(-1)


def _rows_16_aligned(rows: int, cols: int, dtype, device) -> torch.Tensor:
    """An empty [rows, cols] tensor whose rows start every multiple of 16 elements (16 bytes in
    FP8) whatever `cols` is, as the wgrad GEMM's TMA loads need: the first `cols` columns of a
    buffer whose width is rounded up to 16."""
    return torch.empty(rows, -(-cols // 16) * 16, dtype=dtype, device=device)[:, :cols]


@triton.jit(do_not_specialize=["Q"])
def _transpose_kernel(q_ptr, t_ptr, Q, C, stride_t, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < Q)[:, None] & (cols < C)[None, :]
    v = tl.load(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0.0)
    tl.store(t_ptr + cols[None, :].to(tl.int64) * stride_t + rows[:, None], v,
             mask=_slack_mask(rows, cols, C, stride_t))


def transpose(q_QC: torch.Tensor) -> torch.Tensor:
    """q_CQ, the transpose of a contiguous q_QC, rows 16-byte aligned (see `quantize_columns`)."""
    if not q_QC.is_contiguous():
        raise ValueError("transpose needs a contiguous tensor")
    Q, C = q_QC.shape
    t = _rows_16_aligned(C, Q, q_QC.dtype, q_QC.device)
    if q_QC.numel():
        block_r, block_c, warps = TRANSPOSE_TILE
        grid = (triton.cdiv(Q, block_r), triton.cdiv(C, block_c))
        _transpose_kernel[grid](q_QC, t, Q, C, t.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return t


@triton.jit
def _load_weight(w_ptr, in_scale_ptr, g, n, i, N, I, n_ok, i_ok, IN_SCALED: tl.constexpr):
    """Float32 w[g, n, i] of a [G, N, I] weight, each row times in_scale[g, n] if IN_SCALED
    (a weight given as FP8 values with row scales)."""
    v = tl.load(w_ptr + g * N * I + n[:, None] * I + i[None, :], mask=n_ok[:, None] & i_ok[None, :],
                other=0.0).to(tl.float32)
    if IN_SCALED:
        v = v * tl.load(in_scale_ptr + g * N + n, mask=n_ok, other=0.0)[:, None]
    return v


@triton.jit
def _weight_amax_kernel(w_ptr, in_scale_ptr, row_bits_ptr, col_bits_ptr, N, I, COLUMNS_PER_PROGRAM,
                        IN_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    """Row and column maxima of |w| by atomic max. A program walks COLUMNS_PER_PROGRAM
    columns of one row block, keeps its row maxima in registers and folds them in once at
    the end: every atomic costs bandwidth (a 64 x 64 tile per program with both maxima
    folded per tile read at 1.7 TB/s, where reading alone ran at 2.9)."""
    g = tl.program_id(2).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    i_start = tl.program_id(1) * COLUMNS_PER_PROGRAM
    row_max = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i0 in range(i_start, tl.minimum(i_start + COLUMNS_PER_PROGRAM, I), BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        i_ok = i < I
        v = tl.abs(_load_weight(w_ptr, in_scale_ptr, g, n, i, N, I, n_ok, i_ok, IN_SCALED))
        # Non-negative floats order like their bits as int32 (see _column_amax_kernel).
        tl.atomic_max(col_bits_ptr + g * I + i, tl.max(v, 0).to(tl.int32, bitcast=True), mask=i_ok)
        row_max = tl.maximum(row_max, tl.max(v, 1))
    tl.atomic_max(row_bits_ptr + g * N + n, row_max.to(tl.int32, bitcast=True), mask=n_ok)


@triton.jit
def _weight_cast_kernel(w_ptr, in_scale_ptr, row_scale_ptr, col_scale_ptr, q_ptr, qt_ptr, N, I,
                        IN_SCALED: tl.constexpr, STORE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_I: tl.constexpr):
    g = tl.program_id(2).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    n_ok, i_ok = n < N, i < I
    mask = n_ok[:, None] & i_ok[None, :]
    v = _load_weight(w_ptr, in_scale_ptr, g, n, i, N, I, n_ok, i_ok, IN_SCALED)
    col_scale = tl.load(col_scale_ptr + g * I + i, mask=i_ok, other=1.0)
    if STORE_ROWS:
        row_scale = tl.load(row_scale_ptr + g * N + n, mask=n_ok, other=1.0)
        tl.store(q_ptr + g * N * I + n[:, None] * I + i[None, :], _cast(v, row_scale[:, None], q_ptr), mask=mask)
    tl.store(qt_ptr + g * N * I + i[None, :] * N + n[:, None], _cast(v, col_scale[None, :], qt_ptr), mask=mask)


def quantize_weight(w_GNI: torch.Tensor, out_dtype=torch.float8_e4m3fn):
    """Both FP8 orientations of a stacked weight in two passes (amax, cast) instead of one
    `quantize_rows` and one `quantize_columns`: ((q_GNI, scale_GN) scaled along I, for
    fprop; (q_GIN, scale_GI) scaled along N, for dgrad)."""
    return _weight_casts(w_GNI.contiguous(), None, out_dtype, store_rows=True)


def requantize_transposed(q_GNI: torch.Tensor, scale_GN: torch.Tensor, out_dtype=torch.float8_e4m3fn,
                          scale_GI: torch.Tensor | None = None):
    """(qt_GIN, scale_GI): the dgrad orientation of the weight whose fprop copy is q_GNI
    with row scales scale_GN, cast from q * scale (float32, in registers) along N.
    `scale_GI`, the scales an earlier call returned for the same values, skips the pass
    that finds them (a frozen weight's never change)."""
    return _weight_casts(q_GNI.contiguous(), scale_GN.contiguous(), out_dtype, store_rows=False,
                         col_scale=scale_GI)[1]


def _weight_casts(w, in_scale_GN, out_dtype, store_rows, col_scale=None):
    G, N, I = w.shape
    q = torch.empty(G, N, I, dtype=out_dtype, device=w.device) if store_rows else None
    qt = torch.empty(G, I, N, dtype=out_dtype, device=w.device)
    row_scale = None  # given col_scale (requantize_transposed's), no row copy is stored
    if col_scale is None:
        row_bits = torch.zeros(G, N, dtype=torch.int32, device=w.device)
        col_bits = torch.zeros(G, I, dtype=torch.int32, device=w.device)
        if w.numel():
            block_n, block_i, warps = WEIGHT_AMAX_TILE
            _weight_amax_kernel[(triton.cdiv(N, block_n), triton.cdiv(I, WEIGHT_AMAX_COLUMNS), G)](
                w, in_scale_GN, row_bits, col_bits, N, I, WEIGHT_AMAX_COLUMNS, IN_SCALED=in_scale_GN is not None,
                BLOCK_N=block_n, BLOCK_I=block_i, num_warps=warps)
        row_scale, col_scale = _scale_from_bits(row_bits), _scale_from_bits(col_bits)
    if w.numel() == 0:
        return (q, row_scale), (qt, col_scale)
    block_n, block_i, warps = WEIGHT_TILE
    _weight_cast_kernel[(triton.cdiv(N, block_n), triton.cdiv(I, block_i), G)](
        w, in_scale_GN, row_scale, col_scale, q, qt, N, I, IN_SCALED=in_scale_GN is not None, STORE_ROWS=store_rows,
        BLOCK_N=block_n, BLOCK_I=block_i, num_warps=warps)
    return (q, row_scale), (qt, col_scale)


def _scale_from_bits(amax_bits_GC: torch.Tensor) -> torch.Tensor:
    return amax_bits_GC.view(torch.float32).clamp(min=MIN_AMAX) * INV_E4M3_MAX
