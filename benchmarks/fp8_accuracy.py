"""How far each 8-bit expert FFN lands from float64: ours on Hopper beside TE's FP8 recipes.

Shape suffixes: see te_mixtral/__init__.py.

The expert SwiGLU MLP at Mixtral-8x7B sizes (D 4096, F 14336) over 4 local experts, with
bf16 inputs and weights, forward and backward. The reference is the `loop` tier run in
float64 on the same values; each column's output and three gradients are compared with it
as relative Frobenius errors, ||got - ref|| / ||ref||. Columns:

- `custom_grouped`: our BF16 kernels, the error BF16 itself brings;
- `device_mxfp8` in mode `fp8-hopper` (E4M3, a scale per row and per column), FP8 at every size;
- the 8-bit peers of `benchmarks/peers.py`: TE `GroupedLinear` under `Float8CurrentScaling`,
  `Float8BlockScaling` and `DelayedScaling`, and torchao's FP8 row-wise MoE GEMM, each where
  this machine runs it.

Every column runs four times on the same inputs and the last is measured, so that
`DelayedScaling` works from an amax history rather than its initial scale.

    python3 -m benchmarks.fp8_accuracy [--tokens-per-expert 1024]

Needs a Hopper GPU; the TE columns need Transformer Engine.
"""

import argparse
import sys

import torch

from benchmarks import common
from benchmarks.common import FAMILIES, LOCAL_EXPERTS, first_line
from benchmarks.peers import FP8_PEERS
from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.experts.loop import LoopTier
from te_mixtral.measure.report import format_table

D, F, L = FAMILIES["8x7b"].hidden, FAMILIES["8x7b"].ffn, LOCAL_EXPERTS
RUNS = 4
NAMES = ("y", "dx", "d_gate_up", "d_down")


def inputs(tokens_per_expert: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    rows = L * tokens_per_expert
    counts = torch.full((L,), tokens_per_expert, device="cuda", dtype=torch.int64)
    return (randn(rows, D), counts, randn(L, 2 * F, D, scale=D**-0.5), randn(L, D, F, scale=F**-0.5),
            randn(rows, D))


def outputs(ffn, x, counts, gate_up, down, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate_up, down)]
    y = ffn(leaves[0], counts, leaves[1], leaves[2])
    return (y.detach(), *torch.autograd.grad(y, leaves, dy.to(y.dtype)))


def columns() -> tuple[dict, dict]:
    fp8 = DeviceMXFP8Tier("fp8-hopper")  # min_rows_per_expert=0: FP8 at every size
    fp8.check_available(torch.device("cuda"))
    found, skipped = {"custom_grouped": CustomGroupedTier(), "device_mxfp8 (fp8-rowwise)": fp8}, {}
    for name, build in FP8_PEERS.items():
        try:
            found[name] = build()
        except Exception as error:  # noqa: BLE001 - a library this machine lacks is a skipped column
            skipped[name] = first_line(error)
    return found, skipped


def rel_err(got, ref) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-expert", type=int, default=1024)
    args = parser.parse_args(argv)
    device = common.cuda_or_refuse("fp8_accuracy")
    if device is None:
        return 2
    print(common.header_line(common.run_header(device)))
    x, counts, gate_up, down, dy = inputs(args.tokens_per_expert)
    ref = outputs(LoopTier(), x.double(), counts, gate_up.double(), down.double(), dy.double())
    found, skipped = columns()
    rows = []
    for name, ffn in found.items():
        try:
            for _ in range(RUNS):
                got = outputs(ffn, x, counts, gate_up, down, dy)
        except Exception as error:  # noqa: BLE001 - one recipe this build cannot run must not end the run
            skipped[name] = first_line(error)
            continue
        rows.append([name, *(f"{rel_err(g, r):.2e}" for g, r in zip(got, ref))])
    print(f"{L} experts x {args.tokens_per_expert} tokens, D={D}, F={F}, bf16 inputs and weights; relative error against float64 `loop`")
    print(format_table(rows, ["column", *NAMES]))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
