"""The expert FFN as one autograd op: grouped gate_up GEMM -> SwiGLU -> grouped down GEMM.

Shape suffixes: see te_mixtral/__init__.py.

    h_R2F  = x_RD @ gate_up_L2FD[e].T            (per expert e, its rows only)
    act_RF = silu(h_R2F[:, :F]) * h_R2F[:, F:]
    y_RD   = act_RF @ down_LDF[e].T

Six grouped GEMMs run in all (kernels in `grouped_gemm.py` and `wgrad_gemm.py`):

    forward   1. h, act = swiglu(x @ gate_up.T)    SwiGLU fused into the epilogue
              2. y = act @ down.T
    backward  3. dh = swiglu'(dy @ down, h)       SwiGLU gradient fused into this dgrad's
                                                  epilogue; it also re-creates act
              4. d_down    = dy^T @ act           per expert, I = that expert's rows
              5. dx        = dh @ gate_up
              6. d_gate_up = dh^T @ x

What is kept for the backward, and why. Forward saves x and the pre-activations h (bf16,
2F per row) and frees act as soon as GEMM 2 has read it. The backward's SwiGLU-gradient
epilogue needs gate and up anyway; from them act is recomputed elementwise at the cost
of writing R x F values once more, and dh overwrites h in place (the tile that reads a
gate/up pair is the only one that writes it). The alternatives, measured at Mixtral-8x7B
shapes (docs/kernels.md; the figures are in docs/results/2026-11-21-kernel-notes.md):
  * keep only x and recompute h: saves R x 2F x 2 bytes but re-runs GEMM 1, about a fifth
    of the op at any row count. Not worth it: with h saved, the op's peak memory is already
    below grouped_mm's path with many rows per expert.
  * also keep act: spares GEMM 3's epilogue one R x F write, a few percent of the op at
    most, for R x F x 2 more bytes held. Memory wins.
Because dh reuses h's memory, calling backward twice through one forward raises.

Precision. Operands are multiplied in the activation dtype with fp32 accumulation; the
SwiGLU math runs in fp32 in registers. When the weights are fp32 masters and x is bf16
(torch.autocast), the weights are cast to bf16 once per forward and that copy is kept
for the backward: one extra read of 4 and write of 2 bytes per weight, and 2 bytes per
weight of memory until the backward. Weight gradients are written straight from the fp32
accumulators in the parameters' dtype, or added into the parameters' `.grad` where a
micro-batch's gradient is summed with the ones before it (`grad_accumulation.py`). fp32
inputs use `tf32x3` dots (about fp32 error).

No host synchronisation: split sizes are read only by the kernels (see grouped_gemm.py),
the grid and every allocation depend on shapes alone, so the op runs under
`torch.cuda.set_sync_debug_mode("error")` and inside CUDA graphs.

On a machine without a GPU, set TRITON_INTERPRET=1 before triton is first imported and
call `grouped_swiglu` on CPU tensors: Triton's interpreter runs the same kernels (exact
in fp32, not meaningful in bf16).
"""

from functools import partial

import torch
from torch.autograd.function import once_differentiable

from te_mixtral.experts.grouped_mm import grouped_matmul, grouped_wgrad, offsets
from te_mixtral.experts.kernels.grad_accumulation import accumulation_target, hand_over
from te_mixtral.experts.kernels.grouped_gemm import EPI_SWIGLU, EPI_SWIGLU_BWD, rows_gemm
from te_mixtral.experts.kernels.nf4_decode import dequantize
from te_mixtral.experts.kernels.nf4_operand import NF4Operand
from te_mixtral.experts.kernels.schedule import FP32_TILE, shared_memory_per_block, tile_config
from te_mixtral.experts.kernels.tma_host import tma_ok
from te_mixtral.experts.kernels.wgrad_gemm import wgrad_gemm

