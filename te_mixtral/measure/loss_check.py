"""Does a run train like its reference? Per-step loss comparison with named tolerances.

Two runs with the same seed, data and config should produce the same loss curve whatever
the expert tier, expert-parallel size or kernel, up to rounding. A faster tier is checked by
training it and the `loop` tier (the reference that stays forever) on the same batches and
comparing the losses, with relative differences

    rel_diff[step] = |loss[step] - reference[step]| / max(|reference[step]|, TINY)

Three criteria, because rounding and bugs leave different marks:
- the first step: the forward pass alone, before any update has amplified anything. It
  must agree to the precision's rounding.
- every step: rounding differences change the weights after the first update, and in a
  run from random initialisation those differences grow chaotically: in bf16, correct
  tiers differ from `loop` by several percent at single late steps, in both directions.
  So the per-step bound is loose in low precision: it catches a run that blows up or
  stops learning.
- the mean loss over the compared steps: chaos moves single steps both ways and averages
  out, a bug (a missing gradient, a wrong routing weight) shifts the whole curve one way.
  In bf16 the correct tiers' mean losses stay within a couple of percent of `loop`'s.

The measurements behind the bf16 tolerances, and the GPU checks made since:
docs/results/2026-11-21-checks-behind-tolerances.md.

Only the first min(len(losses), len(reference)) steps are compared, so a long reference
serves shorter runs and the reverse; comparing zero steps is an error, not a pass. Any NaN or
infinity fails the check: in the compared steps of either run, or anywhere in the run's own
losses (a run that diverges after the reference ends has still diverged). A reference that
could only fail (empty, or diverged within the steps the run will compare) is refused by
`check_reference` before training, not after it.

The losses compared are the language-model loss alone (results.json's `losses`), not the
training loss with the router's terms: the LM loss is what a user reads, it has the same
meaning whatever the router coefficients, and references recorded before the router losses
existed stay usable. Two runs with different router coefficients train differently, and
the check sees it in the LM loss; runs that must agree are run with the same coefficients
(a workload key, so the results pages keep them apart). The router's own losses are in
`aux_losses` and `z_losses` beside it.

This module does not import torch: it runs on a laptop against two results.json files.
"""

import math
from dataclasses import asdict, dataclass

from te_mixtral.errors import UserError
from te_mixtral.measure.report import format_table


@dataclass(frozen=True)
class Tolerance:
    first_step: float  # the forward pass, before any update
    per_step: float  # any single step
    mean: float  # the mean loss over the compared steps


TOLERANCES = {
    # Same math, different summation order (a grouped GEMM versus a loop, an all-to-all
    # reordering rows): ~1e-7 per operation, grown by tens of optimizer steps. Bugs show up
    # at 1e-2 and above, so 1e-4 has room for rounding and none for a bug.
    "fp32": Tolerance(first_step=1e-5, per_step=1e-4, mean=1e-4),
    # 8 significant bits: every rounding can move a value by 2^-9 (0.2 %). First steps land
    # well below 2e-3 of `loop` on GPUs; later steps as the module docstring says.
    "bf16": Tolerance(first_step=2e-3, per_step=1e-1, mean=3e-2),
    # E4M3 keeps 4 significant bits (2^-4 = 6 % per rounding, averaged down over a dot
    # product), and the scales differ by recipe (per-row on Hopper, per-32-element blocks
    # for MXFP8) on top of everything bf16 already does.
    "fp8": Tolerance(first_step=1e-2, per_step=1.5e-1, mean=5e-2),
    "mxfp8": Tolerance(first_step=1e-2, per_step=1.5e-1, mean=5e-2),
}

# Guards the division for a reference loss of zero; real losses are far above it.
TINY = 1e-12


