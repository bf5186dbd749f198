"""Benchmark the custom_grouped expert op (forward + backward) against torch grouped_mm.

    python benchmarks/custom_grouped_bench.py [--sweep] [--out DIR]

Shape letters as in te_mixtral/__init__.py (L local experts, R rows, D model dim, F
expert hidden dim); `per_expert` is the rows (tokens) each expert gets, R = per_expert * L.
Mixtral-8x7B: D 4096, F 14336; 8x22B: D 6144, F 16384; 4 local experts.

The two numbers (docs/kernels.md has the derivation):
  FLOPs  forward 2·R·D·2F + 2·R·F·D = 6·R·D·F; backward twice that; 18·R·D·F in all.
  bytes  each of the six GEMMs reads its operands once and writes its result once; the
         weight terms (3·L·F·D elements read by the forward, again by the two dgrads, and
         written once as gradients) dominate at few rows per expert.
Peak matmul rate and copy bandwidth are measured in the same run, never taken from a
datasheet. Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed before
each run, warm-up excluded) on random data.

--sweep first times candidate tile configs per GEMM and per row count, then runs the table with
the winners and prints them as JSON (to copy into grouped_swiglu.CONFIGS).
"""

import argparse
import datetime
import functools
import json
import multiprocessing
import os
import time

import torch
import triton
from triton.testing import do_bench

from te_mixtral.experts.custom_grouped import grouped_mm_swiglu
from te_mixtral.experts.kernels import grouped_gemm as gg
from te_mixtral.experts.kernels import grouped_swiglu as gs
from te_mixtral.experts.kernels.schedule import tile_config
from te_mixtral.experts.kernels.wgrad_gemm import wgrad_gemm

OPS = ("gate_up", "down", "down_dgrad", "down_wgrad", "gate_up_dgrad", "gate_up_wgrad")
FLOP_UNITS = {"gate_up": 4, "down": 2, "down_dgrad": 2, "down_wgrad": 2,
              "gate_up_dgrad": 4, "gate_up_wgrad": 4}  # times R·D·F
DEVICE = "cuda"
# TE GroupedLinear fwd+bwd TFLOP/s on an H100, 8x7B shapes, 4 experts: the figures the kernel's
# targets were set against, not measured by this script (docs/kernels.md, "Targets").
TE_H100 = {64: 86, 256: 290, 1024: 500, 4096: 572, 8192: 578}


# Tile configs are built as the kernels build their own table (grouped_swiglu.CONFIGS), so a
# sweep's winners paste into it unchanged.
cfg = tile_config

# Candidates by regime; a GEMM's own list wins over its kind's. PROGS_PER_SM=2 keeps two
# programs on an SM where registers (<= 255 x 128 threads each) and shared memory
# (<= 113 KB each) allow, so one program's epilogue overlaps the other's main loop;
# GROUP_M=16 halves how often a large rows-GEMM streams the weights from DRAM.
PINGPONG = cfg(128, 128, 64, 4, 3, progs=2)
# A weight gradient's EPI_PARTS is how many column blocks its store walks.
WGRAD_FEW_ROWS = [cfg(128, 128, 64, 4, 3, progs=2, parts=2), cfg(128, 128, 64, 4, 3, progs=2, parts=1),
                  cfg(128, 256, 64, 8, 3, parts=2), cfg(64, 256, 64, 4, 2, progs=2, parts=2)]
# The plain GEMMs may split their last round of tiles in up to TAIL_SPLIT shares (`_tail_split`).
SPLIT_K_FEW_ROWS = [cfg(64, 64, 128, 4, 4), cfg(64, 32, 256, 4, 4)] + [
    cfg(*tile, tail_split=k) for tile in ((64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4, 2))
    for k in (2, 4, 8)]
