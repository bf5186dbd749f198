"""The end of a run: what its steps measured, gathered into the files it leaves and the
tables rank 0 prints.

`report_run` is the training loop's last phase (training/loop.py). It is handed what the
steps measured as one `Measured` (losses, step times, FLOPs, peak memory, evaluations, why
the run stopped, if it did) and what the run's setup left (its header, the memory estimate,
the output folder, the step log, the loss-check reference), and

- holds the losses to the loss-check reference (`measure/loss_check.py`), on every rank
  alike, so that every rank exits with the same code;
- on rank 0, writes `results.json` (`measure/report.py` says what it holds) and the run's
  whole config as `config.yaml` beside it, closes the step log and draws its plots
  (`measure/run_log.py`), then prints the timing table, the evaluations, the generated
  text, the phase table and the loss check, and last the path of results.json.

Whatever can still be written is: a full disk may take a plot and not results.json. What
could not be written is said in one line at the end (`WriteFailed`, the run exits
WRITE_FAILED), with the reason the run stopped early, if it did.

What runs the model again (the generated text, the phase profile) or needs every rank
(the peak memory by rank) is measured by the loop before this is called: it keeps the
order in which they add to the peak memory and to the tier's calls.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from te_mixtral.config import RunConfig, save_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.errors import ExitCode, UserError, WriteFailed
from te_mixtral.files import write_failure
from te_mixtral.measure import expert_load, metrics, report
from te_mixtral.measure.loss_check import check_losses
from te_mixtral.measure.run_log import RunLog
from te_mixtral.training.checkpoint import TrainState
from te_mixtral.training.evaluate import evaluations_table
from te_mixtral.training.outputs import CONFIG_FILE


@dataclass
class Measured:
    """What this process's steps measured, and what the loop measures after them (in the
    order that the module docstring's last paragraph gives)."""

    state: TrainState  # the losses, gradient norms, router statistics and evaluations of every step so far
    first_step: int  # this process's first step (counted from 1; a resumed run starts later)
    step_times_s: list[float]  # this process's step times, from first_step
    flops_per_step: list[float]  # over all ranks
    run_load_YE: torch.Tensor | None  # tokens per layer and expert over this process's steps
    stopped: UserError | None  # why the run stopped early, if it did (then no phases, no generated text)
    generated: dict | None = None  # `generate_text`'s answer, when asked for
    exchange: dict = field(default_factory=dict)  # the padded exchange's capacity over the run (ExchangeCapacity.record)
    placement: ExpertPlacement | None = None  # the experts' on the EP ranks (None: in order)
    peaks_by_rank: Sequence[int] = ()  # every rank's peak memory, in bytes
    allocator_retries_by_rank: Sequence[int] = ()  # metrics.allocator_retries of every rank
    tier_calls: dict = field(default_factory=dict)  # this rank's calls of each of the tier's paths (`ExpertTier.calls`)
    phases: tuple[dict, list[int]] | None = None  # `profile_phases`' answer, when asked for
    # The last checkpoint, HF export and adapter the run wrote (by those names; empty on ranks
    # that wrote no part of them)
    saved: dict[str, Path | None] = field(default_factory=dict)


