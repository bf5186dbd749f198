"""The six FP8 GEMMs of the expert FFN alone: the tier's Triton kernels
(`te_mixtral/experts/kernels/scaled_grouped_mm.py`) against `torch._scaled_grouped_mm`
(CUTLASS) with exact and with fast accumulation, on the same E4M3 operands and scales.

4 local experts x 4096 and 8192 rows, Mixtral-8x7B (D 4096, F 14336) and 8x22B (D 6144,
F 16384) shapes. Each GEMM's time is the median of Triton's `do_bench` (not
benchmarks/common.py's timer: a GEMM alone is timed with L2 flushed before each call, as the
custom_grouped GEMM benchmarks time theirs); `err` is the
relative Frobenius error of the first expert's first 1024 output rows against float64 on
the same quantised operands (the bf16 rounding of the output alone gives about 1.7e-3).

    python3 -m benchmarks.fp8_gemms [--json results.json]

Needs a Hopper GPU.
"""

import argparse
import sys

import torch
from triton.testing import do_bench

from benchmarks import common
from benchmarks.common import FAMILIES, LOCAL_EXPERTS
from te_mixtral.experts.kernels.scaled_grouped_mm import scaled_grouped_mm
from te_mixtral.measure.report import format_table

E4M3 = torch.float8_e4m3fn
CHECKED_ROWS = 1024


def fp8(*shape, device):
    return (torch.randn(*shape, device=device) * 100).clamp(-448, 448).to(E4M3)


def scales(*shape, device):
    return torch.rand(*shape, device=device) * 1e-3 + 1e-4


def gemm_cases(D, F, rows_per_expert, device):
    """name -> (mat_a, mat_b, scale_a, scale_b, float64 reference of the checked block)."""
    L, R, n = LOCAL_EXPERTS, LOCAL_EXPERTS * rows_per_expert, CHECKED_ROWS
    cases = {}
    for name, (N, K) in {"fprop gate_up": (2 * F, D), "fprop down": (D, F),
                         "dgrad down": (F, D), "dgrad gate_up": (D, 2 * F)}.items():
        a, w = fp8(R, K, device=device), fp8(L, N, K, device=device)
        sa, sb = scales(R, device=device), scales(L, N, device=device)
        ref = (a[:n].double() * sa[:n, None].double()) @ (w[0].double() * sb[0, :, None].double()).T
        cases[name] = (a, w.transpose(-2, -1), sa, sb, ref)
    for name, (M, N) in {"wgrad down": (D, F), "wgrad gate_up": (2 * F, D)}.items():
        g, x = fp8(M, R, device=device), fp8(N, R, device=device)
        sg, sx = scales(L * M, device=device), scales(L * N, device=device)
        per = rows_per_expert
        ref = (g[:n, :per].double() * sg[:n, None].double()) @ (x[:, :per].double() * sx[:N, None].double()).T
        cases[name] = (g, x.t(), sg, sx, ref)
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    device = common.cuda_or_refuse("fp8_gemms")
    if device is None:
        return 2
    header, rows = common.run_header(device), []
    print(common.header_line(header))
    print(f"FP8 grouped GEMMs on {header['device']}, {header['date']}", flush=True)
    kernels = {
        "triton": lambda a, b, sa, sb, offs: scaled_grouped_mm(a, b, sa, sb, offs),
        "cutlass exact": lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(
            a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False),
        "cutlass fast": lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(
            a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True),
    }
    for family, sizes in FAMILIES.items():
        for per_expert in (4096, 8192):
            offs = torch.full((LOCAL_EXPERTS,), per_expert, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
            for name, (a, b, sa, sb, ref) in gemm_cases(sizes.hidden, sizes.ffn, per_expert, device).items():
                flops = 2 * a.shape[0] * a.shape[1] * b.shape[-1] if b.dim() == 3 else 2 * a.numel() * b.shape[1]
                row = {"family": family, "rows_per_expert": per_expert, "gemm": name}
                for kernel, mm in kernels.items():
                    out = mm(a, b, sa, sb, offs)
                    block = out[:CHECKED_ROWS] if b.dim() == 3 else out[0, :CHECKED_ROWS]
                    ms = do_bench(lambda: mm(a, b, sa, sb, offs))
                    row[kernel] = {"ms": ms, "tflops": flops / ms / 1e9,
                                   "err": ((block.double() - ref).norm() / ref.norm()).item()}
                rows.append(row)
                print(f"  {family} {per_expert} {name}: " + "  ".join(
                    f"{k} {row[k]['ms']:.2f} ms" for k in kernels), flush=True)
    print(format_table(
        [[r["family"], str(r["rows_per_expert"]), r["gemm"],
          *(f"{r[k]['ms']:.2f}" for k in kernels), *(f"{r[k]['tflops']:.0f}" for k in kernels),
          f"{r['cutlass exact']['ms'] / r['triton']['ms']:.2f}", f"{r['cutlass fast']['ms'] / r['triton']['ms']:.2f}",
          *(f"{r[k]['err']:.1e}" for k in kernels)] for r in rows],
        ["family", "rows/expert", "GEMM", *(f"{k} ms" for k in kernels), *(f"{k} TFLOP/s" for k in kernels),
         "x exact", "x fast", *(f"{k} err" for k in kernels)]))
    common.write_json(args.json, {"header": header, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
