"""One expert FFN layer, forward + backward, timed for every expert tier this machine runs.

Shape suffixes: see te_mixtral/__init__.py.

What is timed: y = SwiGLU expert FFN over R rows and L = 4 local experts at Mixtral-8x7B
sizes (D = 4096, F = 14336; `--family 8x22b`: D = 6144, F = 16384), then the gradients of x
and both stacked weights (one `torch.autograd.grad` call, so no `.grad` accumulation is
timed). Columns:

- each registered tier (`te_mixtral.experts.registry.EXPERT_TIERS`) whose module exists and whose
  `check_available` passes here; the others are listed with the reason they were skipped;
- `grouped_mm`: `torch.nn.functional.grouped_mm` with plain autograd (the custom_grouped
  tier's CPU path, `grouped_mm_swiglu`, called directly), the PyTorch-native grouped GEMM
  as a reference point;
- the 8-bit peers of `benchmarks/peers.py` (TE's FP8 recipes, torchao's FP8 row-wise MoE
  GEMM), on CUDA, where their library runs. `device_mxfp8` is built as
  `DeviceMXFP8Tier()`: FP8 at every size (no break-even switch to BF16).

The `loop` column is slow at small R on purpose: at 64 rows per expert each of its GEMMs is
tiny and the Python loop, the launches and the host sync dominate, which is what grouped
GEMMs remove.

FLOPs are counted exactly for the GEMMs: forward 2*R*D*2F (gate_up) + 2*R*F*D (down) =
6*R*D*F, backward twice that; SwiGLU's elementwise work is not counted. Next to each time:
the floor no version can beat, the larger of FLOPs / measured matmul peak and the weight
bytes / measured copy bandwidth (weights read in forward, read again for dgrad, their
gradients written: 3 * L*3*F*D*2 bytes; activations ignored, so the byte floor is a lower
bound). At small R the weights dominate: the layer is memory-bound whatever the tier.

How it is timed: bf16 parameters used directly (no autocast; the training loop's fp32
master weights and their casts are not part of this microbenchmark), fresh random non-zero
inputs, benchmarks/common.py's timer (three warm-up steps, then the median of many steps,
each between CUDA events).
Several (x, dy) buffer sets are rotated so that the inputs of consecutive steps are not
already in L2 (together they exceed twice the L2 size); the weights are far larger than L2.
The matmul peak (8192^3, random bf16) and copy bandwidth are measured in the same run.
Every column is timed at one case before the next case starts, so the columns compared in
a case ran minutes apart at most, not a whole run apart: times drift over a run (on an
H100, custom_grouped at 8x7B, 4 x 4096 rows, took 25.0, 25.4, 26.1 and 26.4 ms in four
rounds a few seconds apart), which would otherwise favour the columns timed first.

Run from the repository root, with te_mixtral installed (`pip install -e .`):

    python3 -m benchmarks.expert_ffn [--json results.json] [--quick] [--family 8x7b|8x22b]

`--quick` runs small sizes (seconds on a GPU, a minute on a CPU, where host clocks replace
CUDA events) to check that the script works, not to measure anything.
"""

import argparse
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.common import (
    FAMILIES,
    LOCAL_EXPERTS,
    copy_bandwidth_gbs,
    first_line,
    matmul_peak_tflops,
    median_ms,
    split_by_fractions,
)
from benchmarks.peers import FP8_PEERS
from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.custom_grouped import grouped_mm_swiglu
from te_mixtral.experts.registry import EXPERT_TIERS, make_tier
from te_mixtral.measure.metrics import device_name, peak_flops
from te_mixtral.measure.report import format_table


@dataclass
class Sizes:
    hidden: int  # D
    ffn: int  # F
    uniform_tokens: tuple[int, ...]  # tokens per expert, one case each
    skewed_total: int  # rows of the skewed and the zero-expert cases
    matmul_n: int  # the peak matmul is n x n x n
    copy_bytes: int  # the bandwidth copy reads and writes this many bytes each


FULL = {name: Sizes(f.hidden, f.ffn, (64, 256, 1024, 4096, 8192), 8192, 8192, 2**30) for name, f in FAMILIES.items()}
QUICK = Sizes(128, 256, (16, 64), 256, 512, 2**24)
SKEW = (0.70, 0.20, 0.09, 0.01)  # share of the rows per expert in the skewed case
EMPTY_LAST = (1 / 3, 1 / 3, 1 / 3, 0.0)  # the case with an expert that gets no rows
REFERENCE_COLUMNS = ("grouped_linear", "grouped_mm", "loop")  # timed first in each case, see main()


@dataclass
class Case:
    name: str
    splits: list[int]  # tokens per expert


