"""Where FP8 starts to pay: `device_mxfp8` (mode `fp8-hopper`, FP8 at every size) against the
BF16 `custom_grouped` tier, expert FFN forward + backward, by rows per local expert.

This picks `fp8.min_rows_per_expert`, the size under which the tier runs the BF16 kernels, and
prints the break-even it finds: the fewest rows per expert from which FP8 is faster at every
size measured (`break_even`). Two sweeps:

- **4 local experts** (EP=2 of Mixtral's 8), 8x7B and 8x22B shapes, 256 to 4096 rows per
  expert: where the break-even lies.
- **Few rows, one local expert** (EP=8), 8x7B shapes, 16 to 4096 rows: the points of the
  kernel grid (`benchmarks/custom_grouped_grid.py`) where FP8 at every size ran up to four
  times slower than BF16, and on to the rows at which the default runs FP8 at one expert (four
  times the threshold: `device_mxfp8.runs_fp8`). Beside FP8 at every size it times the tier as a run builds it by
  default (`device_mxfp8`, mode `auto`, the default `fp8.min_rows_per_expert`: BF16 under
  it), and LoRA's frozen bases, which train no expert weight: BF16 through `custom_grouped`
  against FP8 (quantised once as they load; the tier runs FP8 at every size over them, having
  no BF16 copy).

The cell is `benchmarks/expert_ffn.py`'s: uniform rows, bf16 inputs and weights, an (empty)
optimizer step after every step, so the FP8 weights are made again in every step, as with
one micro-batch per optimizer step; the median of many steps, each between CUDA events, so
a step's host time counts where the GPU waits for it, as a training step sees it. With a
frozen base only x gets a gradient. `x bf16` is the BF16 time over the other column's
(above 1: faster than BF16).

    python3 -m benchmarks.fp8_break_even [--json results.json]

Needs a Hopper GPU.
"""

import argparse
import sys

import torch

from benchmarks import common
from benchmarks.common import LOCAL_EXPERTS
from benchmarks.expert_ffn import FULL, Case, input_sets, run_header, time_cell
from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.experts.options import FP8Options
from te_mixtral.measure.report import format_table

ROWS_PER_EXPERT = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)
FEW_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # one local expert, 8x7B
DEFAULT_MIN_ROWS = FP8Options().min_rows_per_expert


def break_even(points: list[tuple[int, float]]) -> int | None:
    """The fewest rows per expert from which the other column is faster than BF16 at every
    point measured (`points`: (rows per expert, BF16 time over its time)); None where it is
    not faster at the largest."""
    found = None
    for rows, x_bf16 in sorted(points, reverse=True):
        if x_bf16 <= 1:
            break
        found = rows
    return found


def random_weights(experts: int, sizes, device: torch.device, trains: bool = True):
    """Stacked bf16 expert weights (gate_up, down), scaled by 1/sqrt(fan-in)."""
    L, D, F_ = experts, sizes.hidden, sizes.ffn
    return ((torch.randn(L, 2 * F_, D, device=device) * D**-0.5).to(torch.bfloat16).requires_grad_(trains),
            (torch.randn(L, D, F_, device=device) * F_**-0.5).to(torch.bfloat16).requires_grad_(trains))


def time_frozen_cell(ffn, case: Case, weights, sizes, device: torch.device) -> float:
    """Median ms of a step over a frozen base: forward, then x's gradient alone."""
    tokens_per_expert_L = torch.tensor(case.splits, dtype=torch.int64, device=device)
    buffers, counter = input_sets(sum(case.splits), sizes, device), iter(range(10**9))

    def step():
        x_RD, dy_RD = buffers[next(counter) % len(buffers)]
        torch.autograd.grad(ffn(x_RD, tokens_per_expert_L, *weights), x_RD, dy_RD)

    return common.median_ms(step, device)


def fp8_base(tier: DeviceMXFP8Tier, weights, device: torch.device):
    """`weights` as the tier holds a frozen LoRA base: FP8 values and row scales."""
    with torch.device(device):
        return tuple(tier.expert_weight(w.shape, frozen=True).copy_(w.detach()) for w in weights)


