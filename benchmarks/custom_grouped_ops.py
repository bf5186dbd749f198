"""The custom_grouped op's pieces that its benchmarks share: inputs, the six GEMMs, tile candidates, timing.

Shape letters as in te_mixtral/__init__.py (L local experts, R rows, D model dim, F
expert hidden dim); `per_expert` is the rows (tokens) each expert gets, R = per_expert * L.

- `make_inputs`, `parse_case`, `parse_cases`, `fwd_bwd`, `with_table`: the op's inputs for a case (`LxR`
  or `R0+R1+...`), one forward + backward of it, the op with one tile table everywhere (or
  "previous": the tables as they were before the few-rows ones, chosen as they were);
- `op_bytes`, `op_flops`: what one forward + backward moves and computes, the numerators
  of its two floors (docs/kernels.md, "The two numbers"), the sums of each GEMM's
  (`gemm_bytes`, `gemm_flops`);
- `OPS`, `FLOP_UNITS`, `gemm_operands`, `gemm_call`, `GEMM_OUTPUTS`, `op_runner`: each of
  its six GEMMs alone, on operands of its own; `CANDIDATES`, `candidates`, `precompile`: the
  tile configs a sweep tries per regime, compiled in a pool;
- `bench` (Triton's `do_bench`, L2 flushed), `gpu_ms` (GPU time with the host queued
  ahead) and `step_ms` (calls back to back, host time included): the ways these benchmarks
  time one op, each saying why it is not benchmarks/common.py's timer.
"""

import json
import multiprocessing
import os
import time

import torch
from triton.testing import do_bench

from te_mixtral.experts.kernels import grouped_gemm as gg
from te_mixtral.experts.kernels import grouped_swiglu as gs
from te_mixtral.experts.kernels.schedule import tile_config
from te_mixtral.experts.kernels.wgrad_gemm import wgrad_gemm

OPS = ("gate_up", "down", "down_dgrad", "down_wgrad", "gate_up_dgrad", "gate_up_wgrad")
FLOP_UNITS = {"gate_up": 4, "down": 2, "down_dgrad": 2, "down_wgrad": 2,
              "gate_up_dgrad": 4, "gate_up_wgrad": 4}  # times R·D·F
DEVICE = "cuda"
GPU_CALLS = 50
SPIN_CYCLES = int(2e9)  # about a second: longer than the host needs to queue GPU_CALLS calls


# Tile configs are built as the kernels build their own table (grouped_swiglu.CONFIGS), so a
# sweep's winners paste into it unchanged.
cfg = tile_config

# Candidates by regime; a GEMM's own list wins over its kind's. PROGS_PER_SM=2 keeps two
# programs on an SM where registers (<= 255 x 128 threads each) and shared memory
# (<= 113 KB each) allow, so one program's epilogue overlaps the other's main loop;
# GROUP_M=16 halves how often a large rows-GEMM streams the weights from DRAM.
PINGPONG = cfg(128, 128, 64, 4, 3, progs=2)
# A weight gradient's EPI_PARTS is how many column blocks its store walks. With few rows a
# weight gradient's tile is one to a few reduction steps and a store: bound by writing, with
# as many tiles in flight as an SM holds programs. The table's 128 x 128 tile of 4 warps
# holds two (222 registers a thread and 96 KiB, compiled for sm_90 by Triton 3.9): 8 warps
# an SM. The last two hold three and four (165-168 and 117-126 registers, 48 and 32 KiB).
WGRAD_FEW_ROWS = [cfg(128, 128, 64, 4, 3, progs=2, parts=2), cfg(128, 128, 64, 4, 3, progs=2, parts=1),
                  cfg(128, 256, 64, 8, 3, parts=2), cfg(64, 256, 64, 4, 2, progs=2, parts=2),
                  cfg(64, 128, 64, 4, 2, progs=3, parts=2), cfg(64, 64, 64, 4, 2, progs=4, parts=1)]


def few_rows_candidates(bm):
    """Row-GEMM tiles for at most `bm` rows per expert, each streaming its last round of
    tiles (TAIL_SPLIT: te_mixtral/experts/kernels/stream_k.py), at most 4 or 8 programs a tile."""
    return [cfg(bm, 128, 64, 4, 4, progs=2, tail_split=4), cfg(bm, 64, 128, 4, 4, tail_split=4),
            cfg(bm, 128, 128, 4, 3, tail_split=8), cfg(bm, 256, 64, 4, 3, tail_split=4),
            cfg(bm, 64, 64, 4, 6, progs=2, tail_split=8)]


