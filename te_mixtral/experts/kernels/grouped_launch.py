"""Host side of the grouped GEMMs in `grouped_gemm.py`: grid sizes, TMA descriptors, the
split-K choice, and the CUDA context a backward thread needs. Everything here is decided
from shapes alone, never from the split sizes, which stay on the device.

Shape suffixes: see te_mixtral/experts/base.py.
"""

import ctypes
import functools
import math

import torch
import triton

from te_mixtral.experts.kernels.grouped_gemm import (
    EPI_PLAIN,
    _rows_gemm,
    _sum_splits,
    _wgrad_gemm,
)

# --- device, context, descriptors -----------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _max_programs(device: torch.device) -> int:
    # The interpreter runs programs one after another: a few exercise the persistent loop.
    return _sm_count(device.index or 0) if device.type == "cuda" else 3


@functools.lru_cache(maxsize=None)
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _ensure_cuda_context(device: torch.device) -> None:
    """Make the device's primary context current on this thread.

    Autograd runs the backward on a thread of its own, and the CUDA runtime binds a
    context to a thread only at that thread's first runtime call. Triton encodes host-side
    TMA descriptors through the driver before its launcher binds one, so a backward whose
    first CUDA work is ours failed on an H100 with 'Failed to create tensor map descriptor:
    invalid device context'. This does what Triton's launcher does for the launch itself.
    """
    if device.type != "cuda":
        return
    lib, ctx = _libcuda(), ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return
    dev = ctypes.c_int()
    lib.cuDeviceGet(ctypes.byref(dev), device.index or 0)
    lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    lib.cuCtxSetCurrent(ctx)


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32 inputs: three tf32 products recover ~fp32 accuracy at tensor-core speed.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


# --- split-K ----------------------------------------------------------------------------

# Every split runs at least MIN_SPLIT_BLOCKS reduction blocks, so the pipeline's fill
# (num_stages loads before the first dot) stays a small part of its loop; and at most
# MAX_SPLIT_K, since past a full machine more splits only add workspace traffic.
MIN_SPLIT_BLOCKS = 8
MAX_SPLIT_K = 8
# More splits must beat fewer by more than this factor: the model below leaves out each
# split's pipeline fill and the summing kernel's launch.
SPLIT_SLACK = 1.05
SUM_BLOCK = 1024


