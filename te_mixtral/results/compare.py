"""What a results page compares, and what it refuses to (`pages.py` lays the page out).

A row's speedup over `hf` (or `loop`) is
that baseline's median step time over the row's, and it is computed only against a
baseline run of the *same workload*: the same model, data, batch, steps and precision (the
config's `workload_keys()`, the keys that change the timed work). A baseline with
the row's EP size is preferred. When a page holds several workloads they are lettered A,
B, ..., a warning lists what differs, and a row with no same-workload baseline shows "-"
rather than a misleading ratio. Missing `hf` or `loop` runs are said so, not hidden.

Loss checks are recomputed for the page: each run's losses against the same-workload `loop`
run on it, by today's `te_mixtral/measure/loss_check.py` (first step, largest step, mean). Where the
run's own recorded verdict differs, a note under the table says so. Activation recompute
changes how much a step computes, not what it computes, so with no `loop` run of the same
workload a run is checked against one that differs from it in `train.recompute` alone (`loop`
keeps more for its backward and may only fit with recompute), and the cell says so.
"""

import math
from dataclasses import dataclass

from te_mixtral.config import settings, workload_keys
from te_mixtral.experts.registry import DEFAULT_BASELINE, REFERENCE_TIER
from te_mixtral.measure.loss_check import check_losses
from te_mixtral.results.runs import Run
from te_mixtral.saved_config import flatten, upgrade_saved

# What every row's speed is compared with: the whole-model baseline as transformers' users
# run it, and the reference tier. (`hf_eager` is a row like any tier.)
COMPARED_WITH = (DEFAULT_BASELINE, REFERENCE_TIER)
DASH = "-"


def letter(index: int) -> str:
    """Workload names: A, B, ..., Z, then 27, 28, ..."""
    return chr(ord("A") + index) if index < 26 else str(index + 1)


def workload(run: Run) -> dict:
    """What the timed steps compute: the config's `workload_keys()`, plus the precision.
    A key today's config no longer knows counts as workload: it changed something once."""
    config = flatten(upgrade_saved(run.header["config"], run.source))
    flat = {k: v for k, v in config.items() if k in workload_keys() or k not in settings()}
    return {**flat, "precision": run.header["precision"]}


def differences(a: dict, b: dict) -> list[str]:
    """`key: a -> b` for every key whose value differs (or exists on one side only)."""
    keys = list(a) + [k for k in b if k not in a]
    return [f"{k}: {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in keys if a.get(k) != b.get(k)]


def assign_workloads(runs: list[Run]) -> list[dict]:
    """Letter each run's workload A, B, ... in page order; return the distinct workloads."""
    seen: list[dict] = []
    for run in runs:
        w = workload(run)
        if w not in seen:
            seen.append(w)
        run.workload = letter(seen.index(w))
    return seen


# Settings that change how fast a step runs, not what it computes (so not the workload), and
# that an A/B varies: a row whose peers differ in one is labelled by it.
HOW_IT_RAN = ("ep_placement", "ep_chunks", "ep_capacity", "te_fusions")


def how_it_ran(run: Run, key: str) -> str:
    if key == "ep_placement":  # as it placed them: a placement may move no expert, or be turned off
        load = run.results.get("expert_load")
        return "placed" if isinstance(load, dict) and load.get("placement") else "in order"
    return f"{key} {flatten(upgrade_saved(run.header['config'], run.source)).get(key, settings()[key].default)}"


def assign_labels(runs: list[Run]) -> None:
    """A row's label: the tier, plus EP size, workload, `HOW_IT_RAN` and time only where the
    tier's runs differ in them."""
    for run in runs:
        peers = [r for r in runs if r.tier == run.tier]
        label = run.tier
        if len({r.ep_size for r in peers}) > 1:
            label += f" EP{run.ep_size}"
        if len({r.workload for r in peers}) > 1:
            label += f" [{run.workload}]"
        peers = [r for r in peers if r.ep_size == run.ep_size and r.workload == run.workload]
        for key in HOW_IT_RAN:
            if len({how_it_ran(r, key) for r in peers}) > 1:
                label += f" {how_it_ran(run, key)}"
                peers = [r for r in peers if how_it_ran(r, key) == how_it_ran(run, key)]
        if len(peers) > 1:
            label += f" {run.date:%m-%d %H:%M:%S}"
        run.label = label
    labels = [r.label for r in runs]
    for index, run in enumerate(runs):
        if labels.count(run.label) > 1:  # started in the same second: number them
            run.label += f" #{labels[:index].count(labels[index]) + 1}"


def _nearest(run: Run, candidates: list[Run]) -> Run | None:
    """Of `candidates`, the one with `run`'s EP size if any, newest first."""
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r.ep_size != run.ep_size, -r.date.timestamp()))


