"""Triton kernels for grouped (per-expert) GEMMs whose split sizes stay on the device.

Shape suffixes: see te_mixtral/__init__.py. Inside a kernel M, N, I
are that GEMM's own dims and BM/BN/BI its tile.

Two kernels cover the six GEMMs of the expert FFN's forward and backward
(`grouped_swiglu.py` composes them): `_rows_gemm` here, and the weight gradients'
`_wgrad_gemm` in `wgrad_gemm.py`. What they share, the tile configuration and the
persistent programs' schedule, is `schedule.py`'s; their epilogues' tile helpers are
`epilogue.py`'s.

* `_rows_gemm`: out[rows of e] = A[rows of e] @ B_e for every expert e. A [R, I] is split
  by rows; B_e is one expert's slice of a stacked weight, stored either I-contiguous
  ([L, N, I], an `x @ W.T`) or N-contiguous ([L, I, N], an `x @ W`). Its epilogue can fuse
  SwiGLU: `EPI_SWIGLU` computes gate and up tiles side by side (two accumulators sharing
  the A tile), stores both pre-activations and silu(gate) * up; `EPI_SWIGLU_BWD` turns the
  product tile d(act) into d(gate), d(up) using the saved pre-activations, and re-creates
  act on the way for the down projection's weight gradient. Under any epilogue the
  reduction of the tiles that would leave programs idle in the last round can be dealt out
  to all of them (`TAIL_SPLIT`: stream-K, `stream_k.py`). The plain epilogue can scale its
  sums by one factor per row of A and one per column of B (`SCALED`: FP8 operands with
  row-wise scales, `scaled_grouped_mm.py`).
  B may also be a frozen base in NF4 (`B_NF4`, `nf4_operand.py`): each B tile is read as
  packed 4-bit codes and block scales and dequantised in registers inside the K loop
  (`nf4_decode.b_tile`), in either orientation, so the forward and both dgrads read half a
  byte per weight.

No host synchronisation. The grid is fixed by shapes alone (one or two programs per SM,
fewer when R allows fewer tiles), so a CUDA graph captured at one split replays at any
other with the same R. Every
program loads `tokens_per_expert_L` itself, builds per-expert row and tile offsets with
a cumsum in registers, and walks the tiles t = pid, pid + num_programs, ... up to a total that it
computed on the device. A tile finds its expert by counting how many tile-ranges end at
or before it: a [BLOCK_L] vector compare-and-sum, no search loop. Streamed tiles add their
pieces up in a fixed order, so results do not vary from run to run.

Loads. With `USE_TMA` (CUDA, 16-byte aligned rows) operands come through host-built
tensor descriptors: the copy engine zero-fills outside the tensor, so the row tail of the
last expert and the I tail need no masks. A rows-tile may run into the next expert's rows;
those rows produce garbage output rows that the masked store drops. Without TMA (odd
shapes; calls with so few rows that building the descriptors on the host costs more than
they save, see grouped_swiglu.uses_descriptors; the CPU interpreter) plain pointer loads
mask rows past R, columns and the I tail for the same effect.
"""

import torch
import triton
import triton.language as tl

from te_mixtral.experts.kernels import nf4_decode, stream_k
from te_mixtral.experts.kernels.compile_ahead import launch
from te_mixtral.experts.kernels.epilogue import column_part, scale_tile
from te_mixtral.experts.kernels.nf4_operand import NF4Operand
from te_mixtral.experts.kernels.schedule import cdiv, dot_precision, max_programs, next_power_of_2, pick, swizzle
from te_mixtral.experts.kernels.tma_host import descriptor, ensure_cuda_context

# Constexpr globals so the kernels can branch on them at compile time.
EPI_PLAIN = tl.constexpr(0)
EPI_SWIGLU = tl.constexpr(1)
EPI_SWIGLU_BWD = tl.constexpr(2)


# --- row-grouped GEMM with optional SwiGLU epilogues ----------------------------------


