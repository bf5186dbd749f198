"""Which 4-bit format for LoRA's frozen expert base: the error of each format's quantise ->
dequantise round trip, in float64, on weights drawn as Mixtral's experts' roughly are.

The formats, each a 4-bit code per value and a scale per group of values along a row (the
GEMM's reduction dim, as the NF4 base blocks them):

- `nf4`: the NF4 that ships (te_mixtral/experts/quant/nf4.py, called as the base calls it):
  16 levels at a normal distribution's quantiles, times the group's absmax (float32), 64 values
  a group. A smaller group is the same code on rows cut to the group's width (its blocks never
  cross a row).
- `int4-sym`: uniform levels -7..7 times absmax / 7 (float32), 64 a group. 15 levels, not 16:
  -8 would have no positive twin, and -7..7 puts the absmax itself on a level, as NF4 does.
- `int4-asym`: uniform levels 0..15 from the group's minimum, in steps of (max - min) / 15;
  the minimum and the step stored in float16 (GPTQ's and AWQ's scale dtype), 64 a group, so
  it spends the bits NF4 spends (a float16 pair per 64 values = one float32).
- `mxfp4`: the OCP Microscaling spec v1.0's MXFP4: E2M1 elements (+-{0, 0.5, 1, 1.5, 2, 3,
  4, 6}) times a power-of-two E8M0 scale per 32 values, 2^(floor(log2 amax) - 2) (emax of
  E2M1 is 2), rounded to nearest, ties to even, saturating at 6 (the spec's section 6.3, as
  te_mixtral/experts/quant/mxfp8.py does it for MXFP8).

The weights: rows of Mixtral-8x7B's two expert weight shapes (gate_up's rows of D = 4096,
down's of F = 14336), `--rows` of each, drawn Gaussian and, since real weights have outliers,
Student-t with 4 degrees of freedom (finite variance, heavy tails), both at unit variance
(every format here scales per group, so the scale does not matter). No real checkpoint is
read: none can be downloaded on this machine.

It reports per format the bits stored per weight (codes + scales), the relative Frobenius
error of the weights, and of y = x @ W.T for random x (`--tokens` rows of it): what a GEMM
over the dequantised weight sees. Both pooled over the two shapes.

Speed is not measured: on a GPU the dequantising kernel and a GEMM at few rows per expert are
bound by the bytes read per weight, which the table gives (bits / 8); the decode itself (a
table look-up for NF4, a multiply-add for INT4, a shift for MXFP4's scale) is a few register
operations per value beside that.

    python3 -m benchmarks.four_bit_formats [--rows 256] [--tokens 256] [--json FILE]
"""

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks import common
from te_mixtral.experts.quant.nf4 import BLOCK, dequantize_nf4, quantize_nf4
from te_mixtral.measure.report import format_table

STUDENT_T_DOF = 4
DISTRIBUTIONS = ("gaussian", f"student-t (dof {STUDENT_T_DOF})")
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes; even index = even mantissa
E2M1_EMAX = 2  # exponent of E2M1's largest value, 6 = 1.5 * 2^2
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


def in_groups(w: torch.Tensor, group: int) -> torch.Tensor:
    if w.shape[-1] % group:
        raise ValueError(f"rows of {w.shape[-1]} values do not cut into groups of {group}")
    return w.unflatten(-1, (-1, group))