CANDIDATES = {
    **{f"few rows, {bm}": {
        "rows": few_rows_candidates(bm),
        "gate_up": [cfg(bm, 64, 128, 4, 4, parts=2, tail_split=4), cfg(bm, 64, 128, 8, 4, parts=2, tail_split=4),
                    cfg(bm, 64, 64, 4, 6, parts=2, tail_split=4), cfg(bm, 128, 64, 4, 4, parts=2, tail_split=4),
                    cfg(bm, 64, 128, 4, 4, parts=2)],
        "wgrad": [dict(c, BLOCK_I=bm) for c in WGRAD_FEW_ROWS],
    } for bm in gs.FEW_ROWS_BLOCKS},
    "medium": {
        "rows": [cfg(128, 128, 64, 8, 4), cfg(128, 256, 64, 8, 3), PINGPONG,
                 cfg(128, 128, 64, 8, 3, progs=2)],
        "gate_up": [cfg(128, 128, 64, 8, 4), cfg(128, 64, 64, 4, 3, progs=2),
                    cfg(128, 128, 64, 8, 4, parts=2)],
        "wgrad": WGRAD_FEW_ROWS,
    },
    # Many rows per expert (one GPU's 8 experts x 2048 rows, EP=2's 4 x 4096): the tensor cores
    # bound every GEMM, so these are the large tiles Hopper's 227 KiB of shared memory a block
    # holds: 128 x 256 and 256 x 128 outputs of 8 warps and 256 x 256 of 16, 3 to 5 stages 64
    # deep or 2 stages 128 deep (each at most 192 KiB), the row tiles walked 8, 16 or 32 at a
    # time. gate_up holds two accumulators (gate and up), so its BLOCK_N is half the others'.
    "large": {
        "rows": [cfg(128, 256, 64, 8, 3), cfg(128, 256, 64, 8, 4), cfg(256, 128, 64, 8, 3), PINGPONG,
                 cfg(128, 256, 64, 8, 3, group=16), cfg(256, 128, 64, 8, 3, group=16),
                 cfg(128, 256, 64, 8, 4, group=16), cfg(256, 128, 64, 8, 4, group=16),
                 cfg(128, 256, 64, 8, 4, group=32), cfg(128, 256, 64, 8, 3, flatten=True),
                 cfg(128, 256, 64, 8, 3, group=16, flatten=True), cfg(128, 256, 128, 8, 2, group=16),
                 cfg(128, 128, 64, 8, 5, group=16), cfg(128, 128, 64, 8, 3, progs=2, group=16),
                 cfg(256, 256, 64, 16, 3, group=16)],
        "gate_up": [cfg(128, 128, 64, 8, 4), cfg(128, 64, 64, 4, 3, progs=2),
                    cfg(128, 128, 64, 8, 4, group=16), cfg(128, 128, 64, 8, 4, parts=2),
                    cfg(128, 128, 64, 8, 3, group=16), cfg(128, 128, 64, 8, 4, group=32),
                    cfg(128, 128, 64, 8, 3, group=16, flatten=True), cfg(256, 64, 64, 8, 4, group=16),
                    cfg(128, 128, 128, 8, 2, group=16), cfg(256, 128, 64, 16, 3, group=16)],
        "down_dgrad": [cfg(128, 128, 64, 8, 4), cfg(128, 256, 64, 8, 3), PINGPONG,
                       cfg(128, 128, 64, 8, 4, group=16), cfg(128, 256, 64, 8, 3, group=16),
                       cfg(128, 256, 64, 8, 3, group=16, flatten=True),
                       cfg(128, 256, 64, 8, 4, group=16, flatten=True),
                       cfg(128, 256, 64, 8, 3, group=16, flatten=True, parts=2),
                       cfg(128, 128, 64, 8, 4, group=16, flatten=True),
                       cfg(256, 128, 64, 8, 3, group=16, flatten=True), cfg(128, 128, 64, 8, 3, progs=2, group=16)],
        "wgrad": [cfg(128, 256, 64, 8, 3, parts=1), cfg(128, 256, 64, 8, 3, parts=2),
                  cfg(128, 256, 64, 8, 3, group=16, parts=1), cfg(128, 256, 64, 8, 3, group=16, parts=2),
                  cfg(128, 256, 64, 8, 4, group=16, parts=1), cfg(256, 128, 64, 8, 3, group=16, parts=1),
                  cfg(256, 128, 64, 8, 4, group=16, parts=1), cfg(128, 256, 128, 8, 2, group=16, parts=1),
                  cfg(128, 128, 64, 8, 4, group=16, parts=1), cfg(128, 128, 64, 8, 3, progs=2, group=16, parts=1),
                  WGRAD_FEW_ROWS[0], cfg(256, 256, 64, 16, 3, group=16, parts=2)],
    },
}
CANDIDATES["medium, few rows"] = CANDIDATES["medium"]
CANDIDATES["two row tiles"] = CANDIDATES["few rows, 64"]


