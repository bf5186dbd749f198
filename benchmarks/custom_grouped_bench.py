"""Benchmark the custom_grouped expert op (forward + backward) against torch grouped_mm.

    python3 -m benchmarks.custom_grouped_bench [--sweep] [--out DIR]

Shape letters as in te_mixtral/__init__.py (L local experts, R rows, D model dim, F
expert hidden dim); `per_expert` is the rows (tokens) each expert gets, R = per_expert * L.
Mixtral-8x7B: D 4096, F 14336; 8x22B: D 6144, F 16384; 4 local experts.

The two numbers (docs/kernels.md has the derivation):
  FLOPs  forward 2·R·D·2F + 2·R·F·D = 6·R·D·F; backward twice that; 18·R·D·F in all.
  bytes  each of the six GEMMs reads its operands once and writes its result once; the
         weight terms (3·L·F·D elements read by the forward, again by the two dgrads, and
         written once as gradients) dominate at few rows per expert.
Peak matmul rate and copy bandwidth are measured in the same run, never taken from a
datasheet. Times are medians of `triton.testing.do_bench` (custom_grouped_ops.bench: CUDA
events, L2 flushed before each run, warm-up excluded) on random data.

--sweep first times candidate tile configs per GEMM and per row count, then runs the table with
the winners and prints them as JSON (to copy into grouped_swiglu.CONFIGS). `--out DIR` keeps
the printed lines in DIR/bench.log and the sweep's winners in DIR/configs.json: a folder,
not `--json`, since the sweep's configs are a file of their own, pasted into the kernels.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

from benchmarks import common
from benchmarks.common import FAMILIES
from benchmarks.custom_grouped_ops import (
    DEVICE,
    FLOP_UNITS,
    OPS,
    bench,
    candidates,
    fwd_bwd,
    make_inputs,
    op_bytes,
    op_flops,
    op_runner,
    precompile,
)
from te_mixtral.experts.custom_grouped import grouped_mm_swiglu
from te_mixtral.experts.kernels import grouped_swiglu as gs

# TE GroupedLinear fwd+bwd TFLOP/s on an H100, 8x7B shapes, 4 experts: the figures the kernel's
# targets were set against, not measured by this script (docs/kernels.md, "Targets").
TE_H100 = {64: 86, 256: 290, 1024: 500, 4096: 572, 8192: 578}
SWEEP_ROWS = {8192: "large", 64: "few rows, 64", 256: "medium", 1024: "large"}  # most uncertain first


def log(out, line=""):
    print(line, flush=True)
    if out:
        with open(os.path.join(out, "bench.log"), "a") as f:
            f.write(line + "\n")


def sweep(L, D, F, out, budget_s):
    """Best config per GEMM per swept row count: {per_expert: {op: cfg}}."""
    precompile([(op, c) for regime in SWEEP_ROWS.values() for op in OPS
                for c in candidates(regime, op)], lambda line: log(out, line))
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
    D, F = FAMILIES["8x7b"].hidden, FAMILIES["8x7b"].ffn
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
        flops = op_flops([per_expert] * L, D, F)
        floor_ms = max(flops / (peak * 1e9), op_bytes([per_expert] * L, D, F) / (bw * 1e6))
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
             "floor: max(FLOPs / matmul peak, bytes moved (custom_grouped_ops.op_bytes) / copy bw); "
             "GiB: peak memory of one fwd+bwd above its inputs; vs gmm: largest relative "
             "difference of y and the three grads from grouped_mm's")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-budget", type=float, default=240.0, help="seconds")
    p.add_argument("--tokens", default="64,256,1024,4096,8192")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--out", default=None, help="folder for bench.log and configs.json")
    args = p.parse_args(argv)
    tokens = args.tokens.split(",")
    error = None
    if any(not n.isdigit() or int(n) < 1 for n in tokens):
        error = f"--tokens takes positive integers joined by commas; got {args.tokens}"
    elif args.experts < 1:
        error = f"--experts takes 1 or more, got {args.experts}"
    elif not 0 < args.sweep_budget < math.inf:
        error = f"--sweep-budget takes seconds above 0, got {args.sweep_budget}"
    if error:
        print(f"custom_grouped_bench: error: {error}", file=sys.stderr)
        return 2
    device = common.cuda_or_refuse("custom_grouped_bench")
    if device is None:
        return 2
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    L, out = args.experts, args.out

    log(out, common.header_line(common.run_header(device)))
    log(out, f"# custom_grouped vs grouped_mm, {L} local experts")
    peak, bw = ceilings(out)
    best = None
    if args.sweep:
        best = sweep(L, FAMILIES["8x7b"].hidden, FAMILIES["8x7b"].ffn, out, args.sweep_budget)
        if out:
            with open(os.path.join(out, "configs.json"), "w") as f:
                json.dump(best, f, indent=1)
        log(out, "best configs: " + json.dumps(best))
    breakdown(best, L, out)
    x7, x22 = FAMILIES["8x7b"], FAMILIES["8x22b"]
    shapes = [("8x7B", int(t), x7.hidden, x7.ffn) for t in tokens]
    shapes += [("8x22B", 64, x22.hidden, x22.ffn), ("8x22B", 1024, x22.hidden, x22.ffn)]
    table(shapes, best, L, peak, bw, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
