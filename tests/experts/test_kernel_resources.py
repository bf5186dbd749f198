"""Every tile tier custom_grouped can pick fits the GPUs it runs on, checked without a GPU.

Triton compiles a kernel at its first launch, for the GPU it launches on, and only there
learns that a tile asks more shared memory per block than the GPU has. Here each launch the
tier can make is compiled ahead of time as its launcher would compile it
(te_mixtral/experts/kernels/compile_ahead.py), for sm_90 (H100, H200), sm_80 (A100) and sm_89
(L40S, RTX 4090, RTX 6000 Ada), and its shared memory is checked against what such a GPU
lets a block have (the CUDA programming guide's table; Triton's `max_shared_mem`, which its
launcher checks). The NF4 base, which is for the GPUs smaller than an H100, must fit all of
them; the BF16 tables, tuned on Hopper, fit Hopper and the A100; the FP8 base
(device_mxfp8's fp8-hopper) runs on Hopper alone.

The shapes are small but specialise as Mixtral's do (row strides, the NF4 rows' bytes and
scales: multiples of 16). Tiles that differ only where shared memory cannot (GROUP_M's walk,
programs per SM, how far a tail splits) are compiled once. Triton caches each compile
(~/.triton/cache): the first run after a kernel changes compiles for a minute or two, later
runs take seconds.
"""

import functools
import os

import pytest
import torch
from triton.backends.compiler import GPUTarget

from te_mixtral.experts.kernels.grouped_gemm import EPI_SWIGLU, EPI_SWIGLU_BWD, rows_gemm
from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, FP32_TILE, NF4_CONFIGS
from te_mixtral.experts.kernels.scaled_grouped_mm import _FP8_TILE
from te_mixtral.experts.kernels.wgrad_gemm import wgrad_gemm
from te_mixtral.experts.quant.frozen_nf4 import FrozenNF4Weight

# Under Triton's interpreter kernels are run, not compiled.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for GPUs")

KIB = 1024
# Shared memory a block may have, by compute capability.
MAX_SHARED = {80: 163 * KIB, 89: 99 * KIB, 90: 227 * KIB}
NF4_MAX_SHARED = 99 * KIB  # the least of any GPU from sm_80 on (sm_86 and sm_89 alike)
L, D, F = 2, 1024, 2048  # 16 and 32 NF4 scales a row; Mixtral's 4096 and 14336 make 64 and 224
R = 64


def row_gemms(dtype, gate_up, down):
    """The expert FFN's row GEMMs as grouped_swiglu launches them, LoRA's adds included:
    {name: rows_gemm's arguments but the tile}."""
    zeros = functools.partial(torch.zeros, dtype=dtype)
    x, act, h = zeros(R, D), zeros(R, F), zeros(R, 2 * F)
    counts = torch.zeros(L, dtype=torch.int64)
    return {
        "gate_up": dict(a_RI=x, w=gate_up, counts_L=counts, out=act, n=F, b_icontig=True, epilogue=EPI_SWIGLU,
                        h=h, add=zeros(R, 2 * F)),
        "down": dict(a_RI=act, w=down, counts_L=counts, out=zeros(R, D), n=D, b_icontig=True),
        "down_dgrad": dict(a_RI=zeros(R, D), w=down, counts_L=counts, out=act, n=F, b_icontig=False,
                           epilogue=EPI_SWIGLU_BWD, h=h, add=zeros(R, F)),
        "gate_up_dgrad": dict(a_RI=h, w=gate_up, counts_L=counts, out=zeros(R, D), n=D, b_icontig=False),
    }


def wgrad_gemms(dtype):
    """The two weight gradients as grouped_swiglu launches them: {name: wgrad_gemm's arguments}."""
    zeros = functools.partial(torch.zeros, dtype=dtype)
    counts = torch.zeros(L, dtype=torch.int64)
    return {"down_wgrad": dict(g=zeros(R, D), x=zeros(R, F), counts_L=counts, out_LMN=zeros(L, D, F)),
            "gate_up_wgrad": dict(g=zeros(R, 2 * F), x=zeros(R, D), counts_L=counts, out_LMN=zeros(L, 2 * F, D))}