def make_cases(sizes: Sizes) -> list[Case]:
    percent = "/".join(f"{round(100 * f)}" for f in SKEW)
    return [
        *(Case(f"uniform {n}", [n] * LOCAL_EXPERTS) for n in sizes.uniform_tokens),
        Case(f"skewed {percent}%", split_by_fractions(sizes.skewed_total, SKEW)),
        Case("one expert empty", split_by_fractions(sizes.skewed_total, EMPTY_LAST)),
    ]


def gemm_flops(rows: int, sizes: Sizes) -> int:
    forward = 2 * rows * sizes.hidden * 2 * sizes.ffn + 2 * rows * sizes.ffn * sizes.hidden
    return 3 * forward  # backward = dgrad + wgrad = 2x forward


# --- columns -------------------------------------------------------------------------


def available_columns(device: torch.device) -> tuple[dict, dict]:
    """(name -> expert FFN callable, name -> why it is skipped) for this machine."""
    columns, skipped = {}, {}
    for name in EXPERT_TIERS:
        try:
            tier = make_tier(name)
            tier.check_available(device)
        except ModuleNotFoundError as error:
            skipped[name] = f"module missing ({error})"
        except TierUnavailable as error:
            skipped[name] = str(error)
        except Exception as error:  # noqa: BLE001 - one broken tier must not end the run
            skipped[name] = f"could not load: {type(error).__name__}: {error}"
        else:
            columns[name] = tier
    if hasattr(F, "grouped_mm"):
        columns["grouped_mm"] = grouped_mm_swiglu
    else:
        skipped["grouped_mm"] = f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if device.type == "cuda":
        for name, build in FP8_PEERS.items():
            try:
                columns[name] = build()
            except Exception as error:  # noqa: BLE001 - a library this machine lacks is a skipped column
                skipped[name] = first_line(error)
    else:
        skipped.update(dict.fromkeys(FP8_PEERS, "8-bit peers run on CUDA only"))
    return columns, skipped


# --- one cell ------------------------------------------------------------------------


