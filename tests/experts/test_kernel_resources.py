"""Every tile tier custom_grouped can pick fits the GPUs it runs on, checked without a GPU.

Triton compiles a kernel at its first launch, for the GPU it launches on, and only there
learns that a tile asks more shared memory per block than the GPU has. Here each launch the
tier can make is compiled ahead of time as its launcher would compile it
(te_mixtral/experts/kernels/compile_ahead.py), for sm_90 (H100, H200), sm_80 (A100), sm_86
(RTX 3090, A40) and sm_89 (L40S, RTX 4090, RTX 6000 Ada), and its shared memory is checked
against what such a GPU lets a block have (the CUDA programming guide's table; Triton's
`max_shared_mem`, which its launcher checks). The NF4 base, which is for the GPUs smaller
than an H100, must fit all of them; the BF16 tables, tuned on Hopper, fit Hopper and the
A100, and their cut copies (SMALL_SHARED_CONFIGS) fit sm_86 and sm_89 without spilling
registers (the SASS's stack frame); the FP8 base (device_mxfp8's fp8-hopper) runs on Hopper
alone. An sm_89 GPU compiles as an sm_86 one does here: Triton lowers both alike (the same
TTGIR but for its target line) and ptxas gives every tile of these tables the same shared
memory and stack frame on both, so the suite compiles for sm_86 and stands it for both
(`ARCHS`); `TE_MIXTRAL_EVERY_TILE=1` compiles for sm_89 too.

The shapes are small but specialise as Mixtral's do (row strides, the NF4 rows' bytes and
scales: multiples of 16). Tiles that differ only where shared memory cannot (GROUP_M's walk,
programs per SM, how far a tail splits) are compiled once.

A compile takes a second or two, and every tile for every GPU a few minutes of a fresh
machine's CPU (Triton caches each compile, ~/.triton/cache, but CI starts empty). So the
suite compiles, of each table family (the NF4 base's, its fp32 path, the BF16 row GEMMs,
their weight gradients) and for each GPU, the tile whose software pipeline stages the most
bytes (`staged_bytes`): the one that asks the most shared memory, which a kernel that stages
more, or a larger tile in a table, makes larger. `TE_MIXTRAL_EVERY_TILE=1` compiles every
tile instead, and checks that the suite's pick asks as much as any (run it after changing
a tile table or what a kernel loads; tests/README.md).

The compiles are the CPU's work of a few seconds each, which the session's own tests would
wait for: they run in a pytest of their own (TE_MIXTRAL_COMPILE_RUN=1), started with the
session in the background as other planned work is (tests/README.md), and the launcher test
here fails, with that run's output, where one of them failed there.
"""

import functools
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton
from background import Command, assert_passed
from triton.backends.compiler import GPUTarget

from te_mixtral.experts.kernels.grouped_gemm import EPI_SWIGLU, EPI_SWIGLU_BWD, rows_gemm
from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, FP32_TILE, NF4_CONFIGS, SMALL_SHARED_CONFIGS
from te_mixtral.experts.kernels.scaled_grouped_mm import _FP8_TILE
from te_mixtral.experts.kernels.wgrad_gemm import wgrad_gemm
from te_mixtral.experts.quant.frozen_nf4 import FrozenNF4Weight

# Under Triton's interpreter kernels are run, not compiled.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for GPUs")
COMPILING = os.environ.get("TE_MIXTRAL_COMPILE_RUN") == "1"
compile_run_only = pytest.mark.skipif(not COMPILING, reason="runs in its own pytest (test_tiles_in_a_compile_run)")
COMPILE_RUN = Command((sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__),
                      (("TE_MIXTRAL_COMPILE_RUN", "1"),), timeout=1800)
PLANNED_COMMANDS = [COMPILE_RUN]  # run from the session's start (conftest.py's planned_command)

KIB = 1024
# Shared memory a block may have, by compute capability.
MAX_SHARED = {80: 163 * KIB, 86: 99 * KIB, 89: 99 * KIB, 90: 227 * KIB}
NF4_MAX_SHARED = 99 * KIB  # the least of any GPU from sm_80 on (sm_86 and sm_89 alike)
EVERY_TILE = os.environ.get("TE_MIXTRAL_EVERY_TILE") == "1"
# The GPUs compiled for: sm_86 stands for sm_89 too (the module's docstring says why).
ARCHS = list(MAX_SHARED) if EVERY_TILE else [arch for arch in MAX_SHARED if arch != 89]
NF4_BYTES = 0.5  # an NF4 weight: two a byte (its scales, one a 64, left out)
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