def baseline_for(run: Run, tier: str, runs: list[Run]) -> Run | None:
    """The `tier` run this row is compared with: same workload; same EP size if any; newest."""
    return _nearest(run, [r for r in runs if r.tier == tier and r.workload == run.workload])


# Workload keys that change how a step is computed but not its losses.
SAME_LOSSES = ("train.recompute",)


def loss_reference(run: Run, runs: list[Run]) -> Run | None:
    """The `loop` run a row's losses are checked against: of the same workload if there is
    one, else one that differs from it only in `SAME_LOSSES`."""
    reference = baseline_for(run, REFERENCE_TIER, runs)
    if reference is not None:
        return reference

    def losses_key(r: Run) -> dict:
        return {k: v for k, v in workload(r).items() if k not in SAME_LOSSES}

    wanted = losses_key(run)
    return _nearest(run, [r for r in runs if r.tier == REFERENCE_TIER and losses_key(r) == wanted])


def speedup(run: Run, baseline: Run | None) -> float | None:
    """How many times faster `run`'s median step is than `baseline`'s."""
    if baseline is None:
        return None
    return baseline.summary["median_step_ms"] / run.summary["median_step_ms"]


@dataclass
class Verdict:
    """A run's loss check against the page's `loop` run, by today's `loss_check.py`."""

    cell: str  # the table cell
    failed: bool
    note: str | None  # said under the table when the run's own recorded verdict differs


def loss_verdict(run: Run, runs: list[Run]) -> Verdict:
    """Re-check the run's losses against the same-workload `loop` run on this page.

    Re-checking (rather than quoting what the run recorded) judges every row by the same,
    current criteria, also runs made before a tolerance changed.
    """
    if run.tier == REFERENCE_TIER:
        return Verdict("reference", False, None)
    reference = loss_reference(run, runs)
    if reference is None:
        return Verdict(f"not checked: no `{REFERENCE_TIER}` run of this workload", False, None)
    against = ""
    if reference.workload != run.workload:
        against = f" (against `{REFERENCE_TIER}` [{reference.workload}], {'; '.join(differences(workload(reference), workload(run)))})"
    # An 8-bit tier records the precision its experts ran in under `ran`; train.py checks it
    # at that precision's tolerance, and so does the page.
    precision = run.header.get("ran", {}).get("precision", run.header["precision"])
    check = check_losses(run.results["losses"], reference.results["losses"], precision)
    if math.isnan(check.max_rel_diff):
        cell = f"**FAILED**: non-finite loss at step {check.worst_step}"
    else:
        cell = (f"{'passed' if check.passed else '**FAILED**'}{against}: first {check.first_step_diff:.1e}, "
                f"max {check.max_rel_diff:.1e} (step {check.worst_step}), mean {check.mean_diff:.1e}")
    recorded = run.results.get("loss_check")
    note = None
    if recorded is not None and recorded["passed"] != check.passed:
        note = (f"`{run.label}`: the run's own check recorded {'passed' if recorded['passed'] else 'FAILED'} "
                f"(at the tolerances of its day); today's `te_mixtral/measure/loss_check.py` says "
                f"{'passed' if check.passed else 'FAILED'}.")
    return Verdict(cell, not check.passed, note)