def nf4_round_trip(w: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """The shipped NF4 round trip (float32 inside), with `group` <= 64 values per absmax."""
    if BLOCK % group:
        raise ValueError(f"NF4's blocks are {BLOCK} values; a group of {group} does not divide them")
    rows = in_groups(w, group)  # a row per group: at 64 the very blocks of the whole row
    packed, absmax = quantize_nf4(rows)
    return dequantize_nf4(packed, absmax, rows.shape[-1], torch.float64).reshape(w.shape)


def int4_symmetric_round_trip(w: torch.Tensor, group: int = 64) -> torch.Tensor:
    blocks = in_groups(w, group)
    scale = (blocks.abs().amax(-1, keepdim=True) / 7).float().double()  # stored in float32
    q = (blocks / torch.where(scale == 0, 1.0, scale)).round().clamp(-7, 7)
    return (q * scale).flatten(-2)


def int4_asymmetric_round_trip(w: torch.Tensor, group: int = 64) -> torch.Tensor:
    blocks = in_groups(w, group)
    low = blocks.amin(-1, keepdim=True).half().double()  # stored in float16
    step = ((blocks.amax(-1, keepdim=True) - low) / 15).half().double()
    q = ((blocks - low) / torch.where(step == 0, 1.0, step)).round().clamp(0, 15)
    return (low + q * step).flatten(-2)


def mxfp4_round_trip(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    blocks = in_groups(w, group)
    amax = blocks.abs().amax(-1, keepdim=True)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2 amax) = exponent - 1
    shared = torch.where(amax == 0, E8M0_MIN_EXP, exponent - 1 - E2M1_EMAX).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    scale = torch.exp2(shared.double())
    magnitude = (blocks / scale).abs()
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    midpoints = (grid[1:] + grid[:-1]) / 2
    # Nearest level; on a midpoint the two sides differ, and the even index (mantissa bit 0) wins.
    below, above = torch.bucketize(magnitude, midpoints), torch.bucketize(magnitude, midpoints, right=True)
    index = torch.where(below % 2 == 0, below, above)  # past 6 both are the last level: saturation
    return (grid[index] * blocks.sign() * scale).flatten(-2)


@dataclass(frozen=True)
class Format:
    name: str
    round_trip: Callable[[torch.Tensor, int], torch.Tensor]  # (w [..., I] float64, group) -> float64
    group: int
    scale_bits: int  # bits of scales per group

    def bits_per_weight(self) -> float:
        return 4 + self.scale_bits / self.group


FORMATS = (
    Format("nf4", nf4_round_trip, 64, 32),
    Format("int4-sym", int4_symmetric_round_trip, 64, 32),
    Format("int4-asym", int4_asymmetric_round_trip, 64, 2 * 16),
    Format("mxfp4", mxfp4_round_trip, 32, 8),
)


def draw_weights(distribution: str, rows: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, width] float64 at unit variance; Student-t as z / sqrt(chi2 / dof), chi2 a sum of
    `dof` squared normals (so the generator seeds it)."""
    z = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    if distribution == DISTRIBUTIONS[0]:
        return z
    chi2 = torch.randn(STUDENT_T_DOF, rows, width, generator=generator, dtype=torch.float64).square().sum(0)
    return z / (chi2 / STUDENT_T_DOF).sqrt() * math.sqrt((STUDENT_T_DOF - 2) / STUDENT_T_DOF)


def relative_errors(fmt: Format, weights: list[torch.Tensor], inputs: list[torch.Tensor]) -> dict:
    """Relative Frobenius errors of W and of y = x @ W.T, each pooled over the weights."""
    w_err = w_ref = y_err = y_ref = 0.0
    for w, x in zip(weights, inputs):
        error = fmt.round_trip(w, fmt.group) - w
        w_err, w_ref = w_err + error.square().sum().item(), w_ref + w.square().sum().item()
        y_err, y_ref = y_err + (x @ error.T).square().sum().item(), y_ref + (x @ w.T).square().sum().item()
    return {"weights": math.sqrt(w_err / w_ref), "gemm_output": math.sqrt(y_err / y_ref)}


def measure(rows: int, tokens: int, seed: int, widths: tuple[int, ...]) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    results = []
    for distribution in DISTRIBUTIONS:
        weights = [draw_weights(distribution, rows, width, generator) for width in widths]
        inputs = [torch.randn(tokens, width, generator=generator, dtype=torch.float64) for width in widths]
        for fmt in FORMATS:
            results.append({"distribution": distribution, "format": fmt.name, "group": fmt.group,
                            "bits_per_weight": fmt.bits_per_weight(), "bytes_per_weight": fmt.bits_per_weight() / 8,
                            **relative_errors(fmt, weights, inputs)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="rows drawn of each expert weight shape")
    parser.add_argument("--tokens", type=int, default=256, help="rows of x in y = x @ W.T")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=sorted(common.FAMILIES), default="8x7b")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.rows < 1 or args.tokens < 1:
        parser.error(f"--rows and --tokens must be at least 1, got {args.rows} and {args.tokens}")
    family = common.FAMILIES[args.family]
    header = common.run_header(torch.device("cpu"), rows=args.rows, tokens=args.tokens, seed=args.seed,
                               family=args.family)
    print(common.header_line(header))
    results = measure(args.rows, args.tokens, args.seed, (family.hidden, family.ffn))
    print(f"4-bit round trips in float64, {args.rows} rows of each {args.family} expert weight shape "
          f"(rows of {family.hidden} and {family.ffn}), x of {args.tokens} rows; relative Frobenius errors")
    print(format_table([(r["distribution"], r["format"], str(r["group"]), f"{r['bits_per_weight']:.3f}",
                         f"{r['bytes_per_weight']:.4f}", f"{r['weights']:.4e}", f"{r['gemm_output']:.4e}")
                        for r in results],
                       header=("weights", "format", "group", "bits/weight", "bytes/weight", "error of W",
                               "error of x @ W.T")))
    print("speed not measured: a bandwidth-bound dequantise or few-rows GEMM reads bytes/weight per weight")
    common.write_json(args.json, {"header": header, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