def staged_bytes(gemm, cfg, a_bytes, b_bytes):
    """What a tile's software pipeline holds in shared memory, its stages times an A tile
    (BLOCK_M x BLOCK_I) and a B tile (BLOCK_I x BLOCK_N; two for gate_up, its gate and up
    columns): most of what the tile asks, and how the tiles of a table rank."""
    b_tiles = 2 if gemm == "gate_up" else 1
    return cfg["num_stages"] * cfg["BLOCK_I"] * (cfg["BLOCK_M"] * a_bytes + b_tiles * cfg["BLOCK_N"] * b_bytes)


def checked(found, a_bytes, b_bytes):
    """Of the distinct tiles `found` [(gemm, tile)] of a table family whose operands take
    `a_bytes` and `b_bytes` a value, those compiled: with TE_MIXTRAL_EVERY_TILE=1 all of them,
    the first being the one the suite compiles; else that one, the tile that stages the most
    (the first such in table order)."""
    heaviest = max(found, key=lambda gemm_cfg: staged_bytes(*gemm_cfg, a_bytes, b_bytes))
    return [heaviest, *(pick for pick in found if pick is not heaviest)] if EVERY_TILE else [heaviest]


def stack_frame(compiled) -> int:
    """The bytes of stack a thread of `compiled` takes, from its SASS: registers spilled
    (these kernels call nothing and keep no local arrays, so they have none otherwise)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def too_big(families, limit, arch, spills=False):
    """The launches of `families` [[(what, launcher, arguments)], ...] that ask more than
    `limit` bytes of shared memory a block compiled for sm_`arch`, each with what it asks, and
    with `spills` those that spill registers; where a family has more than one launch
    (TE_MIXTRAL_EVERY_TILE=1), also a family whose first launch (the suite's pick, `checked`)
    asks less than another."""
    target = GPUTarget("cuda", arch, 32)
    found = []
    for launches in families:
        compiled = {what: launcher(**arguments, target=target) for what, launcher, arguments in launches}
        asked = {what: kernel.metadata.shared for what, kernel in compiled.items()}
        found += [f"{what}: {shared / KIB:.1f} KiB" for what, shared in asked.items() if shared > limit]
        if spills:
            found += [f"{what}: {stack} bytes of stack a thread (spilled registers)"
                      for what, stack in ((what, stack_frame(kernel)) for what, kernel in compiled.items()) if stack]
        pick, most = next(iter(asked)), max(asked, key=asked.get)
        if asked[most] > asked[pick]:
            found.append(f"the suite compiles {pick} ({asked[pick] / KIB:.1f} KiB), but {most} asks "
                         f"{asked[most] / KIB:.1f}: staged_bytes no longer ranks this family's tiles")
    return found


@pytest.mark.skipif(COMPILING, reason="this is the launcher")
def test_tiles_in_a_compile_run(planned_command):
    assert_passed(planned_command(COMPILE_RUN)[0])


def test_the_nf4_table_covers_every_regime():
    assert NF4_CONFIGS.keys() == CONFIGS.keys()
    assert all(table.keys() == CONFIGS[name].keys() for name, table in NF4_CONFIGS.items())


@compile_run_only
@pytest.mark.parametrize("arch", ARCHS)
def test_the_nf4_tiles_fit_every_gpu_the_base_is_for(arch):
    """The tiles of NF4_CONFIGS for the four GEMMs that read the NF4 base, and the fp32
    path's one tile, within 99 KiB (`checked`: the heaviest of each). This failed before the
    kernels read each stored byte and scale once: their per-value loads of the scales and the
    code, staged by the software pipeline, took the BF16 tables' gate_up tile to 464 KiB (an
    H200 has 227)."""
    nf4 = FrozenNF4Weight((L, 2 * F, D)).operand(), FrozenNF4Weight((L, D, F)).operand()
    families = []
    for dtype, tables in ((torch.bfloat16, NF4_CONFIGS.values()), (torch.float32, [dict.fromkeys(CONFIGS["large"],
                                                                                                 FP32_TILE)])):
        gemms = row_gemms(dtype, *nf4)
        families.append([(f"{gemm} {dtype} {cfg}", rows_gemm, dict(gemms[gemm], cfg=cfg, use_tma=False))
                         for gemm, cfg in checked(distinct(tables, gemms), dtype.itemsize, NF4_BYTES)])
    big = too_big(families, NF4_MAX_SHARED, arch)
    assert not big, f"NF4 tiles on sm_{arch}, 99 KiB a block: {big}"


def bf16_families(tables, use_tma):
    """The BF16 tables' six GEMMs as two table families, the row GEMMs and the weight
    gradients, each its `checked` launches."""
    bf16 = functools.partial(torch.zeros, dtype=torch.bfloat16)
    rows, wgrads = row_gemms(torch.bfloat16, bf16(L, 2 * F, D), bf16(L, D, F)), wgrad_gemms(torch.bfloat16)
    return [[(f"{gemm} {cfg}", launcher, dict(gemms[gemm], cfg=cfg, use_tma=use_tma))
             for gemm, cfg in checked(distinct(tables, gemms), 2, 2)]
            for launcher, gemms in ((rows_gemm, rows), (wgrad_gemm, wgrads))]


@compile_run_only
@pytest.mark.parametrize("arch", [80, 90])
def test_the_bf16_tiles_fit_hopper_and_the_a100(arch):
    """The BF16 tables' six GEMMs (`checked`: the heaviest row GEMM and weight gradient),
    through TMA descriptors on Hopper (their shared memory is the pointer loads' to within a
    few bytes) and pointer loads on the A100; on Hopper also the FP8 base's tile, its forward
    and dgrad GEMM and its weight gradient."""
    families = bf16_families(CONFIGS.values(), use_tma=arch >= 90)
    if arch >= 90:
        bf16 = functools.partial(torch.zeros, dtype=torch.bfloat16)
        fp8 = functools.partial(torch.zeros, dtype=torch.float8_e4m3fn)
        scale = functools.partial(torch.ones, dtype=torch.float32)
        families += [
            [("fp8 rows", rows_gemm, dict(a_RI=fp8(R, D), w=fp8(L, F, D), counts_L=torch.zeros(L, dtype=torch.int64),
                                          out=bf16(R, F), n=F, b_icontig=True, cfg=_FP8_TILE, use_tma=True,
                                          scales=(scale(R), scale(L, F)), add=bf16(R, F)))],
            [("fp8 wgrad", wgrad_gemm, dict(g=fp8(D, R), x=fp8(F, R), counts_L=torch.zeros(L, dtype=torch.int64),
                                            out_LMN=bf16(L, D, F), cfg=_FP8_TILE, use_tma=True, k_major=True,
                                            scales=(scale(L * D), scale(L * F))))],
        ]
    big = too_big(families, MAX_SHARED[arch], arch)
    assert not big, f"BF16 and FP8 tiles on sm_{arch}, {MAX_SHARED[arch] // KIB} KiB a block: {big}"


@compile_run_only
@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch in (86, 89)])
def test_the_small_shared_bf16_tiles_fit_sm86_and_sm89_without_spilling(arch):
    """SMALL_SHARED_CONFIGS' six GEMMs (`checked`: the heaviest row GEMM and weight gradient;
    every tile with TE_MIXTRAL_EVERY_TILE=1) through pointer loads, within 99 KiB and with no
    register spilled. The BF16 tables themselves failed here, on sm_86 and sm_89 alike: 7 of
    their tiles asked 104-144 KiB and 11 spilled (every tile compiled)."""
    big = too_big(bf16_families(SMALL_SHARED_CONFIGS.values(), use_tma=False), MAX_SHARED[arch], arch, spills=True)
    assert not big, f"small-shared BF16 tiles on sm_{arch}, {MAX_SHARED[arch] // KIB} KiB a block: {big}"


def test_a_tile_that_stages_more_is_the_one_compiled():
    """Where a table gains a tile that stages more than the others (a deeper pipeline, a
    wider B tile), wherever it stands, the suite compiles that one."""
    nf4 = FrozenNF4Weight((L, 2 * F, D)).operand(), FrozenNF4Weight((L, D, F)).operand()
    found = distinct(NF4_CONFIGS.values(), row_gemms(torch.bfloat16, *nf4))
    gemm, heaviest = checked(found, 2, NF4_BYTES)[0]
    for bigger in (dict(heaviest, num_stages=heaviest["num_stages"] + 1), dict(heaviest, BLOCK_N=2 * heaviest["BLOCK_N"])):
        for where in (0, len(found) // 2, len(found)):
            assert checked([*found[:where], (gemm, bigger), *found[where:]], 2, NF4_BYTES)[0] == (gemm, bigger)
