"""The run as it goes: one JSON line per step, experiment trackers when asked for, a progress bar,
and at the end the loss and step-time plots beside results.json.

results.json is written once, at the end, so a run that is killed, hangs or diverges
halfway would leave nothing to look at but its console. Rank 0 therefore also writes
`steps.jsonl` into the output folder, one line per optimizer step, flushed as it is
written: `tail -f`, `pandas.read_json(path, lines=True)` or another process can follow the
run. Each line holds

    run_id           the run's id, the same in its checkpoints' meta.json: a resume
                     continues only the log of the run its checkpoint is from
    step             optimizer steps completed, counted from 1 (a resumed run counts on)
    loss             the global LM loss, as results.json's "losses"
    aux_loss         the load-balancing loss, global and unweighted ("aux_losses")
    z_loss           the router z-loss, global and unweighted ("z_losses")
    lr               the step's learning rate
    grad_norm        the global gradient norm before clipping ("grad_norms")
    step_ms          the step's wall time (metrics.StepTimer); null for a step that diverged
                     and was not applied (the run's last)
    tokens_per_s     the step's global tokens (batch_size x seq_len) over step_ms
    peak_memory_gib  rank 0's peak memory so far (metrics.peak_memory_bytes: on CUDA the
                     most the allocator handed out; on CPU the process's peak resident set,
                     Python and the data included)
    expert_load      {"max_over_mean", "busiest_rank_over_mean": {EP size: ratio}}, as
                     results.json's "expert_load" holds them (measure/expert_load.py)

and after each held-out evaluation (`train.eval_every`), a line of its own after its step's:

    step             the optimizer steps completed when it was measured
    eval_loss        the held-out loss, as results.json's "evals" hold it
    eval_perplexity  exp(eval_loss)
    eval_targets     the held-out target tokens, over all ranks

(pandas reads both kinds into one frame, NaN where a line has no such field; a reader of
the training steps alone keeps the lines that hold "loss".)

None of it costs a device synchronisation of its own: the losses and the norm are the
numbers the loop already brings to the host in one `.tolist()` per step, the load ratios
`expert_load.step_record`'s, the memory an allocator counter. Non-finite values are written
as results.json writes them (`NaN`, `Infinity`: Python's json and pandas read them back,
strict JSON tools such as `jq` do not).

At the end (`plots`, on by default) the run draws `loss.png` (with the held-out losses,
where there are any) and `step_time.png` beside results.json with measure/plots.py; without matplotlib it says so in one line and trains on.

`report_to` sends the same scalars (and the held-out loss of each evaluation) to
TensorBoard, Weights & Biases or MLflow (measure/trackers.py), as each step is logged.

The progress bar is tqdm's, on stderr, and only when stderr is a terminal: in a log file
or a test's captured output a redrawn bar is noise, and the plain line printed every
`train.log_every` steps (`progress_line`) says the same.

Files: a fresh run writes a new `steps.jsonl` (training/outputs.py has refused a folder
holding another run's, unless `overwrite`); `resume` keeps the lines of the steps before
the one it resumes from and appends, so a run continued into its own folder keeps one log.
A line that cannot be written (a full disk) is cut off again and the log ends there, said
once; a tracker that cannot write stops there too (TensorBoard's event file fills the same
disk); the run trains on, and `finish` returns what was not written for the run's last line.
"""

import contextlib
import importlib.util
import json
import sys
from functools import partial
from pathlib import Path

from tqdm import tqdm

from te_mixtral.config import RunConfig
from te_mixtral.files import write_failure, write_text_atomic
from te_mixtral.measure import expert_load, plots
from te_mixtral.measure.metrics import GIB
from te_mixtral.measure.trackers import start_trackers

STEPS_FILE = "steps.jsonl"
LOSS_PLOT = "loss.png"
STEP_TIME_PLOT = "step_time.png"


def progress_line(step: int, total: int, loss: float, lr: float, step_s: float, aux: float) -> str:
    """The console line of a logged step; `loss` is the LM loss, `aux` the load-balancing
    loss, unweighted."""
    return f"step {step:>4}/{total}  loss {loss:.4f}  aux {aux:.4f}  lr {lr:.2e}  {step_s * 1e3:7.1f} ms"