CANDIDATES = {
    "small": {
        "rows": [cfg(64, 64, 128, 4, 4), cfg(64, 128, 64, 4, 4), cfg(64, 64, 64, 4, 4, progs=2),
                 # narrow tiles: with one local expert and an N of D, 64-wide tiles leave SMs idle
                 cfg(64, 32, 128, 4, 6), cfg(64, 32, 256, 4, 4), cfg(64, 32, 128, 4, 4, progs=2)],
        "gate_up": [cfg(64, 64, 128, 4, 4), cfg(64, 64, 64, 4, 6), cfg(64, 64, 64, 4, 4, progs=2)],
        "wgrad": WGRAD_FEW_ROWS,
        # N = D gives 64 tiles of 64 columns per expert: split the long reduction instead
        "down": SPLIT_K_FEW_ROWS,
        "gate_up_dgrad": SPLIT_K_FEW_ROWS,
    },
    "medium": {
        "rows": [cfg(128, 128, 64, 8, 4), cfg(128, 256, 64, 8, 3), PINGPONG,
                 cfg(128, 128, 64, 8, 3, progs=2)],
        "gate_up": [cfg(128, 128, 64, 8, 4), cfg(128, 64, 64, 4, 3, progs=2),
                    cfg(128, 128, 64, 8, 4, parts=2)],
        "wgrad": WGRAD_FEW_ROWS,
    },
    "large": {
        "rows": [cfg(128, 256, 64, 8, 3), cfg(256, 128, 64, 8, 3), PINGPONG,
                 cfg(128, 256, 64, 8, 3, group=16), cfg(256, 128, 64, 8, 3, group=16),
                 cfg(128, 256, 64, 8, 4, group=16), cfg(128, 256, 64, 8, 3, flatten=True)],
        "gate_up": [cfg(128, 128, 64, 8, 4), cfg(128, 64, 64, 4, 3, progs=2),
                    cfg(128, 128, 64, 8, 4, group=16), cfg(128, 128, 64, 8, 4, parts=2)],
        "down_dgrad": [cfg(128, 128, 64, 8, 4), cfg(128, 256, 64, 8, 3), PINGPONG,
                       cfg(128, 128, 64, 8, 4, group=16), cfg(128, 256, 64, 8, 3, group=16),
                       cfg(128, 256, 64, 8, 3, group=16, flatten=True)],
        "wgrad": [cfg(128, 256, 64, 8, 3, parts=1), cfg(128, 256, 64, 8, 3, parts=2),
                  cfg(128, 256, 64, 8, 3, group=16, parts=1), cfg(128, 256, 64, 8, 3, group=16, parts=2)],
    },
}
CANDIDATES["small, 1 expert"] = CANDIDATES["split-K"] = CANDIDATES["small"]
CANDIDATES["medium, few rows"] = CANDIDATES["medium"]
SWEEP_ROWS = {8192: "large", 64: "small", 256: "medium", 1024: "large"}  # most uncertain first


def candidates(regime, op):
    kind = "wgrad" if op.endswith("wgrad") else "rows"
    return CANDIDATES[regime].get(op, CANDIDATES[regime][kind])


def log(out, line=""):
    print(line, flush=True)
    if out:
        with open(os.path.join(out, "bench.log"), "a") as f:
            f.write(line + "\n")


def bench(fn, rep=100):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def make_inputs(per_expert, L, D, F, dtype=torch.bfloat16, requires_grad=False, sizes=None):
    """x, counts, w1, w2, dy for L experts of `per_expert` rows each, or of `sizes` rows."""
    sizes = [per_expert] * L if sizes is None else sizes
    R = sum(sizes)
    gen = torch.Generator(device=DEVICE).manual_seed(R + L)
    x = torch.randn(R, D, device=DEVICE, generator=gen).to(dtype)
    w1 = (torch.randn(L, 2 * F, D, device=DEVICE, generator=gen) * D**-0.5).to(dtype)
    w2 = (torch.randn(L, D, F, device=DEVICE, generator=gen) * F**-0.5).to(dtype)
    dy = torch.randn(R, D, device=DEVICE, generator=gen).to(dtype)
    counts = torch.tensor(sizes, device=DEVICE, dtype=torch.int64)
    if requires_grad:
        for t in (x, w1, w2):
            t.requires_grad_()
    return x, counts, w1, w2, dy


def parse_case(case: str) -> list[int]:
    """`LxR` (L experts of R rows) or `R0+R1+...` (rows of each expert) as rows per expert."""
    if "x" in case:
        experts, rows = map(int, case.split("x"))
        return [rows] * experts
    return [int(rows) for rows in case.split("+")]


def with_table(name: str):
    """The op with tile table `name` at every size, instead of the one `regime` picks."""
    return functools.partial(gs.grouped_swiglu, configs=dict.fromkeys(gs.CONFIGS, gs.CONFIGS[name]))