def split_k(R: int, L: int, n: int, I: int, cfg: dict, programs: int) -> int:
    """SPLIT_K for a plain-epilogue rows GEMM out [R, n] = A [R, I] @ B_e, from shapes alone.

    A model of its time, in units of the GEMM streaming its weights on every SM at once.
    With T output tiles and P resident programs, split s makes T * s tiles of 1/s the work,
    run in ceil(T * s / P) rounds: time ceil(T * s / P) * P / (T * s), which is 1 when the
    rounds are full and P / T when T < P tiles leave SMs idle. A split also writes and
    reads an fp32 partial per output element, 8 * s * R * n bytes against the weights'
    2 * L * n * I: 4 * s * R / (L * I) more. The fewest splits within SPLIT_SLACK of the
    cheapest win. T is counted from the mean rows per expert, R / L: the split sizes are
    on the device, and uneven routing changes the count by about a tile per expert.
    """
    tiles = L * math.ceil(R / L / cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    most = min(MAX_SPLIT_K, triton.cdiv(I, cfg["BLOCK_I"]) // MIN_SPLIT_BLOCKS)

    def cost(s):
        rounds = math.ceil(tiles * s / programs) * programs / (tiles * s)
        return rounds + (4 * s * R / (L * I) if s > 1 else 0.0)

    costs = {s: cost(s) for s in range(1, max(most, 1) + 1)}
    return min(s for s, c in costs.items() if c <= SPLIT_SLACK * min(costs.values()))


# --- launchers ------------------------------------------------------------------------


def rows_gemm(a_RI, w, counts_L, out, *, n, b_icontig, cfg, use_tma,
              epilogue=EPI_PLAIN, h=None):
    """Launch `_rows_gemm`. w is the stacked weight [L, n (2n for EPI_SWIGLU), I] when
    b_icontig, else [L, I, n]; out is [R, n] (None for EPI_SWIGLU_BWD without act).

    cfg holds the tile (BLOCK_M/N/I, GROUP_M, num_warps, num_stages) and optionally
    PROGS_PER_SM, FLATTEN, EPI_PARTS and SPLIT_K; SPLIT_K fixes the split of a plain
    epilogue (the sweep's use), otherwise `split_k` picks it. SwiGLU epilogues never split.
    Returns Triton's compiled kernel (registers, spills, shared memory for reports)."""
    _ensure_cuda_context(a_RI.device)
    R, I = a_RI.shape
    L = w.shape[0]
    bm, bn, bi = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_I"]
    programs = _max_programs(a_RI.device) * cfg.get("PROGS_PER_SM", 1)
    splits = 1
    if epilogue == EPI_PLAIN:
        splits = cfg.get("SPLIT_K") or split_k(R, L, n, I, cfg, programs)
    # Split partials go to an fp32 workspace [splits * R, n], summed into out at the end.
    target = out if splits == 1 else out.new_empty(splits * R, n, dtype=torch.float32)
    w2d = w.reshape(L * w.shape[1], w.shape[2])
    if use_tma:
        a_src = _descriptor(a_RI, [bm, bi])
        b_src = _descriptor(w2d, [bn, bi] if b_icontig else [bi, bn])
    else:
        a_src, b_src = a_RI, w2d
    # Upper bound on sum_e ceil(n_e / bm) from shapes alone (no device counts needed).
    tile_bound = (R // bm + min(L, R)) * triton.cdiv(n, bn) * splits
    grid = (max(1, min(programs, tile_bound)),)
    kernel = _rows_gemm[grid](
        a_src, b_src, counts_L, h if target is None else target, a_RI if h is None else h,
        R, n, I, L, w.shape[1], splits,
        EPILOGUE=epilogue, B_ICONTIG=b_icontig, WRITE_ACT=out is not None,
        USE_TMA=use_tma, EVEN_I=I % bi == 0, DOT_PREC=_dot_prec(a_RI.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_I=bi, GROUP_M=cfg["GROUP_M"],
        BLOCK_L=triton.next_power_of_2(L), FLATTEN=cfg.get("FLATTEN", False),
        EPI_PARTS=cfg.get("EPI_PARTS", 4),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _sum_splits[(triton.cdiv(R * n, SUM_BLOCK),)](target, out, R * n, splits,
                                                       BLOCK=SUM_BLOCK, num_warps=4)
    return kernel


def wgrad_gemm(g_RM, x_RN, counts_L, out_LMN, *, cfg, use_tma):
    """Launch `_wgrad_gemm`: out_LMN[e] = g_RM[rows of e]^T @ x_RN[rows of e]."""
    _ensure_cuda_context(g_RM.device)
    L, M, N = out_LMN.shape
    bm, bn, bi = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_I"]
    if use_tma:
        g_src, x_src = _descriptor(g_RM, [bi, bm]), _descriptor(x_RN, [bi, bn])
    else:
        g_src, x_src = g_RM, x_RN
    tiles = L * triton.cdiv(M, bm) * triton.cdiv(N, bn)
    grid = (max(1, min(_max_programs(g_RM.device) * cfg.get("PROGS_PER_SM", 1), tiles)),)
    return _wgrad_gemm[grid](
        g_src, x_src, counts_L, out_LMN, M, N, L,
        USE_TMA=use_tma, DOT_PREC=_dot_prec(g_RM.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_I=bi, GROUP_M=cfg["GROUP_M"],
        BLOCK_L=triton.next_power_of_2(L),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
