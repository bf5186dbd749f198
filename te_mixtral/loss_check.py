"""Does a run train like its reference? Step-by-step loss comparison with named tolerances.

Two runs with the same seed, data and config should produce the same loss curve whatever
the expert tier, expert-parallel size or kernel, up to rounding. A faster tier is checked by
training it and the `loop` tier (the reference that stays forever) and comparing losses
step by step:

    rel_diff[step] = |loss[step] - reference[step]| / max(|reference[step]|, TINY)

The check passes when every compared step is finite and within the precision's tolerance.
Losses, not weights, are compared because a bug anywhere (routing, a missing gradient, a
wrong all-to-all split) shows up in the loss within a few steps, and one number per step is
something a person can read in a table.

Only the first min(len(losses), len(reference)) steps are compared, so a long reference
serves shorter runs and the reverse; comparing zero steps is an error, not a pass. Any NaN or
infinity fails the check: in the compared steps of either run, or anywhere in the run's own
losses (a run that diverges after the reference ends has still diverged).

This module does not import torch: it runs on a laptop against two results.json files.
"""

import math
from dataclasses import dataclass

from te_mixtral.errors import UserError
from te_mixtral.report import format_table

# Relative tolerance on the loss of every step, by the precision the run computes in.
TOLERANCES = {
    # Same math, different summation order (a grouped GEMM versus a loop, an all-to-all
    # reordering rows): ~1e-7 per operation, grown by tens of optimizer steps. Bugs show up
    # at 1e-2 and above, so 1e-4 has room for rounding and none for a bug.
    "fp32": 1e-4,
    # 8 significant bits (7 stored): every rounding can move a value by up to 2^-8 (0.4 %),
    # kernels round at different points, and the differences compound through Adam's updates.
    # Measured: `hf` against `loop`, reduced-layer Mixtral-8x7B, 20 steps from random init on
    # one H200 (2026-11-21) differed by up to 3.2e-2 (early steps, where the loss falls from
    # 11 to 6 and small differences grow fastest). A routing or gradient bug moves the loss
    # by tens of percent.
    "bf16": 5e-2,
    # E4M3 keeps 4 significant bits (2^-4 = 6 % per rounding, averaged down over a dot
    # product), and the scales differ by recipe (per-tensor delayed or current scaling,
    # per-32-element blocks for MXFP8), so two runs quantise the same tensor differently on
    # top of everything bf16 already does.
    "fp8": 8e-2,
    "mxfp8": 8e-2,
}

# Guards the division for a reference loss of zero; real losses are far above it.
TINY = 1e-12


@dataclass
class LossCheck:
    """The verdict, and the numbers behind it. Steps count from 0 (index into `losses`)."""

    passed: bool
    tolerance: float
    max_rel_diff: float  # NaN when a non-finite loss made the difference meaningless
    worst_step: int  # the first non-finite step if there is one, else the largest difference
    losses: list[float]
    reference: list[float]

    def table(self) -> str:
        """Every compared step, then a verdict line."""
        rows = []
        for step, (loss, ref) in enumerate(zip(self.losses, self.reference)):
            rel = _rel_diff(loss, ref)
            ok = "ok" if rel <= self.tolerance else "FAIL"  # NaN compares False: FAIL
            rows.append((str(step), f"{loss:.6f}", f"{ref:.6f}", f"{rel:.2e}", ok))
        verdict = "passed" if self.passed else "FAILED"
        if math.isnan(self.max_rel_diff):
            worst = f"non-finite loss at step {self.worst_step}"
        else:
            worst = f"max rel diff {self.max_rel_diff:.2e} at step {self.worst_step}"
        summary = f"loss check {verdict}: {len(rows)} steps, {worst}, tolerance {self.tolerance:.0e}"
        table = format_table(rows, header=("step", "loss", "reference", "rel diff", "ok"))
        return f"{table}\n{summary}"


def _rel_diff(loss: float, ref: float) -> float:
    return abs(loss - ref) / max(abs(ref), TINY)


def check_losses(losses: list[float], reference: list[float], precision: str) -> LossCheck:
    """Compare `losses` with `reference` step by step at `precision`'s tolerance."""
    if precision not in TOLERANCES:
        raise UserError(f"no loss tolerance for precision '{precision}' (known: {', '.join(TOLERANCES)})")
    steps = min(len(losses), len(reference))
    if steps == 0:
        raise UserError(
            f"loss check has nothing to compare: the run has {len(losses)} steps, the reference {len(reference)}"
        )
    compared, ref = [float(x) for x in losses[:steps]], [float(x) for x in reference[:steps]]
    tolerance = TOLERANCES[precision]

    non_finite = [i for i in range(steps) if not (math.isfinite(compared[i]) and math.isfinite(ref[i]))]
    non_finite += [i for i in range(steps, len(losses)) if not math.isfinite(losses[i])]
    if non_finite:
        return LossCheck(False, tolerance, math.nan, non_finite[0], compared, ref)

    diffs = [_rel_diff(a, b) for a, b in zip(compared, ref)]
    worst = max(range(steps), key=diffs.__getitem__)
    return LossCheck(diffs[worst] <= tolerance, tolerance, diffs[worst], worst, compared, ref)