def step_record(step: int, loss: float, router: dict, grad_norm: float, lr: float, step_s: float | None,
                tokens_per_step: int, memory_bytes: int) -> dict:
    """One line of steps.jsonl (see the module docstring); `router` is the step's
    `expert_load.step_record`."""
    return {"step": step, "loss": loss, "aux_loss": router["aux"], "z_loss": router["z"], "lr": lr,
            "grad_norm": grad_norm, "step_ms": None if step_s is None else step_s * 1e3,
            "tokens_per_s": None if step_s is None else tokens_per_step / step_s,
            "peak_memory_gib": memory_bytes / GIB,
            "expert_load": {"max_over_mean": router["max_over_mean"],
                            "busiest_rank_over_mean": router["busiest_rank_over_mean"]}}


def _scalars(record: dict) -> dict[str, float]:
    """A steps.jsonl record as the trackers' tags, grouped by their prefix."""
    load = record["expert_load"]
    scalars = {"loss/train": record["loss"], "loss/aux": record["aux_loss"], "loss/z": record["z_loss"],
               "optim/lr": record["lr"], "optim/grad_norm": record["grad_norm"], "speed/step_ms": record["step_ms"],
               "speed/tokens_per_s": record["tokens_per_s"], "memory/peak_gib": record["peak_memory_gib"],
               "expert_load/max_over_mean": load["max_over_mean"]}
    scalars.update({f"expert_load/busiest_rank_over_mean_ep{p}": ratio
                    for p, ratio in load["busiest_rank_over_mean"].items()})
    return {tag: value for tag, value in scalars.items() if value is not None}


def _kept_lines(path: Path, first_step: int) -> str:
    """The lines of an earlier steps.jsonl before `first_step`; a line cut short by a killed
    run is dropped with the rest."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < first_step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return "".join(kept)


def _tracker_failure(name: str, tracker, error: OSError) -> str:
    """What could not be written when a tracker's write raised `error`."""
    return str(write_failure(f"report_to {name} in {tracker.where}", error))