@triton.jit(do_not_specialize=["R"])  # R changes every step under EP: one compile, not one per R % 16
def _rows_gemm(
    a_src, b_src, counts_ptr, out_ptr, h_ptr, scratch_ptr, arrivals_ptr, a_scale_ptr, b_scale_ptr, add_ptr,
    nf4_scale_ptr, nf4_code_ptr, nf4_row_bytes, nf4_row_scales,
    R, N, I, L, b_rows_per_expert,
    EPILOGUE: tl.constexpr, B_ICONTIG: tl.constexpr, WRITE_ACT: tl.constexpr, SCALED: tl.constexpr,
    ADD: tl.constexpr, B_NF4: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_I: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_L: tl.constexpr, FLATTEN: tl.constexpr,
    EPI_PARTS: tl.constexpr, TAIL_SPLIT: tl.constexpr,
):
    """out[rows of e, :N] = epilogue(A[rows of e, :I] @ B_e), for all experts.

    B_e is rows [e * b_rows_per_expert, ...) of the 2-D weight view: [N, I] rows when
    B_ICONTIG, [I, N] rows otherwise. EPI_SWIGLU reads a second B tile N rows below the
    first (gate rows [0, N), up rows [N, 2N)), stores both to h [R, 2N] and act to out.
    EPI_SWIGLU_BWD reads h, overwrites it in place with its gradient and, with WRITE_ACT,
    stores the recomputed act to out. SwiGLU epilogues run in EPI_PARTS column blocks.
    TAIL_SPLIT > 1 deals the reduction of the last, partly filled round of tiles out to the
    programs, at most TAIL_SPLIT of them a tile (stream_k.py): scratch [num_programs, 2,
    2 (EPI_SWIGLU: gate, up) or 1, BLOCK_M, BLOCK_N] float32 holds the pieces' partial sums,
    and arrivals [>= num_programs] int32, zeros, counts the pieces of each streamed tile
    done (and is left zero).
    SCALED (plain epilogue only) multiplies row r's sums by a_scale[r] and expert e's column
    c by b_scale[e, c] (float32, [R] and [L, N]) before the store.
    ADD adds a tensor to the sums: under the plain epilogue one laid out as out [R, N], after
    the scales (LoRA's deltas over a frozen FP8 base); under the SwiGLU ones before the
    activation, under EPI_SWIGLU one laid out as h [R, 2N] (LoRA's gate_up delta), under
    EPI_SWIGLU_BWD one laid out as act [R, N] (the down adapter's share of d(act)).
    B_NF4 (no TMA) reads B as NF4 (nf4_operand.py): b_src the packed codes of the 2-D view,
    nf4_scale the block scales' 2-D view, nf4_code the 16 code values, nf4_row_bytes and
    nf4_row_scales the two views' row strides; each B tile is dequantised in registers to A's
    dtype before its dot (`nf4_decode.b_tile`).
    """
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    idx = tl.arange(0, BLOCK_L)
    counts = tl.load(counts_ptr + idx, mask=idx < L, other=0).to(tl.int32)
    row_ends = tl.cumsum(counts, 0)
    tiles = tl.cdiv(counts, BLOCK_M) * n_tiles
    tile_ends = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    k_blocks = tl.cdiv(I, BLOCK_I)
    programs = tl.num_programs(0)
    whole, touched = total, 0
    if TAIL_SPLIT > 1:
        whole, streams = stream_k.plan(total, k_blocks, programs, TAIL_SPLIT)
        work = (total - whole).to(tl.int64) * k_blocks  # the streamed tiles' steps
        w0, w1, touched = stream_k.share(pid, streams, work, k_blocks)
    ri = tl.arange(0, BLOCK_I)

    # Units u = pid, pid + programs, ...: the whole tiles below `whole`, then the tiles this
    # program's streamed steps touch, one a round. FLATTEN lets the compiler
    # software-pipeline across tiles too, so the next tile's loads overlap this tile's
    # epilogue (at the cost of shared memory).
    for u in tl.range(pid, whole + touched * programs, programs, flatten=FLATTEN):
        t, i_start, i_end = u, 0, I
        if TAIL_SPLIT > 1:
            s, k0, k1 = u * 0, u * 0, k_blocks + u * 0
            if u >= whole:  # the j-th tile that this program's streamed steps touch
                s, k0, k1 = stream_k.piece((u - whole) // programs, w0, w1, k_blocks)
                t = whole + s
            i_start, i_end = k0 * BLOCK_I, tl.minimum(I, k1 * BLOCK_I)
        e = tl.sum((tile_ends <= t).to(tl.int32), 0)
        count = pick(counts, idx, e)
        row_start = pick(row_ends, idx, e) - count
        local = t - (pick(tile_ends, idx, e) - pick(tiles, idx, e))
        pid_m, pid_n = swizzle(local, tl.cdiv(count, BLOCK_M), n_tiles, GROUP_M)
        m0 = row_start + pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        b_row0 = e * b_rows_per_expert

        # Rows past this expert's count and columns past N are never stored.
        rm = tl.arange(0, BLOCK_M)
        in_expert = pid_m * BLOCK_M + rm < count
        h_tile = h_ptr + m0.to(tl.int64) * (2 * N)  # h rows are [gate | up]
        out_tile = out_ptr + m0.to(tl.int64) * N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if EPILOGUE == EPI_SWIGLU:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if not USE_TMA:
            # Rows past R are masked (loaded as zeros, their results dropped by the store's
            # mask), as are columns past N. A mask along rows keeps the copies along I
            # vectorised. Clamping those rows onto row R - 1 instead sent every one of them
            # to the same address, which cost the half-empty last tile far more than zeros.
            ra = tl.arange(0, BLOCK_M)
            a_rows_ok = (m0 + ra < R)[:, None]
            rn = n0 + tl.arange(0, BLOCK_N)
            a_ptrs = a_src + m0.to(tl.int64) * I + i_start + (ra[:, None] * I + ri[None, :])
            b_cols_ok = (rn < N)[None, :]
            if B_ICONTIG:
                b_ptrs = b_src + b_row0.to(tl.int64) * I + i_start + (ri[:, None] + rn[None, :] * I)
                b_step = BLOCK_I
                up_skip = N * I  # one expert's gate block; < 2**31 for any real expert
            else:
                b_ptrs = b_src + (b_row0 + i_start).to(tl.int64) * N + (ri[:, None] * N + rn[None, :])
                b_step = BLOCK_I * N
                up_skip = 0  # unused: SwiGLU's gate_up is always I-contiguous

        for i0 in range(i_start, i_end, BLOCK_I):
            if B_NF4:
                a = tl.load(a_ptrs, mask=a_rows_ok & ((i0 + ri)[None, :] < I), other=0.0)
                b = nf4_decode.b_tile(b_src, nf4_scale_ptr, nf4_code_ptr, nf4_row_bytes, nf4_row_scales, b_row0,
                                      n0, i0, N, I, B_ICONTIG, BLOCK_I, BLOCK_N).to(a.dtype)
            elif USE_TMA:
                a = a_src.load([m0, i0])
                if B_ICONTIG:
                    b = tl.trans(b_src.load([b_row0 + n0, i0]))
                else:
                    b = b_src.load([b_row0 + i0, n0])
            else:
                if EVEN_I:
                    a = tl.load(a_ptrs, mask=a_rows_ok, other=0.0)
                    b = tl.load(b_ptrs, mask=b_cols_ok, other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=a_rows_ok & ((i0 + ri)[None, :] < I), other=0.0)
                    b = tl.load(b_ptrs, mask=b_cols_ok & ((i0 + ri)[:, None] < I), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            if EPILOGUE == EPI_SWIGLU:
                if B_NF4:  # the up rows sit N rows below the gate rows
                    b_up = nf4_decode.b_tile(b_src, nf4_scale_ptr, nf4_code_ptr, nf4_row_bytes, nf4_row_scales,
                                             b_row0 + N, n0, i0, N, I, B_ICONTIG, BLOCK_I, BLOCK_N).to(a.dtype)
                elif USE_TMA:
                    b_up = tl.trans(b_src.load([b_row0 + N + n0, i0]))
                elif EVEN_I:
                    b_up = tl.load(b_ptrs + up_skip, mask=b_cols_ok, other=0.0)
                else:
                    b_up = tl.load(b_ptrs + up_skip, mask=b_cols_ok & ((i0 + ri)[:, None] < I),
                                   other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PREC)
            if not USE_TMA:
                a_ptrs += BLOCK_I
                b_ptrs += b_step

        # --- epilogue: a 64-bit base per tile and 32-bit offsets inside it ([BM, BN]
        # tensors of int64 offsets would take two registers per element) ---
        rows = count  # none where a piece of a streamed tile leaves the tile to another
        if TAIL_SPLIT > 1:
            if (k0 > 0) | (k1 < k_blocks):  # a piece: the one that arrives last finishes the tile
                if EPILOGUE == EPI_SWIGLU:
                    acc, acc_up, last = stream_k.add_pieces(acc, acc_up, scratch_ptr, arrivals_ptr, pid, s, w0,
                                                            streams, work, k_blocks, True, BLOCK_M, BLOCK_N)
                else:
                    acc, _, last = stream_k.add_pieces(acc, acc, scratch_ptr, arrivals_ptr, pid, s, w0,
                                                       streams, work, k_blocks, False, BLOCK_M, BLOCK_N)
                rows = tl.where(last, count, 0)
        row_ok = (pid_m * BLOCK_M + rm < rows)[:, None]
        if EPILOGUE == EPI_PLAIN:
            cols = n0 + tl.arange(0, BLOCK_N)
            if SCALED:
                acc = scale_tile(acc, a_scale_ptr + m0, in_expert,
                              b_scale_ptr + e * N + n0, cols < N, BLOCK_M, BLOCK_N)
            store_mask = row_ok & (cols < N)[None, :]
            if ADD:  # after the scales: the addend is in the output's units
                acc += tl.load(add_ptr + m0.to(tl.int64) * N + rm[:, None] * N + cols[None, :], mask=store_mask,
                               other=0.0).to(tl.float32)
            tl.store(out_tile + rm[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            # SwiGLU epilogues walk the tile in EPI_PARTS column blocks: with whole-tile
            # fp32 temporaries the compiler spilled ~1 KB per thread; with blocks of at
            # most 32 accumulator registers per thread, nothing.
            W: tl.constexpr = BLOCK_N // EPI_PARTS
            for part in tl.static_range(EPI_PARTS):
                cols = n0 + part * W + tl.arange(0, W)
                mask = row_ok & (cols < N)[None, :]
                gate_ptrs = h_tile + rm[:, None] * (2 * N) + cols[None, :]
                act_ptrs = out_tile + rm[:, None] * N + cols[None, :]
                acc_part = column_part(acc, part, EPI_PARTS, BLOCK_M, BLOCK_N)
                if EPILOGUE == EPI_SWIGLU:
                    g = acc_part
                    up = column_part(acc_up, part, EPI_PARTS, BLOCK_M, BLOCK_N)
                    if ADD:
                        add_ptrs = add_ptr + m0.to(tl.int64) * (2 * N) + rm[:, None] * (2 * N) + cols[None, :]
                        g += tl.load(add_ptrs, mask=mask, other=0.0).to(tl.float32)
                        up += tl.load(add_ptrs + N, mask=mask, other=0.0).to(tl.float32)
                    tl.store(gate_ptrs, g.to(h_ptr.dtype.element_ty), mask=mask)
                    tl.store(gate_ptrs + N, up.to(h_ptr.dtype.element_ty), mask=mask)
                    act = g * tl.sigmoid(g) * up
                    tl.store(act_ptrs, act.to(out_ptr.dtype.element_ty), mask=mask)
                else:
                    if ADD:
                        add_ptrs = add_ptr + m0.to(tl.int64) * N + rm[:, None] * N + cols[None, :]
                        acc_part += tl.load(add_ptrs, mask=mask, other=0.0).to(tl.float32)
                    _swiglu_bwd_store(acc_part, gate_ptrs, act_ptrs, mask, N, WRITE_ACT)


@triton.jit
def _swiglu_bwd_store(d_act, gate_ptrs, act_ptrs, mask, N, WRITE_ACT: tl.constexpr):
    """Overwrite gate, up (at gate_ptrs, gate_ptrs + N) with their gradients given d(act);
    with WRITE_ACT also store act itself, which the down weight gradient needs.

    act = silu(g) * u, and silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
    """
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    tl.store(gate_ptrs + N, (d_act * silu).to(gate_ptrs.dtype.element_ty), mask=mask)
    if WRITE_ACT:
        tl.store(act_ptrs, (silu * u).to(act_ptrs.dtype.element_ty), mask=mask)
    d_gate = d_act * u * (s * (1.0 + g * (1.0 - s)))
    tl.store(gate_ptrs, d_gate.to(gate_ptrs.dtype.element_ty), mask=mask)


# --- launchers ------------------------------------------------------------------------


def rows_programs(R: int, L: int, n: int, cfg: dict, sms: int) -> int:
    """The persistent programs (the grid) `rows_gemm` launches for R rows over L experts and
    n output columns with tile `cfg`, `sms` being `max_programs`: PROGS_PER_SM an SM, but no
    more than the tiles could be, times TAIL_SPLIT where the last round is streamed."""
    # Upper bound on sum_e ceil(n_e / bm) from shapes alone (no device counts needed).
    tile_bound = (R // cfg["BLOCK_M"] + min(L, R)) * cdiv(n, cfg["BLOCK_N"])
    return max(1, min(sms * cfg.get("PROGS_PER_SM", 1), tile_bound * cfg.get("TAIL_SPLIT", 1)))


def rows_gemm(a_RI, w, counts_L, out, *, n, b_icontig, cfg, use_tma,
              epilogue=EPI_PLAIN, h=None, scales=None, add=None, target=None):
    """Launch `_rows_gemm`. w is the stacked weight [L, n (2n for EPI_SWIGLU), I] when
    b_icontig, else [L, I, n], a tensor or an `NF4Operand` (read without TMA); out is [R, n]
    (None for EPI_SWIGLU_BWD without act).
    `scales` (plain epilogue) is (scale_R, scale_Ln) of row-wise scaled operands; `add`, a
    tensor added to the sums (the kernel's ADD), read as a contiguous one: a strided view (as
    grouped_mm returns for a width it pads) is copied first.
    Returns Triton's compiled kernel (registers, spills, shared memory for reports); with a
    `target` (a triton GPUTarget), only compiles it for that GPU (`compile_ahead.py`)."""
    add = None if add is None else add.contiguous()
    R, I = a_RI.shape
    L = w.shape[0]
    bm, bn, bi = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_I"]
    nf4_args = (None, None, 0, 0)
    if isinstance(w, NF4Operand):  # the packed codes and the scales as 2-D views, rows and their strides
        use_tma = False
        w2d = w.packed.reshape(L * w.shape[1], w.packed.shape[2])
        scale2d = w.scale.reshape(L * w.shape[1], w.scale.shape[2])
        nf4_args = (scale2d, w.code, w2d.stride(0), scale2d.stride(0))
    else:
        w2d = w.reshape(L * w.shape[1], w.shape[2])
    if use_tma:
        ensure_cuda_context(a_RI.device)  # descriptors are encoded before the launch binds one
        a_src = descriptor(a_RI, [bm, bi])
        b_src = descriptor(w2d, [bn, bi] if b_icontig else [bi, bn])
    else:
        a_src, b_src = a_RI, w2d
    tail_split = cfg.get("TAIL_SPLIT", 1)
    programs = rows_programs(R, L, n, cfg, max_programs(a_RI.device))
    scratch = arrivals = None
    if tail_split > 1:  # two slots a program, of one accumulator tile or (SwiGLU) two
        slots = programs * 2 * (2 if epilogue == EPI_SWIGLU else 1)
        scratch = torch.empty(slots, bm, bn, dtype=torch.float32, device=a_RI.device)
        arrivals = stream_k.arrivals(a_RI.device, programs)
    return launch(
        _rows_gemm, programs, target, a_src, b_src, counts_L, h if out is None else out,
        a_RI if h is None else h, scratch, arrivals, *(scales or (None, None)), add,
        *nf4_args, R, n, I, L, w.shape[1],
        EPILOGUE=epilogue, B_ICONTIG=b_icontig, WRITE_ACT=out is not None, SCALED=scales is not None,
        ADD=add is not None, B_NF4=nf4_args[0] is not None,
        USE_TMA=use_tma, EVEN_I=I % bi == 0, DOT_PREC=dot_precision(a_RI.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_I=bi, GROUP_M=cfg["GROUP_M"],
        BLOCK_L=next_power_of_2(L), FLATTEN=cfg.get("FLATTEN", False),
        EPI_PARTS=cfg.get("EPI_PARTS", 4), TAIL_SPLIT=tail_split,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
