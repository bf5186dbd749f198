"""Where FP8 starts to pay: `device_mxfp8` (mode `fp8-hopper`, FP8 at every size) against the
BF16 `custom_grouped` tier, expert FFN forward + backward, by rows per local expert.

This picks `fp8.min_rows_per_expert`, the size under which the tier runs the BF16 kernels.
The cell is `benchmarks/expert_ffn.py`'s: 4 local experts, uniform rows, bf16 inputs and
weights, an (empty) optimizer step after every step, so the FP8 weights are made again in
every step, as with one micro-batch per optimizer step. `x bf16` is the BF16 time over the
FP8 time (above 1: FP8 is faster).

    python3 -m benchmarks.fp8_break_even [--json results.json]

Needs a Hopper GPU.
"""

import argparse
import sys

import torch

from benchmarks import common
from benchmarks.common import LOCAL_EXPERTS
from benchmarks.expert_ffn import FULL, Case, run_header, time_cell
from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.measure.report import format_table

ROWS_PER_EXPERT = (512, 1024, 1536, 2048, 2560, 3072, 4096)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    device = common.cuda_or_refuse("fp8_break_even")
    if device is None:
        return 2
    fp8 = DeviceMXFP8Tier("fp8-hopper", min_rows_per_expert=0)
    fp8.check_available(device)
    columns = {"custom_grouped": CustomGroupedTier(), "device_mxfp8": fp8}
    header, rows = run_header(device, FULL["8x7b"]), []
    print(common.header_line(header))
    print(f"FP8 break-even on {header['device']}, {header['date']}", flush=True)
    for family, sizes in FULL.items():
        L, D, F_ = LOCAL_EXPERTS, sizes.hidden, sizes.ffn
        weights = ((torch.randn(L, 2 * F_, D, device=device) * D**-0.5).to(torch.bfloat16).requires_grad_(),
                   (torch.randn(L, D, F_, device=device) * F_**-0.5).to(torch.bfloat16).requires_grad_())
        for per_expert in ROWS_PER_EXPERT:
            case = Case(f"uniform {per_expert}", [per_expert] * L)
            ms = {name: time_cell(ffn, case, weights, sizes, device)["ms"] for name, ffn in columns.items()}
            rows.append({"family": family, "rows_per_expert": per_expert, **ms,
                         "x_bf16": ms["custom_grouped"] / ms["device_mxfp8"]})
            print(f"  {family} {per_expert:5d} rows/expert  bf16 {ms['custom_grouped']:.2f} ms  "
                  f"fp8 {ms['device_mxfp8']:.2f} ms", flush=True)
        del weights
    print(format_table([[r["family"], str(r["rows_per_expert"]), f"{r['custom_grouped']:.2f}",
                         f"{r['device_mxfp8']:.2f}", f"{r['x_bf16']:.2f}"] for r in rows],
                       ["family", "rows/expert", "custom_grouped ms", "device_mxfp8 ms", "x bf16"]))
    common.write_json(args.json, {"header": header, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