# Tile configurations by regime, chosen by the sweeps of benchmarks/custom_grouped_bench.py
# on an H100 (docs/results/2026-11-21-kernel-notes.md has the numbers); the large regime's
# dgrads and down projection since retimed on an H200 at training shapes (docs/kernels.md,
# v4). The regime comes from the mean rows per expert, R / L, which the host knows from
# shapes alone; the split stays on the device, where the kernels lay their tiles out from
# it and stream the reduction of a part-empty last round (TAIL_SPLIT, stream_k.py). The
# fields of a configuration are `schedule.tile_config`'s; FLATTEN pays where the epilogue is
# heavy, as the SwiGLU backward's: it reads two values per output and writes three.
#
# Weight gradients with few rows per expert write far more than they read: 128 x 128 tiles,
# two programs per SM, stored in two column blocks. On an H100 at 8 x 128 rows down_wgrad
# 0.539 -> 0.421 ms and gate_up_wgrad 1.046 -> 0.810 with streaming stores and this tile
# (cuBLAS 0.436 and 0.813); at 2 x 16 rows both tie cuBLAS (docs/kernels.md, v7). Their grid
# is the weight's M x N tiles, thousands at any row count, so they need no split: the rows
# are their reduction, one to eight steps here.
_WGRAD_FEW_ROWS = tile_config(128, 128, 64, 4, 3, progs=2, parts=2)


def _few_rows(bm: int) -> dict:
    """The table for up to `bm` rows per expert (16, 32 or 64), where the op is bound by
    reading the weights (docs/kernels.md, "The two numbers"): a row tile holds an expert's
    rows, so each GEMM streams each weight once, and the tensor cores do little work on
    rows past the expert's end (a 64-row tile over 16 rows does four times the work the
    rows need). The row GEMMs have few tiles, as few as 32 (one expert's down projection,
    128 columns each) for 132 SMs, so each streams its last round over all the programs
    (TAIL_SPLIT, stream_k.py): every SM reads weights until the GEMM ends. The weight
    gradients reduce over the rows in steps of bm, so that few rows take one step.

    The tile widths, warps and stages are those measured with 64-row tiles before
    (docs/kernels.md, v6-v9): gate_up 64 columns wide (two accumulators, gate and up); down
    and gate_up_dgrad, whose N is D, two programs per SM, which take an uneven split's extra
    row tiles in the same pass (on an H100, down at 179 + 77 rows 0.191 -> 0.147 ms);
    down_dgrad 128 wide. The 16- and 32-row tiles, and streaming gate_up and down_dgrad,
    are this table's own, timed against the tables before them by
    `benchmarks/custom_grouped_grid.py --tiles previous`. gate_up over 64 rows takes 8 warps:
    with 4, its streamed epilogue (two accumulators summed) spilled, compiled by Triton 3.6
    for sm_90 (255 registers and 24 bytes of stack a thread at four experts; 176 and none
    with 8)."""
    rows_n_is_d = tile_config(bm, 128, 64, 4, 4, progs=2, tail_split=4)
    wgrad = dict(_WGRAD_FEW_ROWS, BLOCK_I=bm)
    return {
        "gate_up": tile_config(bm, 64, 128, 8 if bm == 64 else 4, 4, parts=2, tail_split=4),
        "down": rows_n_is_d,
        "down_dgrad": tile_config(bm, 128, 64, 4, 4, tail_split=4),
        "down_wgrad": wgrad,
        "gate_up_dgrad": rows_n_is_d,
        "gate_up_wgrad": wgrad,
    }