def distinct(tables, gemms):
    """[(gemm, tile)] over the tables' tiles for `gemms`, once for each tile that could ask a
    different amount of shared memory."""
    found = {}
    for table in tables:
        for gemm in gemms:
            cfg = table[gemm]
            key = (gemm, *(cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_I", "num_warps", "num_stages", "FLATTEN",
                                            "EPI_PARTS")), cfg["TAIL_SPLIT"] > 1)
            found.setdefault(key, (gemm, cfg))
    return list(found.values())


def too_big(launches, limit, arch):
    """The launches [(what, launcher, arguments)] that ask more than `limit` bytes of shared
    memory a block compiled for sm_`arch`, each with what it asks."""
    target = GPUTarget("cuda", arch, 32)
    found = []
    for what, launcher, arguments in launches:
        shared = launcher(**arguments, target=target).metadata.shared
        if shared > limit:
            found.append(f"{what}: {shared / KIB:.1f} KiB")
    return found


def test_the_nf4_table_covers_every_regime():
    assert NF4_CONFIGS.keys() == CONFIGS.keys()
    assert all(table.keys() == CONFIGS[name].keys() for name, table in NF4_CONFIGS.items())


@pytest.mark.parametrize("arch", MAX_SHARED)
def test_every_nf4_tile_fits_every_gpu_the_base_is_for(arch):
    """Each tile of NF4_CONFIGS for the four GEMMs that read the NF4 base, and the fp32
    path's one tile, within 99 KiB. This failed before the kernels read each stored byte and
    scale once: their per-value loads of the scales and the code, staged by the software
    pipeline, took the BF16 tables' gate_up tile to 464 KiB (an H200 has 227)."""
    nf4 = FrozenNF4Weight((L, 2 * F, D)).operand(), FrozenNF4Weight((L, D, F)).operand()
    launches = []
    for dtype, tables in ((torch.bfloat16, NF4_CONFIGS.values()), (torch.float32, [dict.fromkeys(CONFIGS["large"],
                                                                                                 FP32_TILE)])):
        gemms = row_gemms(dtype, *nf4)
        launches += [(f"{gemm} {dtype} {cfg}", rows_gemm, dict(gemms[gemm], cfg=cfg, use_tma=False))
                     for gemm, cfg in distinct(tables, gemms)]
    big = too_big(launches, NF4_MAX_SHARED, arch)
    assert not big, f"NF4 tiles past 99 KiB on sm_{arch}: {big}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_every_bf16_tile_fits_hopper_and_the_a100(arch):
    """The BF16 tables' six GEMMs, through TMA descriptors on Hopper (their shared memory is
    the pointer loads' to within a few bytes) and pointer loads on the A100; on Hopper also
    the FP8 base's tile, its forward and dgrad GEMM and its weight gradient."""
    bf16 = functools.partial(torch.zeros, dtype=torch.bfloat16)
    rows, wgrads = row_gemms(torch.bfloat16, bf16(L, 2 * F, D), bf16(L, D, F)), wgrad_gemms(torch.bfloat16)
    tma = arch >= 90
    launches = [(f"{gemm} {cfg}", rows_gemm, dict(rows[gemm], cfg=cfg, use_tma=tma))
                for gemm, cfg in distinct(CONFIGS.values(), rows)]
    launches += [(f"{gemm} {cfg}", wgrad_gemm, dict(wgrads[gemm], cfg=cfg, use_tma=tma))
                 for gemm, cfg in distinct(CONFIGS.values(), wgrads)]
    if arch >= 90:
        fp8 = functools.partial(torch.zeros, dtype=torch.float8_e4m3fn)
        scale = functools.partial(torch.ones, dtype=torch.float32)
        launches += [
            ("fp8 rows", rows_gemm, dict(a_RI=fp8(R, D), w=fp8(L, F, D), counts_L=torch.zeros(L, dtype=torch.int64),
                                         out=bf16(R, F), n=F, b_icontig=True, cfg=_FP8_TILE, use_tma=True,
                                         scales=(scale(R), scale(L, F)), add=bf16(R, F))),
            ("fp8 wgrad", wgrad_gemm, dict(g=fp8(D, R), x=fp8(F, R), counts_L=torch.zeros(L, dtype=torch.int64),
                                           out_LMN=bf16(L, D, F), cfg=_FP8_TILE, use_tma=True, k_major=True,
                                           scales=(scale(L * D), scale(L * F)))),
        ]
    big = too_big(launches, MAX_SHARED[arch], arch)
    assert not big, f"tiles past sm_{arch}'s {MAX_SHARED[arch] // KIB} KiB: {big}"
