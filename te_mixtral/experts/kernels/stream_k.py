"""Stream-K: the last, part-filled round of a GEMM's tiles spread evenly over its programs.

Shape suffixes: see te_mixtral/__init__.py. Inside a kernel M, N, I are that GEMM's own
dims and BM/BN/BI its tile.

`grouped_gemm._rows_gemm` runs a fixed grid of P persistent programs over T output tiles,
each tile a reduction of `k_blocks` steps of BLOCK_I. When T is not a multiple of P the last
round leaves programs idle, and with few rows per expert that round is most of the GEMM: at
one local expert of Mixtral-8x7B, 64-row tiles, the down projection has 32 tiles of 128
columns for 132 SMs, each tile streaming a 128-column slice of the weight. An idle SM is
idle memory bandwidth, and these GEMMs are bound by reading the weights.

So the reduction steps of the last round's tiles are dealt out evenly (stream-K, Osama et
al., PPoPP 2023): tiles [0, whole) run whole, round by round, as before; the `left` tiles
after them make left * k_blocks steps, and program p of the `streams` that take part takes
steps [p * W // streams, (p + 1) * W // streams). Its range covers whole tiles where it
covers them, and at most two pieces of tiles (its first and its last). A tile done in
pieces is finished by the piece that arrives last (`add_pieces`): every piece leaves its
float32 partial sum in scratch and counts itself in; the last adds all of them in program
order, so the sum does not depend on which piece finished first, and runs the tile's
epilogue, SwiGLU's included. No piece waits for another, so no schedule can deadlock.

When it runs (`plan`): only where the last round is at most 7/8 full (a fuller round gains
less than a piece's fixed cost: the pipeline filled again, a partial stored and read back),
over at most LIMIT programs per streamed tile, and never a piece of less than one step.

The pieces count themselves in on one int32 per streamed tile, which the last piece sets
back to zero, so the counters a launch leaves are the zeros the next one needs: `arrivals`
keeps one buffer per CUDA stream (launches on a stream run one after another) rather than
launching a memset before every streamed GEMM, four of them a step at few rows.

This replaced splitting each tile of the last round into equal shares, which left the round
as it was whenever its tiles outnumbered half the programs (92 tiles on 132 SMs: no split,
the round as long as a full one), and split only the GEMMs with a plain epilogue.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def plan(total, k_blocks, programs, LIMIT: tl.constexpr):
    """(whole, streams) for `total` tiles of `k_blocks` steps on `programs` programs: tiles
    [0, whole) run whole; the rest are streamed by programs [0, streams), or none (0)."""
    whole = total // programs * programs
    left = total - whole
    streams = tl.minimum(tl.minimum(programs, left * LIMIT), left * k_blocks)
    pays = (left > 0) & (left * 8 <= programs * 7)
    return tl.where(pays, whole, total), tl.where(pays, streams, 0)


@triton.jit
def share(pid, streams, work, k_blocks):
    """Program `pid`'s streamed steps [w0, w1) of the `work` ones (counted from the first
    streamed tile), and how many tiles they touch (0 where it streams nothing)."""
    ways = tl.maximum(streams, 1)
    w0 = pid * work // ways
    w1 = (pid + 1) * work // ways
    touched = tl.where(pid < streams, (w1 - 1) // k_blocks - w0 // k_blocks + 1, 0)
    return w0, w1, touched.to(tl.int32)


@triton.jit
def piece(j, w0, w1, k_blocks):
    """The j-th tile that steps [w0, w1) touch, counted from the first streamed tile, and
    the steps [k0, k1) of it they cover."""
    s = w0 // k_blocks + j
    k0 = tl.maximum(w0 - s * k_blocks, 0)
    k1 = tl.minimum(w1 - s * k_blocks, k_blocks)
    return s.to(tl.int32), k0.to(tl.int32), k1.to(tl.int32)


@triton.jit
def _owner(w, streams, work):
    """The program whose steps include step w: the last p with p * work // streams <= w."""
    return ((w + 1) * streams - 1) // work


@triton.jit
def _slot(scratch_ptr, q, w0_q, tile_w, TWO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program q's partial sums of the streamed tile starting at step tile_w: two slots a
    program (its first streamed tile and its last), one or TWO accumulator tiles a slot."""
    later = (w0_q < tile_w).to(tl.int64)  # the tile is not the first that q's steps touch
    return scratch_ptr + ((q * 2 + later) * (1 + TWO)) * (BLOCK_M * BLOCK_N)


@triton.jit
def add_pieces(acc, acc2, scratch_ptr, arrivals_ptr, pid, s, w0, streams, work, k_blocks,
               TWO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's piece of streamed tile s, partial sums acc (and acc2 where TWO: SwiGLU's
    gate and up): leave them in scratch and count in. Returns (acc, acc2, last): the sums
    over all the tile's pieces, in program order, where this piece arrived last; else its own
    partials and False (nothing to store).

    scratch holds [programs, 2, 1 + TWO, BM, BN] float32; arrivals [programs] int32, zeros,
    one count a streamed tile, which the last piece sets back to zero."""
    size: tl.constexpr = BLOCK_M * BLOCK_N
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_w = s.to(tl.int64) * k_blocks
    mine = _slot(scratch_ptr, pid, w0, tile_w, TWO, BLOCK_M, BLOCK_N)
    tl.store(mine + offs, acc)
    if TWO:
        tl.store(mine + size + offs, acc2)
    tl.debug_barrier()  # every thread's part of the tile stored before the count goes up
    first = _owner(tile_w, streams, work).to(tl.int32)
    pieces = _owner(tile_w + k_blocks - 1, streams, work).to(tl.int32) - first + 1
    arrived = tl.atomic_add(arrivals_ptr + s, 1, sem="acq_rel", scope="gpu")
    last = arrived == pieces - 1
    if last:  # summed into acc: a second accumulator costs registers
        tl.atomic_xchg(arrivals_ptr + s, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for q in range(first, first + pieces):
            slot = _slot(scratch_ptr, q, q * work // streams, tile_w, TWO, BLOCK_M, BLOCK_N)
            acc += tl.load(slot + offs, cache_modifier=".cg")  # from L2, where the other SMs' stores are
            if TWO:
                acc2 += tl.load(slot + size + offs, cache_modifier=".cg")
    return acc, acc2, last


_ARRIVALS: dict = {}  # (device, stream) -> the int32 zeros that streamed tiles count on


def arrivals(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 zeros for a launch's streamed tiles to count on: one buffer per
    device and stream, which every launch leaves zero (`add_pieces`). Under CUDA-graph
    capture a new one, zeroed inside the graph: a buffer captured once holds no zeros until
    the graph replays."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device.type, device.index, stream)
    held = _ARRIVALS.get(key)
    if held is None or held.numel() < count:
        held = _ARRIVALS[key] = torch.zeros(count, dtype=torch.int32, device=device)
    return held
