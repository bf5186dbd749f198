"""How the grouped GEMM kernels lay their work onto tiles and persistent programs.

Shape suffixes: see te_mixtral/__init__.py. Inside a kernel M, N, I are that GEMM's own
dims and BM/BN/BI its tile.

Both kernels (`grouped_gemm._rows_gemm`, `wgrad_gemm._wgrad_gemm`) run a fixed grid of
persistent programs, as many as the GPU holds (`max_programs`), each walking tiles
t = pid, pid + num_programs, ... so that the grid depends on shapes alone while the split
of rows among experts stays on the device. This module holds what they share:

- the tile configuration a launcher takes (`tile_config`), and the one tile of the fp32
  correctness path (`FP32_TILE`, with `dot_precision` for its dots);
- the launchers' host-side integer helpers (`cdiv`, `next_power_of_2`, `max_programs`) and
  the GPU's shared memory a block (`shared_memory_per_block`);
- on the device, `pick` (one entry of a per-expert vector held in registers) and
  `swizzle` (the order in which an expert's tiles are walked, for L2 reuse).

The tables that pick a tile per GEMM and regime are the callers' (`grouped_swiglu.CONFIGS`,
`scaled_grouped_mm`), chosen by measurement.
"""

import functools

import torch
import triton
import triton.language as tl


def tile_config(bm, bn, bi, warps, stages, progs=1, group=8, parts=4, flatten=False, tail_split=1):
    """One launch configuration, as the launchers (`rows_gemm`, `wgrad_gemm`) read it.

    BLOCK_M x BLOCK_N is the output tile and BLOCK_I the reduction step. PROGS_PER_SM=2
    keeps two programs on an SM (one's epilogue overlaps the other's loads); GROUP_M is how
    many row tiles `swizzle` walks together (16 halves how often a large-R GEMM streams an
    expert's weights from DRAM); EPI_PARTS is how many column blocks a SwiGLU epilogue walks
    (4 keeps 128-register accumulators from spilling; 2 is cheaper for small tiles), or a
    weight gradient's store; FLATTEN lets the compiler software-pipeline across tiles (see
    `_rows_gemm`); TAIL_SPLIT > 1 deals the reduction of the row GEMM's last, partly filled
    round of tiles out to all the programs, at most TAIL_SPLIT of them a tile (stream-K,
    `stream_k.py`).
    """
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_I=bi, GROUP_M=group, num_warps=warps,
                num_stages=stages, PROGS_PER_SM=progs, EPI_PARTS=parts, FLATTEN=flatten,
                TAIL_SPLIT=tail_split)


# fp32 inputs (no autocast): a correctness path, not a tuned one. tf32x3 dots split every
# operand in three, so tiles that suit bf16 spill; this one does not.
FP32_TILE = tile_config(64, 64, 32, 4, 3)


def dot_precision(dtype: torch.dtype) -> str:
    """The `input_precision` of `tl.dot` for operands of `dtype`."""
    # fp32 inputs: three tf32 products recover ~fp32 accuracy at tensor-core speed.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host-side sizes. Not `triton.cdiv`: in Triton 3.6 on
    that is a constexpr function, whose call from Python took 3.5 us on the development CPU
    (plain integers: 0.04 us), and the op's launchers made 14 such calls a step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1), without `triton.next_power_of_2`'s cost (above)."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def max_programs(device: torch.device) -> int:
    """Persistent programs per PROGS_PER_SM: one per SM on a GPU."""
    # The interpreter runs programs one after another: a few exercise the persistent loop.
    return _sm_count(device.index or 0) if device.type == "cuda" else 3


@functools.lru_cache(maxsize=None)
def shared_memory_per_block(device_index: int) -> int:
    """The most shared memory a block may ask on that GPU: the limit Triton's launcher checks."""
    import triton

    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


# --- on the device ----------------------------------------------------------------------


@triton.jit
def pick(vec, idx, e):
    """vec[e] for a register vector: a masked sum, since registers cannot be indexed."""
    return tl.sum(tl.where(idx == e, vec, 0), 0)


@triton.jit
def swizzle(local, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """Tile `local` of an m_tiles x n_tiles grid, walked GROUP_M rows at a time so that
    concurrently running programs share A rows-tiles and B column-tiles in L2."""
    per_group = GROUP_M * n_tiles
    first_m = (local // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (local % per_group) % group_rows
    pid_n = (local % per_group) // group_rows
    return pid_m, pid_n