def report_break_even(label: str, points: list[tuple[int, float]]) -> int | None:
    found = break_even(points)
    measured = ", ".join(f"{rows} {x:.2f}" for rows, x in sorted(points))
    where = (f"FP8 faster from {found} rows per expert on" if found is not None
             else "FP8 not faster at the largest size measured")
    print(f"break-even, {label}: {where} (x bf16 by rows: {measured})", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    device = common.cuda_or_refuse("fp8_break_even")
    if device is None:
        return 2
    fp8 = DeviceMXFP8Tier("fp8-hopper", min_rows_per_expert=0)
    default = DeviceMXFP8Tier("auto", min_rows_per_expert=DEFAULT_MIN_ROWS)
    lora_fp8 = DeviceMXFP8Tier("fp8-hopper")  # holds the frozen FP8 base
    try:
        for tier in (fp8, default, lora_fp8):
            tier.check_available(device)
    except TierUnavailable as error:
        print(f"fp8_break_even: error: {error}", file=sys.stderr)
        return 2
    bf16 = CustomGroupedTier()
    header, rows, few = run_header(device, FULL["8x7b"]), [], []
    print(common.header_line(header))
    print(f"FP8 break-even on {header['device']}, {header['date']}; default fp8.min_rows_per_expert "
          f"{DEFAULT_MIN_ROWS}", flush=True)

    # --- 4 local experts: where FP8 starts to pay
    for family, sizes in FULL.items():
        weights = random_weights(LOCAL_EXPERTS, sizes, device)
        for per_expert in ROWS_PER_EXPERT:
            case = Case(f"uniform {per_expert}", [per_expert] * LOCAL_EXPERTS)
            ms = {name: time_cell(ffn, case, weights, sizes, device)["ms"]
                  for name, ffn in (("custom_grouped", bf16), ("device_mxfp8", fp8))}
            rows.append({"family": family, "rows_per_expert": per_expert, **ms,
                         "x_bf16": ms["custom_grouped"] / ms["device_mxfp8"]})
            print(f"  {family} x{LOCAL_EXPERTS} {per_expert:5d} rows/expert  bf16 {ms['custom_grouped']:.2f} ms  "
                  f"fp8 {ms['device_mxfp8']:.2f} ms", flush=True)
        del weights

    # --- one local expert, few rows: FP8 always, the default, and LoRA's frozen bases
    sizes = FULL["8x7b"]
    weights = random_weights(1, sizes, device)
    frozen_bf16 = tuple(w.detach() for w in weights)
    frozen_fp8 = fp8_base(lora_fp8, weights, device)
    for per_expert in FEW_ROWS:
        case = Case(f"uniform {per_expert}", [per_expert])
        ms = {name: time_cell(ffn, case, weights, sizes, device)["ms"]
              for name, ffn in (("custom_grouped", bf16), ("device_mxfp8", fp8), ("device_mxfp8_default", default))}
        ms["lora_bf16_base"] = time_frozen_cell(bf16, case, frozen_bf16, sizes, device)
        ms["lora_fp8_base"] = time_frozen_cell(lora_fp8, case, frozen_fp8, sizes, device)
        few.append({"family": "8x7b", "local_experts": 1, "rows_per_expert": per_expert, **ms,
                    "x_bf16": ms["custom_grouped"] / ms["device_mxfp8"],
                    "default_x_bf16": ms["custom_grouped"] / ms["device_mxfp8_default"],
                    "lora_x_bf16": ms["lora_bf16_base"] / ms["lora_fp8_base"]})
        print(f"  8x7b x1 {per_expert:5d} rows  bf16 {ms['custom_grouped']:.2f} ms  fp8 {ms['device_mxfp8']:.2f}  "
              f"default {ms['device_mxfp8_default']:.2f}  lora bf16 base {ms['lora_bf16_base']:.2f}  "
              f"lora fp8 base {ms['lora_fp8_base']:.2f}", flush=True)

    # --- report
    print(format_table([[r["family"], str(r["rows_per_expert"]), f"{r['custom_grouped']:.2f}",
                         f"{r['device_mxfp8']:.2f}", f"{r['x_bf16']:.2f}"] for r in rows],
                       ["family", "rows/expert", "custom_grouped ms", "device_mxfp8 ms", "x bf16"]))
    print(format_table([[str(r["rows_per_expert"]), f"{r['custom_grouped']:.2f}", f"{r['device_mxfp8']:.2f}",
                         f"{r['device_mxfp8_default']:.2f}", f"{r['default_x_bf16']:.2f}",
                         f"{r['lora_bf16_base']:.2f}", f"{r['lora_fp8_base']:.2f}", f"{r['lora_x_bf16']:.2f}"]
                        for r in few],
                       ["rows, 1 expert", "custom_grouped ms", "FP8 always ms", "default ms", "default x bf16",
                        "LoRA bf16 base ms", "LoRA fp8 base ms", "LoRA x bf16"]))
    found = {f"{family}, {LOCAL_EXPERTS} local experts": report_break_even(
        f"{family}, {LOCAL_EXPERTS} local experts",
        [(r["rows_per_expert"], r["x_bf16"]) for r in rows if r["family"] == family]) for family in FULL}
    found["8x7b, 1 local expert"] = report_break_even(
        "8x7b, 1 local expert", [(r["rows_per_expert"], r["x_bf16"]) for r in few])
    found["8x7b, 1 local expert, LoRA frozen base"] = report_break_even(
        "8x7b, 1 local expert, LoRA frozen base", [(r["rows_per_expert"], r["lora_x_bf16"]) for r in few])
    common.write_json(args.json, {"header": header, "default_min_rows_per_expert": DEFAULT_MIN_ROWS,
                                  "rows": rows, "few_rows": few, "break_even": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