FEW_ROWS_BLOCKS = (16, 32, 64)  # the row tiles of the few-rows tables, by rows per expert
CONFIGS = {f"few rows, {bm}": _few_rows(bm) for bm in FEW_ROWS_BLOCKS}
# 65-128 rows over two or three experts: two 64-row tiles an expert, with the tiles the op
# ran there before the few-rows tables (none streamed, gate_up at 4 warps, down_dgrad 64
# columns wide at two programs an SM). At 128 rows over two experts the few-rows table of 64
# rows took a fifth to a quarter more GPU time than these on an H200, in both families; at
# one expert the two were level, so one expert keeps the few-rows table (docs/kernels.md,
# "Few rows per expert").
_TWO_ROW_TILES_N_IS_D = tile_config(64, 128, 64, 4, 4, progs=2)
CONFIGS["two row tiles"] = {
    "gate_up": tile_config(64, 64, 128, 4, 4, parts=2), "down": _TWO_ROW_TILES_N_IS_D,
    "down_dgrad": tile_config(64, 64, 64, 4, 4, progs=2, parts=2), "down_wgrad": _WGRAD_FEW_ROWS,
    "gate_up_dgrad": _TWO_ROW_TILES_N_IS_D, "gate_up_wgrad": _WGRAD_FEW_ROWS,
}
CONFIGS |= {
    "medium": {  # <= 512 rows per expert
        "gate_up": tile_config(128, 128, 64, 8, 4),
        "down": tile_config(128, 128, 64, 8, 3, progs=2),
        "down_dgrad": tile_config(128, 128, 64, 8, 4),
        "down_wgrad": _WGRAD_FEW_ROWS,
        "gate_up_dgrad": tile_config(128, 256, 64, 8, 3),
        "gate_up_wgrad": _WGRAD_FEW_ROWS,
    },
    "large": {
        "gate_up": tile_config(128, 128, 64, 8, 4, group=16),
        "down": tile_config(128, 256, 64, 8, 4, group=16),
        "down_dgrad": tile_config(128, 256, 64, 8, 3, group=16, flatten=True),
        # Stored in two parts: the fastest down_wgrad tile of benchmarks/custom_grouped_gemms.py's
        # sweep at 8 x 2048 rows, an uneven 16384 and 4 x 4096 + 16 x 1024 on an H200 (2.5-3.2 %).
        "down_wgrad": tile_config(128, 256, 64, 8, 3, group=16, parts=2),
        "gate_up_dgrad": tile_config(128, 256, 64, 8, 3, flatten=True),
        "gate_up_wgrad": tile_config(128, 256, 64, 8, 3, group=16, parts=1),
    },
}
# At up to 512 rows in all, the medium table's 128x256 gate_up_dgrad tiles give at most 64
# programs; 128x128 tiles double that, and down gains from the same tile at one program per
# SM. On an H100 at 1 x 256 rows: gate_up_dgrad 0.267 -> 0.181 ms, down 0.119 -> 0.097
# (cuBLAS 0.105 and 0.064). At 2 x 512 rows (128 programs) the medium table wins again.
# down_dgrad also runs faster as 128 x 128 tiles of 4 warps, two programs per SM: per GEMM
# on an H100, 2 x 256 rows 0.173 -> 0.142 ms, 4 x 128 0.229 -> 0.203, 1 x 512 0.153 -> 0.128
# (docs/kernels.md, v9); with more rows the medium table's tile wins.
# down and gate_up_dgrad here make 128 tiles at 2 x 256 rows, one round of an H100's 132
# SMs; one expert, or an uneven split, leaves a round part-empty (1 x 256: 64 tiles; 358 +
# 154 rows: 160 tiles, two rounds), so they split the tiles of the last round (TAIL_SPLIT).
# Fwd+bwd GPU ms on an H100 at 8x7B shapes, with that round split in equal shares, before
# stream-K: 1 x 256 rows 0.698 -> 0.624, 358 + 154 1.565 -> 1.438, 170 + 171 + 171 + 0 1.906
# -> 1.805; where nothing split, level to 3.5 % slower (8x22B at 358 + 154), and in the other
# tables it lost as often as it gained (docs/kernels.md, v11), because the split path took
# registers even where nothing split (171 -> 250): gate_up and down_dgrad, whose 128 x 128
# accumulators leave no registers to spare, do not stream here.
_SPLIT_TAIL_MEDIUM = tile_config(128, 128, 64, 8, 4, tail_split=4)
CONFIGS["medium, few rows"] = {**CONFIGS["medium"], "down": _SPLIT_TAIL_MEDIUM,
                               "gate_up_dgrad": _SPLIT_TAIL_MEDIUM,
                               "down_dgrad": tile_config(128, 128, 64, 4, 3, progs=2)}