def op_runner(op, per_expert, L, D, F, c, write_act=True, sizes=None):
    """A zero-argument launcher of one of the six GEMMs with config c, on fresh data
    (`sizes`: rows per expert where they differ, see `make_inputs`)."""
    x, counts, w1, w2, dy = make_inputs(per_expert, L, D, F, sizes=sizes)
    R = x.shape[0]
    h = torch.randn(R, 2 * F, device=DEVICE, dtype=x.dtype)
    act = torch.randn(R, F, device=DEVICE, dtype=x.dtype)
    y = torch.empty(R, D, device=DEVICE, dtype=x.dtype)
    tma = gs.uses_descriptors(R, L)  # as the op itself chooses
    return {
        "gate_up": lambda: gg.rows_gemm(x, w1, counts, act, n=F, b_icontig=True, cfg=c,
                                        use_tma=tma, epilogue=gg.EPI_SWIGLU, h=h),
        "down": lambda: gg.rows_gemm(act, w2, counts, y, n=D, b_icontig=True, cfg=c,
                                     use_tma=tma),
        "down_dgrad": lambda: gg.rows_gemm(dy, w2, counts, act if write_act else None, n=F,
                                           b_icontig=False, cfg=c, use_tma=tma,
                                           epilogue=gg.EPI_SWIGLU_BWD, h=h),
        "down_wgrad": lambda: wgrad_gemm(dy, act, counts, torch.empty_like(w2), cfg=c, use_tma=tma),
        "gate_up_dgrad": lambda: gg.rows_gemm(h, w1, counts, y, n=D, b_icontig=False, cfg=c,
                                              use_tma=tma),
        "gate_up_wgrad": lambda: wgrad_gemm(h, x, counts, torch.empty_like(w1), cfg=c, use_tma=tma),
    }[op]


def _compile(job):
    """In a worker process: compile one (GEMM, config) by running it on tiny inputs whose
    integer arguments specialise exactly like the real shapes' (multiples of 16 and 64),
    so the real run finds the kernel in Triton's on-disk cache."""
    op, c = job
    try:
        op_runner(op, 64, 4, 256, 512, c)()
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{op} {c}: {type(e).__name__}: {str(e)[:150]}"


def precompile(jobs, out):
    """Triton compiles on one CPU core per kernel; a pool of processes uses them all."""
    t0 = time.time()
    unique = list({json.dumps(j, sort_keys=True): j for j in jobs}.values())
    with multiprocessing.get_context("spawn").Pool(min(12, os.cpu_count() or 1)) as pool:
        for err in pool.imap_unordered(_compile, unique):
            if err:
                log(out, "  does not build/run: " + err)
    log(out, f"precompiled {len(unique)} kernels in {time.time() - t0:.0f} s")


def sweep(L, D, F, out, budget_s):
    """Best config per GEMM per swept row count: {per_expert: {op: cfg}}."""
    precompile([(op, c) for regime in SWEEP_ROWS.values() for op in OPS
                for c in candidates(regime, op)], out)
    t0, best = time.time(), {}
    for per_expert, regime in SWEEP_ROWS.items():
        best[per_expert] = {}
        for op in OPS:
            results = []
            for c in candidates(regime, op):
                if time.time() - t0 > budget_s:
                    break
                try:
                    run = op_runner(op, per_expert, L, D, F, c)
                    k = run()
                    ms = bench(run, rep=50)
                except Exception as e:  # a config the compiler or the SM cannot hold
                    log(out, f"  rows/L={per_expert} {op} {c} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                tflops = FLOP_UNITS[op] * per_expert * L * D * F / ms / 1e9
                results.append((ms, c))
                res = (f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} "
                       f"smem {getattr(getattr(k, 'metadata', None), 'shared', 0) // 1024} KB")
                log(out, f"  rows/L={per_expert:5d} {op:14s} {ms:8.3f} ms {tflops:6.0f} TFLOP/s  {res}  {c}")
                torch.cuda.empty_cache()
            # Out of budget or nothing ran: the shipped table's choice.
            best[per_expert][op] = (min(results, key=lambda r: r[0])[1] if results
                           else gs.CONFIGS[gs.regime(per_expert * L, L)][op])
    log(out, f"sweep took {time.time() - t0:.0f} s")
    return best


def nearest(best, per_expert):
    return best[min(best, key=lambda k: abs(k - per_expert) / max(k, per_expert))]


def fwd_bwd(fn, x, counts, w1, w2, dy):
    return lambda: torch.autograd.grad(fn(x, counts, w1, w2), (x, w1, w2), dy)


def peak_memory(run):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def ceilings(out):
    """The measured bf16 matmul rate (TFLOP/s) and device copy bandwidth (GB/s)."""
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    peak = 2 * 8192**3 / bench(lambda: a @ b) / 1e9
    src = torch.randn(2**28, device=DEVICE)  # 1 GiB
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e6  # read + write
    log(out, f"measured: bf16 matmul 8192^3 {peak:.0f} TFLOP/s; device copy {bw:.0f} GB/s")
    return peak, bw