# The tables that the few-rows ones replaced, and their choice by size, kept to time the op
# before and after in one run (`with_table("previous")`). Their TAIL_SPLIT ran the last
# round's tiles in equal shares then, and streams them now (stream_k.py); otherwise the same
# kernels. Delete once the few-rows tables' results page stands.
_PREVIOUS_SMALL = gs.CONFIGS["two row tiles"]  # which the op runs again at 65-128 rows over 2-3 experts
_PREVIOUS_SPLIT = cfg(64, 128, 64, 4, 4, tail_split=4)
PREVIOUS = {
    "small": _PREVIOUS_SMALL,
    "small, 1 expert": {**_PREVIOUS_SMALL, "down": cfg(64, 32, 256, 4, 4), "gate_up_dgrad": cfg(64, 32, 256, 4, 4)},
    "split-K": {**_PREVIOUS_SMALL, "down": _PREVIOUS_SPLIT, "gate_up_dgrad": _PREVIOUS_SPLIT,
                "down_dgrad": cfg(64, 128, 64, 4, 4)},
    **{name: gs.CONFIGS[name] for name in ("medium, few rows", "medium", "large")},
}


def previous_regime(rows: int, experts: int) -> str:
    """The table of PREVIOUS that the op chose for `rows` over `experts` local experts."""
    per_expert = rows / max(experts, 1)
    if per_expert <= 32 and experts <= 2:
        return "split-K"
    if per_expert <= 64 or (per_expert <= 128 and experts < 4):
        return "small, 1 expert" if experts == 1 else "small"
    if per_expert <= 512:
        return "medium, few rows" if rows <= 512 else "medium"
    return "large"


TABLE_NAMES = (*gs.CONFIGS, "previous")  # what `with_table` takes


def table_at(name: str, rows: int, experts: int) -> dict:
    """Tile table `name` (one of grouped_swiglu.CONFIGS, or "previous") for a call's size."""
    return PREVIOUS[previous_regime(rows, experts)] if name == "previous" else gs.CONFIGS[name]


def candidates(regime, op):
    kind = "wgrad" if op.endswith("wgrad") else "rows"
    return CANDIDATES[regime].get(op, CANDIDATES[regime][kind])


def bench(fn, rep=100):
    """Median ms of `fn` by Triton's `do_bench`: L2 flushed before each call, warm-up excluded.
    Not benchmarks/common.py's timer: one op or GEMM alone is timed from a cold L2, as
    docs/kernels.md's tile tables were measured."""
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def make_inputs(per_expert, L, D, F, dtype=torch.bfloat16, requires_grad=False, sizes=None, device=DEVICE):
    """x, counts, w1, w2, dy for L experts of `per_expert` rows each, or of `sizes` rows."""
    sizes = [per_expert] * L if sizes is None else sizes
    R = sum(sizes)
    gen = torch.Generator(device=device).manual_seed(R + L)
    x = torch.randn(R, D, device=device, generator=gen).to(dtype)
    w1 = (torch.randn(L, 2 * F, D, device=device, generator=gen) * D**-0.5).to(dtype)
    w2 = (torch.randn(L, D, F, device=device, generator=gen) * F**-0.5).to(dtype)
    dy = torch.randn(R, D, device=device, generator=gen).to(dtype)
    counts = torch.tensor(sizes, device=device, dtype=torch.int64)
    if requires_grad:
        for t in (x, w1, w2):
            t.requires_grad_()
    return x, counts, w1, w2, dy


def parse_case(case: str) -> list[int]:
    """`LxR` (L experts of R rows) or `R0+R1+...` (rows of each expert) as rows per expert;
    ValueError unless that is at least one expert, none below 0 rows, and some rows in all."""
    if "x" in case:
        experts, rows = map(int, case.split("x"))
        sizes = [rows] * experts
    else:
        sizes = [int(rows) for rows in case.split("+")]
    if not sizes or min(sizes) < 0 or sum(sizes) == 0:
        raise ValueError(f"no rows to run in case {case!r}")
    return sizes