@dataclass
class LossCheck:
    """The verdict, and the numbers behind it. Steps count from 0 (index into `losses`)."""

    passed: bool
    tolerance: Tolerance
    max_rel_diff: float  # NaN when a non-finite loss made the differences meaningless
    worst_step: int  # the first non-finite step if there is one, else the largest difference
    first_step_diff: float
    mean_diff: float  # relative difference of the mean losses
    losses: list[float]
    reference: list[float]

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        if math.isnan(self.max_rel_diff):
            return f"loss check {verdict}: non-finite loss at step {self.worst_step}"
        t = self.tolerance
        return (f"loss check {verdict}: {len(self.losses)} steps; first step {self.first_step_diff:.1e} "
                f"(<= {t.first_step:.0e}), max step {self.max_rel_diff:.1e} at step {self.worst_step} "
                f"(<= {t.per_step:.0e}), mean {self.mean_diff:.1e} (<= {t.mean:.0e})")

    def table(self) -> str:
        """Every compared step, then the verdict line."""
        rows = []
        for step, (loss, ref) in enumerate(zip(self.losses, self.reference)):
            rel = _rel_diff(loss, ref)
            limit = self.tolerance.first_step if step == 0 else self.tolerance.per_step
            ok = "ok" if rel <= limit else "FAIL"  # NaN compares False: FAIL
            rows.append((str(step), f"{loss:.6f}", f"{ref:.6f}", f"{rel:.2e}", ok))
        table = format_table(rows, header=("step", "loss", "reference", "rel diff", "ok"))
        return f"{table}\n{self.summary()}"

    def record(self) -> dict:
        """The JSON form results.json keeps."""
        return {"passed": self.passed, "max_rel_diff": self.max_rel_diff, "worst_step": self.worst_step,
                "first_step_diff": self.first_step_diff, "mean_diff": self.mean_diff,
                "tolerance": asdict(self.tolerance)}


def _rel_diff(loss: float, ref: float) -> float:
    return abs(loss - ref) / max(abs(ref), TINY)


def _tolerance(precision: str) -> Tolerance:
    if precision not in TOLERANCES:
        raise UserError(f"no loss tolerance for precision '{precision}' (known: {', '.join(TOLERANCES)})")
    return TOLERANCES[precision]


def check_reference(reference: list[float], steps: int, precision: str, where: str) -> None:
    """Before training `steps` steps: raise a one-line `UserError` if the reference read from
    `where` could only make the check fail or error, whatever the run does."""
    _tolerance(precision)
    if not reference:
        raise UserError(f"loss-check reference {where} has no losses to compare with")
    bad = next((i for i, x in enumerate(reference[:steps]) if not math.isfinite(x)), None)
    if bad is not None:
        raise UserError(f"loss-check reference {where} has a non-finite loss at step {bad + 1} (a diverged run); "
                        f"compare with a run that finished")


def check_losses(losses: list[float], reference: list[float], precision: str) -> LossCheck:
    """Compare `losses` with `reference` at `precision`'s tolerances."""
    tolerance = _tolerance(precision)
    steps = min(len(losses), len(reference))
    if steps == 0:
        raise UserError(
            f"loss check has nothing to compare: the run has {len(losses)} steps, the reference {len(reference)}"
        )
    compared, ref = [float(x) for x in losses[:steps]], [float(x) for x in reference[:steps]]

    non_finite = [i for i in range(steps) if not (math.isfinite(compared[i]) and math.isfinite(ref[i]))]
    non_finite += [i for i in range(steps, len(losses)) if not math.isfinite(losses[i])]
    if non_finite:
        return LossCheck(False, tolerance, math.nan, non_finite[0], math.nan, math.nan, compared, ref)

    diffs = [_rel_diff(a, b) for a, b in zip(compared, ref)]
    worst = max(range(steps), key=diffs.__getitem__)
    mean_diff = _rel_diff(math.fsum(compared), math.fsum(ref))
    passed = diffs[0] <= tolerance.first_step and diffs[worst] <= tolerance.per_step and mean_diff <= tolerance.mean
    return LossCheck(passed, tolerance, diffs[worst], worst, diffs[0], mean_diff, compared, ref)
