"""The weight-gradient GEMM of the expert FFN with split sizes on the device:
dW_e = dO[rows of e]^T @ X[rows of e] for every expert e, where dO is the gradient of the
forward GEMM's output (`g` in the code) and X its input.

The rows are the reduction dim, and how many an expert has is data: each tile runs an I loop
over its expert's row range, which can be empty (the tile is then written as zeros, never
left stale). Rows past the expert's end must be zeros, not another expert's rows: full
BLOCK_I blocks stream unmasked and the one partial block at the end is zeroed (and with
K_MAJOR a first block that starts before the expert's rows, see `_tma_k_major`). The tile
configuration and schedule are `schedule.py`'s, shared with `grouped_gemm.py`.

Shape suffixes: see te_mixtral/__init__.py.
"""

import triton
import triton.language as tl

from te_mixtral.experts.kernels.compile_ahead import launch
from te_mixtral.experts.kernels.epilogue import column_part, scale_tile
from te_mixtral.experts.kernels.schedule import cdiv, dot_precision, max_programs, next_power_of_2, pick, swizzle
from te_mixtral.experts.kernels.tma_host import descriptor, ensure_cuda_context


@triton.jit(do_not_specialize=["stride_k"])  # with K_MAJOR the row count rounded up: new every step
def _wgrad_gemm(
    g_src, x_src, counts_ptr, out_ptr, g_scale_ptr, x_scale_ptr,
    M, N, L, stride_k,
    USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr, K_MAJOR: tl.constexpr, SCALED: tl.constexpr,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_L: tl.constexpr, EPI_PARTS: tl.constexpr,
):
    """out[e] (M x N) = dO[rows of e, :M]^T @ X[rows of e, :N] for all experts, fp32 sums.

    dO and X are [R, M] and [R, N], or with K_MAJOR their transposes [M, R] and [N, R]
    (rows contiguous: Hopper's FP8 tensor cores take only operands contiguous along the
    reduction), both with row stride `stride_k`, which only K_MAJOR without TMA reads.
    SCALED multiplies out[e, m, n] by g_scale[e, m] * x_scale[e, n] (float32), the
    per-expert column scales of row-wise scaled FP8 operands. ACCUMULATE adds the sums
    into out as it holds them (a gradient summed across micro-batches, grad_accumulation.py).
    """
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_expert = m_tiles * n_tiles
    idx = tl.arange(0, BLOCK_L)
    counts = tl.load(counts_ptr + idx, mask=idx < L, other=0).to(tl.int32)
    row_ends = tl.cumsum(counts, 0)
    ri = tl.arange(0, BLOCK_I)

    for t in range(pid, L * per_expert, tl.num_programs(0)):
        e = t // per_expert
        pid_m, pid_n = swizzle(t % per_expert, m_tiles, n_tiles, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        count = pick(counts, idx, e)
        r0 = pick(row_ends, idx, e) - count
        n_full = count // BLOCK_I
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)

        if USE_TMA and K_MAJOR:
            acc = _tma_k_major(acc, g_src, x_src, r0, count, m0, n0, ri, DOT_PREC, BLOCK_I)
        elif USE_TMA:
            for i in range(n_full):
                acc = _tma_step(acc, g_src, x_src, r0 + i * BLOCK_I, m0, n0, ri, K_MAJOR, False, DOT_PREC)
            if count % BLOCK_I != 0:
                # The last block reaches into the next expert's rows: zero them.
                keep = ri < count - n_full * BLOCK_I
                acc = _tma_step(acc, g_src, x_src, r0 + n_full * BLOCK_I, m0, n0, keep, K_MAJOR, True, DOT_PREC)
        else:
            rm = m0 + tl.arange(0, BLOCK_M)
            rn = n0 + tl.arange(0, BLOCK_N)
            if K_MAJOR:
                g_ptrs = g_src + r0 + (rm.to(tl.int64)[:, None] * stride_k + ri[None, :])
                x_ptrs = x_src + r0 + (rn.to(tl.int64)[:, None] * stride_k + ri[None, :])
                g_step, x_step = BLOCK_I, BLOCK_I
            else:
                g_ptrs = g_src + r0.to(tl.int64) * M + (ri[:, None] * M + rm[None, :])
                x_ptrs = x_src + r0.to(tl.int64) * N + (ri[:, None] * N + rn[None, :])
                g_step, x_step = BLOCK_I * M, BLOCK_I * N
            for i0 in range(0, count, BLOCK_I):
                keep = i0 + ri < count
                if K_MAJOR:
                    g = tl.load(g_ptrs, mask=(rm < M)[:, None] & keep[None, :], other=0.0)
                    x = tl.load(x_ptrs, mask=(rn < N)[:, None] & keep[None, :], other=0.0)
                    acc = tl.dot(g, tl.trans(x), acc, input_precision=DOT_PREC)
                else:
                    g = tl.load(g_ptrs, mask=keep[:, None] & (rm < M)[None, :], other=0.0)
                    x = tl.load(x_ptrs, mask=keep[:, None] & (rn < N)[None, :], other=0.0)
                    acc = tl.dot(tl.trans(g), x, acc, input_precision=DOT_PREC)
                g_ptrs += g_step
                x_ptrs += x_step

        rows = m0 + tl.arange(0, BLOCK_M)
        if SCALED:
            acc = scale_tile(acc, g_scale_ptr + e * M + m0, rows < M, x_scale_ptr + e * N + n0,
                          n0 + tl.arange(0, BLOCK_N) < N, BLOCK_M, BLOCK_N)

        # The gradient is larger than L2 and not read again here: streaming stores (".cs"),
        # and evict-first loads where it is added into, keep it from evicting the operand
        # tiles that the next tiles re-read. Storing in EPI_PARTS column blocks measured a
        # few percent faster again (docs/kernels.md, v7).
        out_e = out_ptr + e.to(tl.int64) * M * N
        W: tl.constexpr = BLOCK_N // EPI_PARTS
        for part in tl.static_range(EPI_PARTS):
            cols = n0 + part * W + tl.arange(0, W)
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            ptrs = out_e + rows[:, None] * N + cols[None, :]
            value = column_part(acc, part, EPI_PARTS, BLOCK_M, BLOCK_N)
            if ACCUMULATE:
                value += tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            tl.store(ptrs, value.to(out_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")


@triton.jit
def _tma_k_major(acc, g_src, x_src, r0, count, m0, n0, ri, DOT_PREC: tl.constexpr, BLOCK_I: tl.constexpr):
    """acc + dO^T X over the `count` rows from row r0, which run along the operands'
    contiguous dim. Every load starts on a BLOCK_I boundary there (TMA needs 16 bytes; a
    block that is not 128-byte aligned straddles cache lines, and the 8x7B gate_up weight
    gradient over 4 experts of 4093-4099 rows took 3.99 ms that way against 3.25 aligned, on
    an H100), so an expert whose rows start between two begins one block early, with the
    rows before r0 masked off; the rows past its end are masked off in its last block."""
    head = tl.where(count > 0, r0 % BLOCK_I, 0)
    start, span = r0 - head, count + head
    n_full = span // BLOCK_I
    if head > 0:
        acc = _tma_step(acc, g_src, x_src, start, m0, n0, (ri >= head) & (ri < span), True, True, DOT_PREC)
    first_full = (head > 0).to(tl.int32)
    for i in range(first_full, n_full):
        acc = _tma_step(acc, g_src, x_src, start + i * BLOCK_I, m0, n0, ri, True, False, DOT_PREC)
    if (span % BLOCK_I != 0) & (n_full >= first_full):  # a last block that the first did not cover
        acc = _tma_step(acc, g_src, x_src, start + n_full * BLOCK_I, m0, n0, ri < span - n_full * BLOCK_I,
                        True, True, DOT_PREC)
    return acc


@triton.jit
def _tma_step(acc, g_src, x_src, r, m0, n0, keep, K_MAJOR: tl.constexpr, MASKED: tl.constexpr,
              DOT_PREC: tl.constexpr):
    """acc + dO^T X over the BLOCK_I rows from row r; with MASKED, the rows where `keep` is
    False count as zeros. Tiles are masked as loaded, before any transpose."""
    if K_MAJOR:  # [BLOCK_M, BLOCK_I] and [BLOCK_N, BLOCK_I]
        g, x = g_src.load([m0, r]), x_src.load([n0, r])
        if MASKED:
            g = tl.where(keep[None, :], g, tl.zeros_like(g))
            x = tl.where(keep[None, :], x, tl.zeros_like(x))
        acc = tl.dot(g, tl.trans(x), acc, input_precision=DOT_PREC)
    else:  # [BLOCK_I, BLOCK_M] and [BLOCK_I, BLOCK_N]
        g, x = g_src.load([r, m0]), x_src.load([r, n0])
        if MASKED:
            g = tl.where(keep[:, None], g, 0.0)
            x = tl.where(keep[:, None], x, 0.0)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=DOT_PREC)
    return acc


def wgrad_programs(L: int, M: int, N: int, cfg: dict, sms: int) -> int:
    """The persistent programs (the grid) `wgrad_gemm` launches for L experts' M x N weight
    gradients with tile `cfg`, `sms` being `max_programs`: PROGS_PER_SM an SM, but no more
    than the output tiles."""
    tiles = L * cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    return max(1, min(sms * cfg.get("PROGS_PER_SM", 1), tiles))


def wgrad_gemm(g, x, counts_L, out_LMN, *, cfg, use_tma, k_major=False, scales=None, accumulate=False, target=None):
    """Launch `_wgrad_gemm`: out_LMN[e] = g[rows of e]^T @ x[rows of e], with g [R, M] and
    x [R, N], or with `k_major` g [M, R] and x [N, R] (rows contiguous, of one stride).
    `scales` is (g_scale_LM, x_scale_LN); `accumulate` makes it out_LMN[e] += instead. With a
    `target` (a triton GPUTarget) it only compiles the kernel for that GPU (`compile_ahead.py`)."""
    if k_major and not (g.stride(1) == x.stride(1) == 1 and g.stride(0) == x.stride(0)):
        raise ValueError("wgrad_gemm with k_major takes g and x with contiguous rows of one stride")
    L, M, N = out_LMN.shape
    bm, bn, bi = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_I"]
    if use_tma:
        ensure_cuda_context(g.device)  # descriptors are encoded before the launch binds one
        blocks = ([bm, bi], [bn, bi]) if k_major else ([bi, bm], [bi, bn])
        g_src, x_src = descriptor(g, blocks[0]), descriptor(x, blocks[1])
    else:
        g_src, x_src = g, x
    return launch(
        _wgrad_gemm, wgrad_programs(L, M, N, cfg, max_programs(g.device)), target, g_src, x_src, counts_L, out_LMN,
        *(scales or (None, None)), M, N, L, g.stride(0),
        USE_TMA=use_tma, DOT_PREC=dot_precision(g.dtype), K_MAJOR=k_major, SCALED=scales is not None,
        ACCUMULATE=accumulate, BLOCK_M=bm, BLOCK_N=bn, BLOCK_I=bi, GROUP_M=cfg["GROUP_M"],
        BLOCK_L=next_power_of_2(L), EPI_PARTS=cfg.get("EPI_PARTS", 1),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