def parse_cases(cases: str) -> dict[str, list[int]]:
    """{case: rows per expert} for `parse_case`'s cases joined by commas (ValueError if one is not)."""
    return {case: parse_case(case) for case in cases.split(",")}


def with_table(name: str):
    """The op with tile table `name` (see `table_at`) at every size, instead of the one
    `regime` picks."""
    def op(x_RD, counts_L, w1, w2):
        table = table_at(name, x_RD.shape[0], counts_L.shape[0])
        return gs.grouped_swiglu(x_RD, counts_L, w1, w2, configs=dict.fromkeys(gs.CONFIGS, table))
    return op


def gemm_elements(op: str, sizes: list[int], D: int, F: int) -> tuple[int, int]:
    """(read, written) elements of GEMM `op` (one of OPS), reading its operands once and
    writing its results once, as ours runs it (docs/kernels.md's table): SwiGLU fused into
    gate_up's epilogue (it writes h and act) and its gradient into down_dgrad's (it reads h,
    writes dh in its place and act again). A weight gradient writes the weight's elements."""
    R, L = sum(sizes), len(sizes)
    x = y = dy = dx = R * D
    h = dh = 2 * R * F
    act = R * F
    w1, w2 = L * 2 * F * D, L * D * F
    return {"gate_up": (x + w1, h + act), "down": (act + w2, y), "down_dgrad": (dy + w2 + h, dh + act),
            "down_wgrad": (dy + act, w2), "gate_up_dgrad": (dh + w1, dx), "gate_up_wgrad": (dh + x, w1)}[op]


def gemm_bytes(op: str, sizes: list[int], D: int, F: int, element: int = 2) -> int:
    """Bytes GEMM `op` moves (`gemm_elements`), `element` bytes each (bf16: 2)."""
    return element * sum(gemm_elements(op, sizes, D, F))


def gemm_flops(op: str, sizes: list[int], D: int, F: int) -> int:
    """FLOPs of GEMM `op`, FLOP_UNITS[op]·R·D·F: 2·R·D·F a pass over a D x F weight, gate_up's
    two (gate and up) and their gradients' twice that."""
    return FLOP_UNITS[op] * sum(sizes) * D * F


def op_bytes(sizes: list[int], D: int, F: int, element: int = 2) -> int:
    """Bytes one forward + backward moves, the sum of its six GEMMs' (`gemm_bytes`): the
    weights, 3·F·D elements an expert, read by the forward and again by the two dgrads and
    written once as gradients; the rows' activations 6·R·D + 14·R·F (x, y, dy, dx and h, act,
    dh as the GEMMs pass them on)."""
    return sum(gemm_bytes(op, sizes, D, F, element) for op in OPS)


def op_flops(sizes: list[int], D: int, F: int) -> int:
    """FLOPs of one forward + backward: 18·R·D·F (docs/kernels.md)."""
    return sum(gemm_flops(op, sizes, D, F) for op in OPS)


# What each GEMM writes (`gemm_operands`' names): the tensors a sweep checks.
GEMM_OUTPUTS = {"gate_up": ("h_out", "act_out"), "down": ("y",), "down_dgrad": ("dh", "act_out"),
                "down_wgrad": ("d_w2",), "gate_up_dgrad": ("dx",), "gate_up_wgrad": ("d_w1",)}


def gemm_operands(sizes, D, F, dtype=torch.bfloat16, device=DEVICE) -> dict:
    """What the six GEMMs read and write, alone, for experts of `sizes` rows: the op's inputs
    (`make_inputs`); h, random pre-activations (the SwiGLU backward's) that also stand in for
    dh, and act, random activations; and a tensor of its own for each result (GEMM_OUTPUTS),
    so that no GEMM changes what another reads. The SwiGLU backward turns h into dh in place:
    it runs on `dh`, a copy of h (after the first call, no longer h)."""
    x, counts, w1, w2, dy = make_inputs(None, len(sizes), D, F, dtype=dtype, sizes=sizes, device=device)
    R = x.shape[0]
    gen = torch.Generator(device=device).manual_seed(R + len(sizes) + 1)
    h = torch.randn(R, 2 * F, device=device, generator=gen).to(dtype)
    act = torch.randn(R, F, device=device, generator=gen).to(dtype)
    return {"x": x, "counts": counts, "w1": w1, "w2": w2, "dy": dy, "h": h, "act": act, "dh": h.clone(),
            "h_out": torch.empty_like(h), "act_out": torch.empty_like(act), "y": torch.empty_like(x),
            "dx": torch.empty_like(x), "d_w1": torch.empty_like(w1), "d_w2": torch.empty_like(w2)}