class RunLog:
    """The run log of rank 0; on the other ranks (`output_dir` None) every method does nothing.

    `first_step` is the first step this process runs, counted from 1; `total` the run's last;
    `run_id` the run's (training/checkpoint.TrainState), written into every line; `saved_runs`
    the trackers' runs its checkpoint names, {tracker: run id}, which a resume goes on in.
    `tracker_runs` is what the run's checkpoints keep: those, and the runs its trackers started.
    """

    def __init__(self, output_dir: Path | None, cfg: RunConfig, first_step: int, total: int,
                 run_id: str | None = None, saved_runs: dict[str, str] | None = None):
        self.output_dir = output_dir
        self.run_id = run_id
        self.tracker_runs = dict(saved_runs or {})
        self.cfg = cfg
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        self._file = self._bar = None
        self._log_stopped = False  # a line of steps.jsonl could not be written: it ends there
        self._trackers = {}
        # (step, ms) of the steps a resumed run ran before this process, from its log: the
        # step-time plot covers the whole run.
        self.earlier_step_ms: list[tuple[int, float]] = []
        if output_dir is None:
            return
        path = output_dir / STEPS_FILE
        self.unwritten: list[str] = []  # what could not be written (a full disk), for the run's last line
        # First: a tracker that cannot start refuses the run, which must then leave no log (an
        # empty steps.jsonl reads as the log of a run that did not finish).
        self._trackers = start_trackers(output_dir, cfg, first_step, self.tracker_runs)
        self.tracker_runs.update({name: t.run_id for name, t in self._trackers.items() if t.run_id is not None})
        try:
            if cfg.resume and path.exists():
                kept = _kept_lines(path, first_step)
                write_text_atomic(path, kept)
                self._file = path.open("ab", buffering=0)
                self.earlier_step_ms = [(r["step"], r["step_ms"]) for r in map(json.loads, kept.splitlines())
                                        if r.get("step_ms") is not None]
            else:
                self._file = path.open("wb", buffering=0)
        except OSError as e:
            for tracker in self._trackers.values():
                tracker.close()
            raise write_failure(str(path), e) from None
        # disable=None: no bar where stderr is not a terminal (a log, a pipe).
        self._bar = tqdm(total=total, initial=first_step - 1, unit="step", file=sys.stderr, disable=None,
                         dynamic_ncols=True)

    def write(self, line: str) -> None:
        """Print a line to stdout, above the progress bar."""
        if self._bar is None:
            return
        with self._bar.external_write_mode(file=sys.stdout):
            print(line, flush=True)

    def step(self, step: int, state, lr: float, step_s: float | None, memory_bytes: int,
             print_line: bool) -> None:
        """Log step `step` from the training state (training/checkpoint.TrainState, which
        holds its loss, gradient norm and router record last); with `print_line`, print the
        console lines too. `step_s` is None for a step that diverged."""
        if self._file is None:
            return
        record = step_record(step, state.losses[-1], state.router[-1], state.grad_norms[-1], lr, step_s,
                             self.tokens_per_step, memory_bytes)
        self._append(record)
        self._to_trackers(_scalars(record), step)
        if step_s is None:
            return
        self._bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", refresh=False)
        self._bar.update(1)
        if print_line:
            self.write(progress_line(step, self.cfg.train.steps, record["loss"], lr, step_s, record["aux_loss"])
                       + "\n" + expert_load.load_line(state.router[-1], self.cfg.ep_size))

    def _append(self, record: dict) -> None:
        """Write one line of steps.jsonl, whole or not at all. The file is unbuffered, so each
        line reaches the disk (and `tail -f`) as it is written, and a write that fails (a full
        disk) is known at once: the part of the line that was written is cut off again, and
        the log stops there, said once; the run trains on (results.json holds every step)."""
        if not self._file or self._log_stopped:
            return
        if self.run_id is not None:
            record = {"run_id": self.run_id, **record}
        line, start = (json.dumps(record) + "\n").encode(), self._file.tell()
        try:
            written = 0
            while written < len(line):  # a write may take only part of the line, and fail at the next
                written += self._file.write(line[written:])
        except OSError as e:
            problem = (f"{write_failure(str(self.output_dir / STEPS_FILE), e)} (its lines stop before step "
                       f"{record['step']})")
            self._log_stopped = True
            self._note_unwritten(problem)
            with contextlib.suppress(OSError):  # cutting a file short needs no space
                self._file.truncate(start)

    def _note_unwritten(self, problem: str) -> None:
        self.unwritten.append(problem)
        print(f"te_mixtral: note: {problem}; training goes on", flush=True)

    def _to_trackers(self, scalars: dict[str, float], step: int) -> None:
        """Send `scalars` to the trackers. One that cannot write (a full disk) stops there, said
        once, as steps.jsonl does: the run trains on, and says at its end what was not written."""
        for name, tracker in list(self._trackers.items()):
            try:
                tracker.log(scalars, step)
            except OSError as e:
                del self._trackers[name]
                with contextlib.suppress(OSError):  # its close writes what it holds, and fails again
                    tracker.close()
                self._note_unwritten(f"{_tracker_failure(name, tracker, e)} (its steps stop before step {step})")

    def evaluation(self, evaluation) -> None:
        """Log a held-out evaluation (training/evaluate.Evaluation): print it, write its line
        and send its loss to the trackers."""
        if self._file is None:
            return
        self.write(evaluation.line(self.cfg.train.steps))
        self._append({"step": evaluation.step, "eval_loss": evaluation.loss, "eval_perplexity": evaluation.perplexity,
                      "eval_targets": evaluation.targets})
        self._to_trackers({"loss/eval": evaluation.loss}, evaluation.step)

    def finish(self, losses: list[float], first_step: int, step_times_s: list[float], timing_warmup: int,
               title: str, evals: list[dict] = ()) -> list[str]:
        """Close the log and, with `plots`, draw the run's plots beside results.json: its
        loss at every step (a resumed run's earlier steps too) with its held-out `evals`
        (evaluate.Evaluation dictionaries), and the times of this process's steps (from
        `first_step`) after those its log holds from before a resume. Without matplotlib, say so in one line. Return what could not be
        written (the log's end, a plot), one phrase each."""
        if self._file is None:
            return []
        self._bar.close()
        self._file.close()
        for name, tracker in self._trackers.items():
            try:
                tracker.close()
            except OSError as e:  # what it still held could not be written
                self.unwritten.append(_tracker_failure(name, tracker, e))
        if not self.cfg.plots:
            return self.unwritten
        if importlib.util.find_spec("matplotlib") is None:
            print("te_mixtral: matplotlib is not installed, so no plots (pip install matplotlib)", flush=True)
            return self.unwritten
        drawings = {LOSS_PLOT: partial(plots.loss_figure, [(self.cfg.tier, losses)], title,
                                       [(e["step"], e["loss"]) for e in evals])}
        if step_times_s:
            drawings[STEP_TIME_PLOT] = partial(plots.step_times_figure, first_step, [s * 1e3 for s in step_times_s],
                                               timing_warmup, title, self.earlier_step_ms)
        for name, figure in drawings.items():
            try:
                plots.save(figure(), self.output_dir / name)
            except OSError as e:
                (self.output_dir / name).unlink(missing_ok=True)  # an earlier run's (--overwrite) is not this one's
                self.unwritten.append(str(write_failure(str(self.output_dir / name), e)))
        return self.unwritten