def breakdown(best, L, out):
    """Each GEMM alone (8x7B), and down_dgrad without re-creating act: the measured cost
    of recomputing h (= gate_up) and of recomputing act (= the difference)."""
    D, F = 4096, 14336
    log(out, "per GEMM, 8x7B, ms / TFLOP/s:")
    for per_expert in (64, 1024, 8192):
        c_all = nearest(best, per_expert) if best else gs.CONFIGS[gs.regime(per_expert * L, L)]
        row = []
        for op in OPS:
            ms = bench(op_runner(op, per_expert, L, D, F, c_all[op]))
            row.append(f"{op} {ms:.3f}/{FLOP_UNITS[op] * per_expert * L * D * F / ms / 1e9:.0f}")
            torch.cuda.empty_cache()
        no_act = bench(op_runner("down_dgrad", per_expert, L, D, F, c_all["down_dgrad"], write_act=False))
        log(out, f"  rows/L={per_expert:5d} " + "  ".join(row) + f"  | down_dgrad without act {no_act:.3f}")
        torch.cuda.empty_cache()


def table(shapes, best, L, peak, bw, out):
    """fwd+bwd of the whole op against grouped_mm, one row per (model, per_expert)."""
    log(out, f"{'model':6s} {'rows/L':>6s} {'ours ms':>8s} {'TFLOP/s':>7s} {'gmm ms':>8s} "
             f"{'TFLOP/s':>7s} {'x gmm':>5s} {'x TE*':>5s} {'%peak':>5s} {'floor':>7s} "
             f"{'GiB ours':>8s} {'GiB gmm':>7s} {'vs gmm':>8s}")
    for model, per_expert, D, F in shapes:
        R = per_expert * L
        flops = 18 * R * D * F
        weight_bytes = 3 * L * F * D * 2  # read by forward, by the dgrads; grads written
        floor_ms = max(flops / (peak * 1e9), 3 * weight_bytes / (bw * 1e6))
        configs = None
        if best:
            chosen = nearest(best, per_expert)
            configs = {regime: chosen for regime in gs.CONFIGS}
        x, counts, w1, w2, dy = make_inputs(per_expert, L, D, F, requires_grad=True)
        ours = fwd_bwd(lambda *a: gs.grouped_swiglu(*a, configs=configs), x, counts, w1, w2, dy)
        gmm = fwd_bwd(grouped_mm_swiglu, x, counts, w1, w2, dy)
        # Sanity at the real shapes: both are bf16 approximations of one function.
        got = (gs.grouped_swiglu(x, counts, w1, w2, configs=configs).detach(), *ours())
        want = (grouped_mm_swiglu(x, counts, w1, w2).detach(), *gmm())
        differ = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                     for a, b in zip(got, want))
        del got, want
        ms_ours, ms_gmm = bench(ours, rep=400), bench(gmm, rep=400)
        mem_ours, mem_gmm = peak_memory(ours), peak_memory(gmm)
        tf_ours, tf_gmm = flops / ms_ours / 1e9, flops / ms_gmm / 1e9
        te = f"{tf_ours / TE_H100[per_expert]:5.2f}" if model == "8x7B" and per_expert in TE_H100 else "    -"
        log(out, f"{model:6s} {per_expert:6d} {ms_ours:8.3f} {tf_ours:7.0f} {ms_gmm:8.3f} {tf_gmm:7.0f} "
                 f"{ms_gmm / ms_ours:5.2f} {te} {100 * tf_ours / peak:5.0f} {floor_ms:7.3f} "
                 f"{mem_ours:8.2f} {mem_gmm:7.2f} {differ:8.1e}")
        del x, counts, w1, w2, dy
        torch.cuda.empty_cache()
    log(out, "x TE*: against the TE GroupedLinear TFLOP/s on an H100 that the targets were set "
             "against (docs/kernels.md), not measured in this run; "
             "floor: max(FLOPs / matmul peak, 3 weight passes / copy bw); "
             "GiB: peak memory of one fwd+bwd above its inputs; vs gmm: largest relative "
             "difference of y and the three grads from grouped_mm's")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-budget", type=float, default=240.0, help="seconds")
    p.add_argument("--tokens", default="64,256,1024,4096,8192")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--out", default=None, help="folder for bench.log and configs.json")
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    L, out = args.experts, args.out

    log(out, f"# custom_grouped vs grouped_mm, {datetime.date.today()}, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, {L} local experts")
    peak, bw = ceilings(out)
    best = None
    if args.sweep:
        best = sweep(L, 4096, 14336, out, args.sweep_budget)
        if out:
            with open(os.path.join(out, "configs.json"), "w") as f:
                json.dump(best, f, indent=1)
        log(out, "best configs: " + json.dumps(best))
    breakdown(best, L, out)
    shapes = [("8x7B", int(t), 4096, 14336) for t in args.tokens.split(",")]
    shapes += [("8x22B", 64, 6144, 16384), ("8x22B", 1024, 6144, 16384)]
    table(shapes, best, L, peak, bw, out)


if __name__ == "__main__":
    main()