# An NF4 base (nf4_operand.py): the tables above, but where a tile cannot afford the B tile
# it dequantises in registers (a float32 value per weight until the dot) or its shared
# memory. Compiled for sm_80, sm_89 and sm_90, the BF16 tables' 128 x 256 tiles, the 4-warp
# 128 x 128 one, gate_up's two 128 x 64 B tiles and the 4-warp tiles of 64 rows (32 for
# gate_up) spilled registers (their SASS, compiled as tests/experts/test_kernel_resources.py
# compiles them): they take 128 x 128 tiles of 8 warps, gate_up stepping 32 deep, and 8 warps
# for the few rows. The few-rows gate_up over 64 rows takes 3 stages, and nothing flattens
# (pipelining across tiles stages more in shared memory), so that every tile fits 99 KiB of
# shared memory a block, the least of any GPU from sm_80 on (sm_86, sm_89), on sm_80, sm_89
# and sm_90 alike (that test checks it). Chosen by compiling; not yet timed.
_NF4_128 = tile_config(128, 128, 64, 8, 4)
_NF4_GATE_UP = tile_config(128, 128, 32, 8, 4)
_FEW_32, _FEW_64 = CONFIGS["few rows, 32"], CONFIGS["few rows, 64"]
NF4_CONFIGS = {
    "few rows, 16": CONFIGS["few rows, 16"],
    "few rows, 32": {**_FEW_32, "gate_up": dict(_FEW_32["gate_up"], num_warps=8)},
    "few rows, 64": {**_FEW_64, "gate_up": dict(_FEW_64["gate_up"], num_stages=3),
                     **{gemm: dict(_FEW_64[gemm], num_warps=8) for gemm in ("down", "down_dgrad", "gate_up_dgrad")}},
    "medium": {**CONFIGS["medium"], "gate_up": _NF4_GATE_UP, "gate_up_dgrad": _NF4_128},
    "medium, few rows": {**CONFIGS["medium, few rows"], "gate_up": _NF4_GATE_UP, "down_dgrad": _NF4_128},
    "large": {**CONFIGS["large"], "gate_up": tile_config(128, 128, 32, 8, 4, group=16),
              "down": tile_config(128, 128, 64, 8, 4, group=16),
              "down_dgrad": tile_config(128, 128, 64, 8, 4, group=16), "gate_up_dgrad": _NF4_128},
}
NF4_CONFIGS["two row tiles"] = NF4_CONFIGS["few rows, 64"]  # the BF16 table's 4-warp 64-row tiles spill over NF4


# The most shared memory a block of the BF16 tables' tiles asks: they fit the A100's 163 KiB
# and Hopper's 227 (tests/experts/test_kernel_resources.py compiles them for both), not the
# 99 KiB of sm_86 and sm_89 (L40S, RTX 4090, RTX 6000 Ada), which get SMALL_SHARED_CONFIGS.
BF16_TABLES_SHARED = 163 * 1024