def gemm_call(op, t, c, use_tma, write_act=True):
    """A zero-argument launcher of GEMM `op` with tile config c on operands `t`
    (`gemm_operands`), as the op launches it (grouped_swiglu.py); down_dgrad without
    `write_act` leaves act out."""
    D, F = t["w2"].shape[1:]
    counts = t["counts"]
    return {
        "gate_up": lambda: gg.rows_gemm(t["x"], t["w1"], counts, t["act_out"], n=F, b_icontig=True, cfg=c,
                                        use_tma=use_tma, epilogue=gg.EPI_SWIGLU, h=t["h_out"]),
        "down": lambda: gg.rows_gemm(t["act"], t["w2"], counts, t["y"], n=D, b_icontig=True, cfg=c,
                                     use_tma=use_tma),
        "down_dgrad": lambda: gg.rows_gemm(t["dy"], t["w2"], counts, t["act_out"] if write_act else None, n=F,
                                           b_icontig=False, cfg=c, use_tma=use_tma,
                                           epilogue=gg.EPI_SWIGLU_BWD, h=t["dh"]),
        "down_wgrad": lambda: wgrad_gemm(t["dy"], t["act"], counts, t["d_w2"], cfg=c, use_tma=use_tma),
        "gate_up_dgrad": lambda: gg.rows_gemm(t["h"], t["w1"], counts, t["dx"], n=D, b_icontig=False, cfg=c,
                                              use_tma=use_tma),
        "gate_up_wgrad": lambda: wgrad_gemm(t["h"], t["x"], counts, t["d_w1"], cfg=c, use_tma=use_tma),
    }[op]


def op_runner(op, per_expert, L, D, F, c, write_act=True, sizes=None):
    """A zero-argument launcher of one of the six GEMMs with config c, on fresh data
    (`sizes`: rows per expert where they differ, see `make_inputs`), loading as the op
    itself chooses (TMA or not)."""
    sizes = [per_expert] * L if sizes is None else sizes
    return gemm_call(op, gemm_operands(sizes, D, F), c, gs.uses_descriptors(sum(sizes), L), write_act)


def _compile(job):
    """In a worker process: compile one GEMM with one config by running it on small inputs
    whose integer arguments specialise exactly like the real shapes' (multiples of 16 and
    64; the real call's expert count and rows, which decide BLOCK_L and TMA loads), so the
    real run finds the kernel in Triton's on-disk cache. A job is (op, config) or (op,
    config, rows per expert, experts)."""
    op, c, per_expert, L = (*job, 64, 4)[:4]
    try:
        op_runner(op, per_expert, L, 256, 512, c)()
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{op} {c}: {type(e).__name__}: {str(e)[:150]}"


def precompile(jobs, say=lambda line: print(line, flush=True)):
    """Triton compiles on one CPU core per kernel; a pool of processes uses them all.
    `say` takes each line of news (custom_grouped_bench.py's log keeps them too)."""
    t0 = time.time()
    unique = list({json.dumps(j, sort_keys=True): j for j in jobs}.values())
    with multiprocessing.get_context("spawn").Pool(min(12, os.cpu_count() or 1)) as pool:
        for err in pool.imap_unordered(_compile, unique):
            if err:
                say("  does not build/run: " + err)
    say(f"precompiled {len(unique)} kernels in {time.time() - t0:.0f} s")


def fwd_bwd(fn, x, counts, w1, w2, dy):
    return lambda: torch.autograd.grad(fn(x, counts, w1, w2), (x, w1, w2), dy)


def step_ms(fn, calls: int) -> float:
    """Wall ms a call of `calls` calls back to back, synchronised before the first and after
    the last: what a training step that runs this op sees, the host's launching and the
    GPU's work overlapping as they can (the larger of the two, where the host's queue never
    fills). Not benchmarks/common.py's timer, whose CUDA events time the GPU alone, nor
    `gpu_ms`, which keeps the host out of it: at few rows per expert the host's work of
    launching the op can take longer than the GPU's of running it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / calls


def gpu_ms(fn, calls: int = GPU_CALLS, spin_cycles: int = SPIN_CYCLES) -> float:
    """GPU ms a call of `calls` queued behind a spin of `spin_cycles`, which must outlast
    the host's queuing of them. Not benchmarks/common.py's timer: at few rows a single op's
    GPU work is shorter than the host's launch of it, and only a queue kept ahead of the GPU
    times the kernels rather than Python."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(spin_cycles)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / calls