def input_sets(rows: int, sizes: Sizes, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Enough (x, dy) pairs that consecutive steps do not find their inputs in L2."""
    set_bytes = 2 * rows * sizes.hidden * 2
    l2_bytes = 0
    if device.type == "cuda":
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    count = max(2, min(16, math.ceil(2 * l2_bytes / max(set_bytes, 1))))
    return [
        (
            torch.randn(rows, sizes.hidden, device=device, dtype=torch.bfloat16).requires_grad_(),
            torch.randn(rows, sizes.hidden, device=device, dtype=torch.bfloat16),
        )
        for _ in range(count)
    ]


def time_cell(ffn, case: Case, weights, sizes: Sizes, device: torch.device) -> dict:
    gate_up_L2FD, down_LDF = weights
    tokens_per_expert_L = torch.tensor(case.splits, dtype=torch.int64, device=device)
    buffers = input_sets(sum(case.splits), sizes, device)
    counter = iter(range(10**9))
    # An (empty) optimizer step ends every timed step, as one micro-batch per training step
    # would: what caches a quantised weight until the weights change (device_mxfp8) pays for
    # quantising it in every step, as the TE recipes do.
    optimizer = torch.optim.SGD([torch.zeros(1, device=device, requires_grad=True)], lr=0.0)

    def step():
        x_RD, dy_RD = buffers[next(counter) % len(buffers)]
        y_RD = ffn(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF)
        torch.autograd.grad(y_RD, (x_RD, gate_up_L2FD, down_LDF), dy_RD)
        optimizer.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    ms = median_ms(step, device)
    extra_gib = (torch.cuda.max_memory_allocated(device) - held) / 2**30 if device.type == "cuda" else None
    return {"ms": ms, "extra_gib": extra_gib}


# --- report --------------------------------------------------------------------------


def run_header(device: torch.device, sizes: Sizes) -> dict:
    return common.run_header(device, sizes=asdict(sizes), dtype="bfloat16 parameters and activations, no autocast",
                             datasheet_peak_bf16_tflops=(peak_flops(device_name(device)) or 0) / 1e12 or None)


def table_row(r: dict, peak: float) -> list[str]:
    if "ms" not in r:
        return [r["case"], str(r["rows"]), r["column"], r["error"], "", "", "", "", "", ""]
    return [
        r["case"],
        str(r["rows"]),
        r["column"],
        f"{r['ms']:.3f}",
        f"{r['tflops']:.0f}" if r["tflops"] >= 100 else f"{r['tflops']:.3g}",
        f"{100 * r['tflops'] / peak:.0f}%",
        f"{r['x_best_grouped']:.2f}" if r["x_best_grouped"] else "-",
        f"{r['x_best_8bit_peer']:.2f}" if r["x_best_8bit_peer"] else "-",
        f"{r['floor_ms']:.3f}",
        f"{r['extra_gib']:.2f}" if r["extra_gib"] is not None else "-",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_json_flag(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test, not a measurement")
    common.add_device_flag(parser)
    parser.add_argument("--family", choices=("8x7b", "8x22b"), default="8x7b",
                        help="expert shapes: Mixtral-8x7B (D 4096, F 14336) or 8x22B (D 6144, F 16384)")
    args = parser.parse_args(argv)
    device = args.device
    if device.type != "cuda" and not args.quick:
        parser.error("the full sizes need a CUDA GPU; use --quick to smoke-test on the CPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = QUICK if args.quick else FULL[args.family]
    torch.manual_seed(0)

    # --- ceilings, measured in this run
    header = run_header(device, sizes)
    print(common.header_line(header), flush=True)
    peak = matmul_peak_tflops(sizes.matmul_n, device)
    bandwidth = copy_bandwidth_gbs(sizes.copy_bytes, device)
    columns, skipped = available_columns(device)
    print(f"expert FFN fwd+bwd on {header['device']}: bf16 matmul {sizes.matmul_n}^3 {peak:.0f} TFLOP/s, "
          f"copy {bandwidth:.0f} GB/s", flush=True)

    # --- one weight set for every cell: bf16 parameters, as the tiers receive them under autocast
    L, D, F_ = LOCAL_EXPERTS, sizes.hidden, sizes.ffn
    gate_up_L2FD = (torch.randn(L, 2 * F_, D, device=device) * D**-0.5).to(torch.bfloat16).requires_grad_()
    down_LDF = (torch.randn(L, D, F_, device=device) * F_**-0.5).to(torch.bfloat16).requires_grad_()
    weight_bytes = 2 * (gate_up_L2FD.numel() + down_LDF.numel())

    # --- every case x every column, the columns of one case together (see the docstring).
    # In each case the reference columns go first and other tiers last, so that a tier which
    # breaks the CUDA context cannot take that case's reference numbers with it.
    cases = make_cases(sizes)
    order = [c for c in REFERENCE_COLUMNS if c in columns] + [c for c in columns if c not in REFERENCE_COLUMNS]
    cells = {}
    for case in cases:
        for column in order:
            rows = sum(case.splits)
            flops = gemm_flops(rows, sizes)
            r = {"case": case.name, "tokens_per_expert": case.splits, "rows": rows, "column": column,
                 "gemm_flops": flops,
                 "floor_ms": 1e3 * max(flops / (peak * 1e12), 3 * weight_bytes / (bandwidth * 1e9))}
            try:
                r.update(time_cell(columns[column], case, (gate_up_L2FD, down_LDF), sizes, device))
                r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
            except Exception as error:  # noqa: BLE001 - record it and go on to the next cell
                r["error"] = first_line(error)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            status = f"{r['ms']:.3f} ms  {r['tflops']:.4g} TFLOP/s" if "ms" in r else r["error"]
            print(f"  {column:<15} {case.name:<18} {status}", flush=True)
            cells[case.name, column] = r

    # Per case: each time over the faster of the two grouped-GEMM columns.
    results = []
    for case in cases:
        case_results = [cells[case.name, column] for column in order]
        best = [r["ms"] for r in case_results if "ms" in r and r["column"] in ("grouped_linear", "grouped_mm")]
        best_8bit = [r["ms"] for r in case_results if "ms" in r and r["column"] in FP8_PEERS]
        for r in case_results:
            if "ms" in r:
                r["x_best_grouped"] = r["ms"] / min(best) if best else None
                r["x_best_8bit_peer"] = r["ms"] / min(best_8bit) if best_8bit else None
        results += case_results

    # --- report
    print()
    print(f"D={D} F={F_} L={L}, bf16 parameters, no autocast.  Measured bf16 matmul peak {peak:.0f} TFLOP/s "
          f"(datasheet {header['datasheet_peak_bf16_tflops'] or 'n/a'}), copy {bandwidth:.0f} GB/s")
    header_row = ["case", "rows", "column", "ms", "TFLOP/s", "% peak", "x best", "x best 8-bit", "floor ms",
                  "extra GiB"]
    print(format_table([table_row(r, peak) for r in results], header_row))
    print("x best: time over the faster of grouped_linear and grouped_mm in that case; x best 8-bit: over the "
          "fastest 8-bit peer (TE's FP8 recipes, torchao).  floor: max(FLOPs / peak, 3 x weight bytes / bandwidth).")
    print("extra GiB: peak memory above what was held before the cell (activations, gradients, workspaces).")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")

    common.write_json(args.json, {"header": header, "measured_peak_bf16_tflops": peak,
                                  "measured_copy_gbs": bandwidth, "skipped": skipped, "results": results})


if __name__ == "__main__":
    main()