def _within_99_kib(gemm: str, cfg: dict) -> dict:
    """`cfg` cut to fit a GPU whose blocks get 99 KiB of shared memory (sm_86, sm_89): its
    accumulators at most 128 x 128 values (gate_up holds two, gate and up: 128 x 64), at most
    64 of them a thread (8 warps for 128 x 128), steps at most 64 deep, one program an SM.

    Compiled for sm_86 and sm_89 (Triton 3.9, as tests/experts/test_kernel_resources.py
    compiles them), the BF16 tables asked up to 144 KiB there: gate_up 108-144 (two B tiles,
    steps 128 deep over few rows) and the 128 x 256 tiles at 4 stages or flattened 104-144;
    and their 128 x 256 tiles, gate_up's two 128 x 128 accumulators, its 128-deep steps over
    64 rows and the 4-warp 128 x 128 tiles of down_dgrad and (64 deep) the weight gradients
    spilled registers. Cut this way, every tile asks at most 96 KiB and none spills.

    The stages stay: on these GPUs Triton's software pipeline holds num_stages - 1 steps of
    the A and B tiles, so a 128 x 128 tile 64 deep takes 96 KiB at the tables' 4 stages. Two
    programs an SM would need half its 100 KiB each (4-warp tiles here ask 54-72) or, at 8
    warps, more registers than it has."""
    accumulators = 2 if gemm == "gate_up" else 1
    bn = min(cfg["BLOCK_N"], 128 * 128 // (cfg["BLOCK_M"] * accumulators))
    warps = max(cfg["num_warps"], cfg["BLOCK_M"] * bn * accumulators // (64 * 32))
    return dict(cfg, BLOCK_N=bn, BLOCK_I=min(cfg["BLOCK_I"], 64), num_warps=warps, PROGS_PER_SM=1)


# The BF16 tables for GPUs whose blocks get less shared memory than CONFIGS asks (sm_86,
# sm_89), each tile cut from CONFIGS'. Chosen by compiling; not yet timed on such a GPU.
SMALL_SHARED_CONFIGS = {name: {gemm: _within_99_kib(gemm, cfg) for gemm, cfg in table.items()}
                        for name, table in CONFIGS.items()}


def bf16_configs(device: torch.device) -> dict:
    """The BF16 tables for `device`: CONFIGS, or where a block gets less shared memory than
    they ask (sm_86, sm_89) SMALL_SHARED_CONFIGS. The interpreter has no limit."""
    fits = device.type != "cuda" or shared_memory_per_block(device.index or 0) >= BF16_TABLES_SHARED
    return CONFIGS if fits else SMALL_SHARED_CONFIGS


def uses_descriptors(rows: int, experts: int) -> bool:
    """Whether the GEMMs load through TMA descriptors (else plain pointer loads): from 97
    rows per expert and 513 rows in all. Each TMA launch encodes its descriptors on the
    host, 0.15-0.6 ms a fwd+bwd, and with little GPU work per call that host time is what a
    call costs; below these sizes pointer loads keep the GPU about as fast, or faster.
    Fwd+bwd GPU ms at 8x7B shapes (docs/kernels.md), TMA against pointers: on an H100 8 x 16
    rows 3.53 against 3.15, 8 x 96 4.07 against 3.69, 2 x 256 1.24 against 1.24; on an H200
    8 x 96 3.44 against 3.13, and 8 x 128 3.05 against 3.20 (where TMA takes over; 3.76
    against 3.77 on the H100). Pointers lost at 1 x 16 (0.52 against 0.60 on the H100) and by
    3-5 % from 128 to 512 rows on the H200, where the host time they save is larger. These
    figures predate masked row loads (docs/kernels.md, v10), which made the pointer path
    faster wherever a row tile runs past the last row: 1 x 16 took 0.434 ms after."""
    return rows > 512 and rows > 96 * max(experts, 1)


def regime(rows: int, experts: int) -> str:
    """The tile table for `rows` over `experts` local experts. Up to 64 rows per expert, or
    128 with one expert, a few-rows table whose row tile holds the mean rows per expert (16,
    32 or 64); 65-128 with two or three experts, 64-row tiles without streaming ("two row
    tiles", whose comment says why); then the medium tiles (128 rows), which from four
    experts on beat 64-row ones from 65 rows per expert, and with fewer experts only from
    129. On an H100, fwd+bwd GPU ms at 8x7B shapes: 8 x 96 rows 3.68 against 3.99, 8 x 128
    3.80 against 4.06; 1 x 128 0.57 with 64-row tiles against 0.76."""
    per_expert = rows / max(experts, 1)
    if per_expert <= 64 or (per_expert <= 128 and experts <= 1):
        return f"few rows, {next((bm for bm in FEW_ROWS_BLOCKS if per_expert <= bm), 64)}"
    if per_expert <= 128 and experts < 4:
        return "two row tiles"
    if per_expert <= 512:
        return "medium, few rows" if rows <= 512 else "medium"
    return "large"


# fp32 inputs (no autocast): the correctness path's one tile for every GEMM.
FP32_CONFIGS = {name: dict.fromkeys(table, FP32_TILE) for name, table in CONFIGS.items()}


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, counts_L, gate_up_L2FD, down_LDF, configs, use_tma, keep_hidden, h_add_R2F, a_down_LrF,
                h_add_factors, whole):
        R, D = x_RD.shape
        L, F = down_LDF.shape[0], down_LDF.shape[2]
        dtype = x_RD.dtype
        w1_L2FD, w2_LDF = _operand(gate_up_L2FD, dtype), _operand(down_LDF, dtype)
        b = partial(_gemm_operand, dtype=dtype, whole=whole)
        x_RD = x_RD.contiguous()
        h_R2F = x_RD.new_empty(R, 2 * F)
        act_RF = x_RD.new_empty(R, F)
        y_RD = x_RD.new_empty(R, D)
        cfgs = configs[regime(R, L)]
        if use_tma is None:
            use_tma = uses_descriptors(R, L) and tma_ok(x_RD, h_R2F, *_dense_layouts(x_RD, (w1_L2FD, w2_LDF), whole))
        if R > 0:
            rows_gemm(x_RD, b(w1_L2FD), counts_L, act_RF, n=F, b_icontig=True, cfg=cfgs["gate_up"], use_tma=use_tma,
                      epilogue=EPI_SWIGLU, h=h_R2F, add=None if h_add_R2F is None else h_add_R2F.contiguous())
            rows_gemm(act_RF, b(w2_LDF), counts_L, y_RD, n=D, b_icontig=True,
                      cfg=cfgs["down"], use_tma=use_tma)
        outputs = (y_RD,)
        if a_down_LrF is not None:  # LoRA's down adapter reads act, which only lives in here
            outputs += (grouped_matmul(act_RF, a_down_LrF, offsets(counts_L)),)
        if keep_hidden:
            _save(ctx, x_RD, counts_L, h_R2F, w1_L2FD, w2_LDF, a_down_LrF)
        else:  # the weights as they came: a cast copy is made again in the backward
            t_Rr, b_L2Fr, _ = h_add_factors or (None, None, None)
            _save(ctx, x_RD, counts_L, gate_up_L2FD, down_LDF, a_down_LrF, t_Rr, b_L2Fr)
            ctx.h_add_scale = h_add_factors and h_add_factors[2]
        ctx.cfgs, ctx.use_tma, ctx.h_consumed, ctx.keep_hidden, ctx.whole = cfgs, use_tma, False, keep_hidden, whole
        ctx.weights = (gate_up_L2FD, down_LDF)  # the parameters, whose .grad the backward may add into
        return outputs if len(outputs) > 1 else y_RD

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_RD, du_Rr=None):
        if ctx.h_consumed:
            raise RuntimeError(
                "custom_grouped: backward ran twice through one forward; the saved "
                "pre-activations were overwritten by the first (retain_graph is unsupported)"
            )
        ctx.h_consumed = ctx.keep_hidden
        cfgs, use_tma = ctx.cfgs, ctx.use_tma
        if ctx.keep_hidden:
            x_RD, counts_L, h_R2F, w1_L2FD, w2_LDF, a_down_LrF = _saved(ctx)
        else:
            x_RD, counts_L, gate_up_L2FD, down_LDF, a_down_LrF, t_Rr, b_L2Fr = _saved(ctx)
            w1_L2FD, w2_LDF = _operand(gate_up_L2FD, x_RD.dtype), _operand(down_LDF, x_RD.dtype)
        b = partial(_gemm_operand, dtype=x_RD.dtype, whole=ctx.whole)
        if not ctx.keep_hidden:  # recompute the pre-activations: the gate_up GEMM again, not the down one
            h_R2F = x_RD.new_empty(x_RD.shape[0], w1_L2FD.shape[1])
            # The gate_up adapter's delta, made again as the caller made it (same GEMM, same bits).
            h_add_R2F = None if t_Rr is None else grouped_matmul(t_Rr, b_L2Fr, offsets(counts_L)) * ctx.h_add_scale
            if x_RD.shape[0] > 0:
                rows_gemm(x_RD, b(w1_L2FD), counts_L, x_RD.new_empty(x_RD.shape[0], w2_LDF.shape[2]),
                          n=w2_LDF.shape[2], b_icontig=True, cfg=cfgs["gate_up"], use_tma=use_tma,
                          epilogue=EPI_SWIGLU, h=h_R2F, add=None if h_add_R2F is None else h_add_R2F.contiguous())
            del h_add_R2F
        R, D = x_RD.shape
        F = w2_LDF.shape[2]
        needs_x, _, needs_w1, needs_w2 = ctx.needs_input_grad[:4]
        dy_RD = dy_RD.to(x_RD.dtype).contiguous()
        # LoRA's down adapter: its share of d(act) joins the SwiGLU gradient's epilogue.
        lora_down = a_down_LrF is not None and du_Rr is not None
        offs_L = offsets(counts_L) if lora_down else None
        d_act_add = grouped_matmul(du_Rr.to(x_RD.dtype), a_down_LrF.transpose(1, 2), offs_L) if lora_down else None
        # Each weight gradient is added into its weight's .grad where that is safe
        # (grad_accumulation.py), else written to a new tensor in the weight's dtype. A frozen
        # weight (LoRA's base) gets none, and its GEMM does not run.
        into = [accumulation_target(w) if needs else None for w, needs in zip(ctx.weights, (needs_w1, needs_w2))]
        d_w1, d_w2 = (torch.empty(w.shape, dtype=w.dtype, device=w.device) if t is None and needs else t
                      for w, t, needs in zip(ctx.weights, into, (needs_w1, needs_w2)))
        dx_RD = torch.empty_like(x_RD) if needs_x else None
        d_a_down = None
        if R > 0:
            # 3: dh overwrites h; act comes back for 4 (and the down adapter's A), then is freed.
            act_RF = x_RD.new_empty(R, F) if needs_w2 or lora_down else None
            rows_gemm(dy_RD, b(w2_LDF), counts_L, act_RF, n=F, b_icontig=False,
                      cfg=cfgs["down_dgrad"], use_tma=use_tma, epilogue=EPI_SWIGLU_BWD, h=h_R2F, add=d_act_add)
            dh_R2F = h_R2F
            if needs_w2:
                wgrad_gemm(dy_RD, act_RF, counts_L, d_w2, cfg=cfgs["down_wgrad"], use_tma=use_tma,
                           accumulate=into[1] is not None)
            if lora_down:
                d_a_down = grouped_wgrad(du_Rr.to(x_RD.dtype), act_RF, offs_L)
            del act_RF
            if needs_x:
                rows_gemm(dh_R2F, b(w1_L2FD), counts_L, dx_RD, n=D, b_icontig=False,
                          cfg=cfgs["gate_up_dgrad"], use_tma=use_tma)
            if needs_w1:
                wgrad_gemm(dh_R2F, x_RD, counts_L, d_w1, cfg=cfgs["gate_up_wgrad"], use_tma=use_tma,
                           accumulate=into[0] is not None)
        else:  # no rows: zero gradients, or .grad as it was
            dh_R2F = h_R2F
            if needs_x:
                dx_RD.zero_()
            for d, t in zip((d_w1, d_w2), into):
                if d is not None and t is None:
                    d.zero_()
            if lora_down:
                d_a_down = torch.zeros_like(a_down_LrF)
        d_w1, d_w2 = (d if t is None else hand_over(w, d) for w, d, t in zip(ctx.weights, (d_w1, d_w2), into))
        d_h_add = dh_R2F if ctx.needs_input_grad[7] else None
        return dx_RD, None, d_w1, d_w2, None, None, None, d_h_add, d_a_down, None, None