def report_run(cfg: RunConfig, layout: Layout, measured: Measured, *, header: dict, estimated_peak_bytes: int,
               output_dir, run_log: RunLog, reference: list[float] | None) -> int:
    """Check the losses, write and print the run's results (rank 0), and return the exit
    code of a run that did not stop early: `ExitCode.OK`, or LOSS_CHECK_FAILED.

    `header` is results.json's (`report.run_header`, with what ran under "ran"),
    `estimated_peak_bytes` the fit check's estimate of a rank's peak, `reference` the
    loss-check reference's losses (None when not asked for)."""
    ran_on, state, stopped = header["ran"], measured.state, measured.stopped
    losses = state.losses
    step_times_s = measured.step_times_s
    timing_warmup = min(cfg.train.timing_warmup_steps, len(step_times_s) - 1)  # a resumed run has fewer steps
    peak_memory = max(measured.peaks_by_rank)
    summary = metrics.summarize(
        step_times_s, timing_warmup, cfg.train.batch_size * cfg.data.seq_len, layout.world_size,
        measured.flops_per_step, metrics.peak_flops(header["device"]), peak_memory,
    ) if step_times_s else {}  # none when the first step diverged
    exit_code = ExitCode.OK
    # The estimate beside the measured peak, so that every run checks the estimate.
    extra = {"estimated_peak_gib": estimated_peak_bytes / 2**30,
             "peak_memory_gib_by_rank": [p / 2**30 for p in measured.peaks_by_rank],
             "allocator_retries_by_rank": list(measured.allocator_retries_by_rank),
             "grad_norms": state.grad_norms, **measured.exchange,
             **({"evals": state.evals} if state.evals else {}), **({"stopped": str(stopped)} if stopped else {}),
             **expert_load.results_entries(state.router, measured.run_load_YE, (measured.first_step, cfg.train.steps),
                                           measured.placement)}
    if measured.tier_calls:  # on this rank, evaluation included: which of the tier's paths ran
        extra["tier_calls"] = measured.tier_calls
    if measured.phases is not None:
        extra["phases_ms"], extra["expert_rows_per_rank"] = measured.phases
    if measured.generated is not None:
        extra["generate"] = measured.generated
    if reference is not None and not stopped:
        # An 8-bit tier is held to its own tolerance, whatever the rest of the model runs in.
        check = check_losses(losses, reference, ran_on.get("precision", cfg.precision))
        extra["loss_check"] = {"reference": cfg.loss_check, **check.record()}
        exit_code = ExitCode.OK if check.passed else ExitCode.LOSS_CHECK_FAILED
    # What this process exits with (unless a later write fails: then WRITE_FAILED), for a
    # script launched by torchrun, whose own exit code is 1 for any failure.
    extra["exit_code"] = int(stopped.exit_code if stopped else exit_code)
    if layout.is_main:
        # Whatever can still be written is (a full disk may take a plot and not results.json);
        # what could not is said in one line at the end, and the run exits WRITE_FAILED.
        unwritten = []
        try:
            path = report.write_results(output_dir, header, summary, losses, extra)
        except WriteFailed as e:
            path, unwritten = None, [str(e)]
        try:
            save_config(cfg, output_dir / CONFIG_FILE)
        except OSError as e:
            unwritten.append(str(write_failure(f"{output_dir / CONFIG_FILE}", e)))
        unwritten += run_log.finish(
            losses, measured.first_step, step_times_s, timing_warmup,
            f"{cfg.tier} on {header['device']} x{layout.world_size}, {cfg.precision}: {output_dir.name}", state.evals)
        if summary:
            print(report.timing_table(summary, header))
        if state.evals:
            print(evaluations_table(state.evals))
        if measured.generated is not None:
            print(f"generate: {measured.generated['prompt']!r} -> {measured.generated['text']!r}")
        if measured.phases is not None and summary:  # neither when the run stopped early
            print(report.phases_table(extra["phases_ms"], summary["median_step_ms"]))
        if any(measured.allocator_retries_by_rank):
            print(short_of_memory_note(measured.allocator_retries_by_rank), flush=True)
        if "loss_check" in extra:
            print(check.table())
        if path is not None:
            print(f"results: {path}", flush=True)
        for what, written in measured.saved.items():  # only what was written: a save that failed stopped the run first
            print(f"{what}: {written}", flush=True)
        if unwritten:
            raise WriteFailed("; ".join(unwritten) + (f"; and before that: {stopped}" if stopped else ""))
    return exit_code


def short_of_memory_note(retries_by_rank: Sequence[int]) -> str:
    """The line for a run whose CUDA allocator ran short (metrics.allocator_retries)."""
    worst = max(range(len(retries_by_rank)), key=retries_by_rank.__getitem__)
    return (f"te_mixtral: note: GPU memory ran short {retries_by_rank[worst]} times on rank {worst}: the allocator "
            "freed its cache, which waits for the whole GPU (slower; with several GPUs it can hang); recompute "
            "more layers (--recompute_layers)")
