"""Each of custom_grouped's six GEMMs at training shapes, against cuBLAS on the same shapes.

    python3 -m benchmarks.custom_grouped_gemms [--cases 8x2048,4x4096,179+77] [--gemms down_wgrad,...] [--json OUT]

A case `LxR` is L local experts of R rows each at Mixtral-8x7B width (8x2048 is one GPU
holding all 8 experts of a layer with one 8192-token sequence, top-2; 4x4096 a rank at
EP=2 with two sequences; 1x64 a rank at EP=8 with few tokens); `R0+R1+...` gives each
expert's rows, for uneven splits (179+77: 256 rows over two experts, 70/30). For each GEMM it times the
tile table's config for that many rows per expert (`grouped_swiglu.CONFIGS`), the other
candidates of that regime (benchmarks/custom_grouped_ops.py), and cuBLAS (`torch.mm`
once per expert, the plain GEMM without our fused SwiGLU epilogues): the ceiling a tile
change aims at, and the place a fused epilogue costs more than it saves. Medians of
`triton.testing.do_bench` (custom_grouped_ops.bench: a GEMM alone, from a cold L2). Each
GEMM's line starts with its bytes floor: the bytes it moves (`custom_grouped_ops.gemm_bytes`)
at the copy bandwidth measured at the start of the run. `--gemms` times some of the six only.
"""

import argparse
import sys

import torch

from benchmarks import common
from benchmarks import custom_grouped_ops as cb
from benchmarks.common import FAMILIES
from benchmarks.custom_grouped_grid import COPY_BYTES
from te_mixtral.experts.kernels import grouped_swiglu as gs

D, F = FAMILIES["8x7b"].hidden, FAMILIES["8x7b"].ffn
# (M, K, N) of one expert's plain GEMM, rows R = per-expert rows.
CUBLAS_SHAPES = {"gate_up": lambda r: (r, D, 2 * F), "down": lambda r: (r, F, D), "down_dgrad": lambda r: (r, D, F),
                 "gate_up_dgrad": lambda r: (r, 2 * F, D), "down_wgrad": lambda r: (D, r, F),
                 "gate_up_wgrad": lambda r: (2 * F, r, D)}


def configs(op: str, sizes: list[int]) -> dict[str, dict]:
    regime = gs.regime(sum(sizes), len(sizes))
    table = gs.CONFIGS[regime][op]
    out = {"table": table}
    for c in cb.candidates(regime, op):
        if c != table:
            # e: EPI_PARTS, else two configs that differ only there would share a name
            out[f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_I']} w{c['num_warps']} s{c['num_stages']} "
                f"g{c['GROUP_M']}{' p2' if c['PROGS_PER_SM'] == 2 else ''}{' flat' if c.get('FLATTEN') else ''}"
                f" e{c['EPI_PARTS']}{' k' + str(c['TAIL_SPLIT']) if c.get('TAIL_SPLIT', 1) > 1 else ''}"] = c
    return out


def cublas_ms(op: str, sizes: list[int]) -> float:
    """One `torch.mm` per expert with rows (an expert with none has no GEMM to run)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [CUBLAS_SHAPES[op](rows) for rows in sizes if rows]
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for m, k, _ in shapes]
    b = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=gen) for _, k, n in shapes]
    return cb.bench(lambda: [torch.mm(x, y) for x, y in zip(a, b, strict=True)], rep=50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="8x2048,4x4096", help="LxR: local experts x rows per expert")
    parser.add_argument("--gemms", default=",".join(cb.OPS), help=f"any of {', '.join(cb.OPS)}, joined by commas")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    gemms = args.gemms.split(",")
    if any(op not in cb.OPS for op in gemms):
        print(f"custom_grouped_gemms: error: --gemms takes {', '.join(cb.OPS)} joined by commas; got {args.gemms}",
              file=sys.stderr)
        return 2
    device = common.cuda_or_refuse("custom_grouped_gemms")
    if device is None:
        return 2
    try:
        cases = {case: cb.parse_case(case) for case in args.cases.split(",")}
    except ValueError:
        print(f"custom_grouped_gemms: error: --cases takes LxR or R0+R1+... joined by commas; got {args.cases}",
              file=sys.stderr)
        return 2
    # Compiled as each case runs them: its expert count (BLOCK_L) and its load path (TMA or not).
    cb.precompile([(op, c, max(1, sum(sizes) // len(sizes)), len(sizes)) for sizes in cases.values() for op in gemms
                   for c in configs(op, sizes).values()])
    header = common.run_header(device)
    print(common.header_line(header))
    bandwidth = common.copy_bandwidth_gbs(COPY_BYTES, device)
    header["copy_bandwidth_gbs"] = bandwidth
    print(f"custom_grouped GEMMs: ms (TFLOP/s); floor: its bytes at the copy bandwidth measured here, {bandwidth:.0f} GB/s")
    times = {}
    for case, sizes in cases.items():
        for op in gemms:
            flops = cb.gemm_flops(op, sizes, D, F)
            cublas = cublas_ms(op, sizes)
            floor = cb.gemm_bytes(op, sizes, D, F) / (bandwidth * 1e6)
            cells = [f"{case} {op:14s} floor {floor:6.3f}", f"cuBLAS {cublas:6.3f} ({flops / cublas / 1e9:3.0f})"]
            for name, c in configs(op, sizes).items():
                run = cb.op_runner(op, None, len(sizes), D, F, c, sizes=sizes)
                run()
                ms = cb.bench(run, rep=50)
                times[f"{case}/{op}/{name}"] = ms
                cells.append(f"{name}: {ms:6.3f} ({flops / ms / 1e9:3.0f})")
            times[f"{case}/{op}/cuBLAS"] = cublas
            print(" | ".join(cells), flush=True)
    common.write_json(args.json, {"header": header, "ms": times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