def _operand(w, dtype):
    """What the op holds of a weight: a tensor cast to the rows' dtype, or a frozen
    quantised weight's own operand (an NF4 base: kernels/nf4_operand.py), which takes no gradient."""
    return w.to(dtype).contiguous() if isinstance(w, torch.Tensor) else w.operand()


def _gemm_operand(w, dtype, whole):
    """What one GEMM reads of `_operand`'s result: itself, or with `whole` an NF4 operand
    decoded whole into a copy in `dtype` (nf4_decode.py). Called in the GEMM's argument list,
    so the copy is dropped once that GEMM is launched: one lives at a time, and none is saved."""
    return dequantize(w, dtype) if whole and isinstance(w, NF4Operand) else w


def _dense_layouts(x_RD, weights, whole):
    """The weights as the GEMMs will read them, for `tma_ok`: the tensors, and where NF4 is
    decoded whole an empty stand-in laid out as its copy will be (NF4 tiles load without TMA)."""
    return [w if isinstance(w, torch.Tensor) else x_RD.new_empty(0, w.shape[2])
            for w in weights if whole or isinstance(w, torch.Tensor)]


def _save(ctx, *items):
    """save_for_backward for the tensors among `items`; the rest (frozen weights) kept as they are."""
    ctx.save_for_backward(*(t if t is None or isinstance(t, torch.Tensor) else None for t in items))
    ctx.not_tensors = [None if t is None or isinstance(t, torch.Tensor) else t for t in items]


def _saved(ctx):
    return [t if other is None else other for t, other in zip(ctx.saved_tensors, ctx.not_tensors)]


def grouped_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, *, configs=None,
                   use_tma=None, keep_hidden=True, h_add_R2F=None, a_down_LrF=None, h_add_factors=None,
                   dequantize_whole=False):
    """y_RD of the expert FFN through the Triton kernels; differentiable in x and weights.

    `configs` overrides the tile table (the benchmark's sweep and the interpreter tests use
    it; by default `bf16_configs`' for the device, NF4_CONFIGS over an NF4 base decoded tile
    by tile, or FP32_CONFIGS for fp32 inputs);
    `use_tma` forces the descriptor path on or off (default: `uses_descriptors`, where the
    tensors allow it).
    `keep_hidden=False` is selective recompute done inside the op: the forward keeps only
    its inputs, and the backward runs the gate_up GEMM again for the pre-activations. That
    is cheaper than recomputing the whole op (torch's checkpoint), which would run the down
    projection too, whose output the backward does not need.

    Either weight may be a frozen quantised one with an `operand()` (an NF4 LoRA base,
    te_mixtral/experts/quant/frozen_nf4.py), which gets no gradient: the kernels dequantise
    its tiles as they read them, or with `dequantize_whole` one kernel decodes it whole into
    a transient copy in x's dtype before each GEMM that reads it, which the BF16 tables then
    multiply (nf4_decode.py says when each pays; the tier picks, custom_grouped.py).

    LoRA (te_mixtral/experts/adapters.py): `h_add_R2F`, the gate_up adapter's delta, is added
    to the pre-activations in the first GEMM's epilogue (its gradient is dh). `a_down_LrF`,
    the down adapter's A in x's dtype, makes the op return (y_RD, u_Rr) with u = act @ A[e].T
    per expert: the caller adds its B product to y, and act, which the adapter's gradient
    needs, is re-created in the backward's SwiGLU epilogue rather than kept. With
    `keep_hidden=False` the recompute needs h_add again without keeping it: `h_add_factors`
    (t_Rr, B_L2Fr, s), with h_add = s * t @ B[e].T per expert exactly as the caller made it
    (`adapters.with_fused_adapters`), are kept instead, rank-r small, and the delta is made
    again from them; its gradient still leaves as h_add's.
    """
    nf4 = not all(isinstance(w, torch.Tensor) for w in (gate_up_L2FD, down_LDF))
    whole = nf4 and dequantize_whole
    if configs is None:
        configs = (FP32_CONFIGS if x_RD.dtype == torch.float32 else NF4_CONFIGS if nf4 and not whole
                   else bf16_configs(x_RD.device))
    if not keep_hidden and h_add_R2F is not None and h_add_factors is None:
        raise ValueError("grouped_swiglu's recompute makes the gate_up adapter's delta again: pass h_add_factors")
    if keep_hidden or h_add_R2F is None:
        h_add_factors = None
    return _GroupedSwiGLU.apply(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF,
                                configs, use_tma, keep_hidden, h_add_R2F, a_down_LrF, h_add_factors, whole)
