"""Experiment trackers, as Hugging Face Trainer's users know them: `report_to` names any of
`tensorboard`, `wandb` and `mlflow` ("tensorboard,wandb"; `none`, the default, names none).

Each gets the scalars of every step that steps.jsonl holds (run_log.py), under the same tags
(`loss/train`, `optim/lr`, `speed/step_ms`, ...), and the held-out loss of each evaluation
(`loss/eval`), from rank 0 only. None of the packages is needed by a run that does not ask
for it (each is an extra: `pip install 'te_mixtral[wandb]'`), and a missing one is refused in
one line before the run starts, on every rank.

Where each writes is its own settings', as with the Trainer:

- `tensorboard`: event files in the output folder itself, so `tensorboard --logdir runs`
  shows every run under its folder's name;
- `wandb`: a run named after the output folder in project `WANDB_PROJECT` (default
  te_mixtral), with the run's config; `WANDB_MODE=offline` keeps it in the output folder's
  `wandb/` for a later `wandb sync`;
- `mlflow`: a run named after the output folder in experiment `MLFLOW_EXPERIMENT_NAME`
  (default te_mixtral) at `MLFLOW_TRACKING_URI` (a server, or `file:` a local folder), with the
  run's config as its parameters.

Each is flushed (or sends) as it logs, so a run that dies keeps its steps so far. One that
cannot write (a full disk) stops there, and the run trains on and names it at its end
(run_log.py), as it does steps.jsonl; each says `where` it writes, for that line.

A resume (`resume`) goes on in the tracker's run its checkpoint came from, its steps counting on:
the checkpoint's meta.json keeps the run id of each tracker that has one
(training/checkpoint.TrainState's `tracker_runs`), and the resumed run hands it to the
tracker's own way of continuing a run. The steps a run that died logged past its checkpoint
are the resumed run's first ones again (the same computation from the same state):

- `tensorboard`: its run is the output folder; into the same folder, it hides those steps
  (`purge_step`) behind the resumed run's, as steps.jsonl drops their lines;
- `wandb`: `wandb.init(id=..., resume="allow")`. Online, wandb counts on after the steps the
  run holds, and the resumed run does not send it those again. Offline (`WANDB_MODE=offline`)
  each half is a run folder of its own under the same id, which `wandb sync` sends into the one
  run, in order; there wandb knows of no steps before, and a dead run's steps past its
  checkpoint are in both halves;
- `mlflow`: `mlflow.start_run(run_id=...)`, in the run's own experiment. The resumed run sends
  none of the steps the run's store holds of a scalar already (MLflow would keep both values);
  its parameters stay those it started with (MLflow's cannot change: a changed setting is
  among the resumed run's `note: changed since the checkpoint` lines).

Where the checkpoint names no run of a tracker `report_to` names (it was written without it,
or before run ids were kept), or its store does not hold that run (another
MLFLOW_TRACKING_URI, a deleted run), the resumed run starts a new one and says so in one line;
one of a tracker `report_to` no longer names is said too, and stays in the checkpoints for a
later resume that names it again.
"""

import importlib.util
import os
import threading
from pathlib import Path

from te_mixtral.config import RunConfig, to_dict
from te_mixtral.errors import UserError, first_line
from te_mixtral.saved_config import flatten

# report_to's name -> the module it imports (its pyproject extra has the tracker's name)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def requested(cfg: RunConfig) -> list[str]:
    """The trackers `report_to` names, in its order."""
    return [name.strip() for name in cfg.report_to.split(",") if name.strip() not in ("", "none")]


def check_trackers(cfg: RunConfig) -> None:
    """Refuse in one line a tracker whose package is missing (every rank checks, before the
    first collective)."""
    for name in requested(cfg):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(f"report_to {name} needs the {PACKAGES[name]} package: pip install 'te_mixtral[{name}]'")


# Where TensorBoard's event-writing thread is defined (TensorBoard._silence_writer_errors).
_WRITER_THREAD_MODULE = "tensorboard.summary.writer.event_file_writer"


class TensorBoard:
    has_run_id = False  # its run is the output folder

    def __init__(self, output_dir: Path, cfg: RunConfig, first_step: int, run_id: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = None
        self.where = str(output_dir)  # what a failed write names
        # TensorBoard writes its events from a thread of its own. One that fails (a full disk)
        # keeps its error for the writer's next flush, which `log` makes every step and which
        # raises it here, for the run log's one line; it also prints its own traceback as it
        # ends, which this hook silences while the writer lives: any other thread's error, and
        # any but an OSError, is printed as before.
        self._printed = threading.excepthook
        threading.excepthook = self._silence_writer_errors
        # A resumed run goes on from its checkpoint, but the run it resumes may have logged
        # steps past it before it died, into its own event file: TensorBoard hides those
        # (`purge_step`), as steps.jsonl drops their lines.
        try:
            self.writer = SummaryWriter(log_dir=str(output_dir), purge_step=first_step)
        except BaseException:  # no writer, nothing to silence
            threading.excepthook = self._printed
            raise

    def _silence_writer_errors(self, args) -> None:
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__module__ == _WRITER_THREAD_MODULE):
            self._printed(args)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        try:
            self.writer.close()  # its thread ends here
        finally:
            if threading.excepthook == self._silence_writer_errors:
                threading.excepthook = self._printed


class WandB:
    has_run_id = True

    def __init__(self, output_dir: Path, cfg: RunConfig, first_step: int, run_id: str | None):
        import wandb

        # "allow": a run id wandb does not know (a first half kept offline and not synced yet,
        # another project) is made a run of that id.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "te_mixtral"), name=output_dir.name,
                              dir=str(output_dir), config=flatten(to_dict(cfg)), id=run_id,
                              resume="allow" if run_id else None)
        self.run_id = self.run.id
        self.where = self.run.dir
        # The step its next log expects: on a resume online, the one after those the run holds
        # (lower ones wandb drops, warning at each); offline, or a new run, 0.
        self.next_step = self.run.step

    def log(self, scalars: dict[str, float], step: int) -> None:
        if step >= self.next_step:
            self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    has_run_id = True

    def __init__(self, output_dir: Path, cfg: RunConfig, first_step: int, run_id: str | None):
        import mlflow

        self.mlflow = mlflow
        run = _mlflow_run(mlflow.MlflowClient(), run_id) if run_id else None
        self.held = {}  # tag -> the last step the run holds a value of
        if run is None:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "te_mixtral"))
            self.run = mlflow.start_run(run_name=output_dir.name)
        else:  # in its own experiment, which start_run requires to be the active one
            mlflow.set_experiment(experiment_id=run.info.experiment_id)
            self.run = mlflow.start_run(run_id=run_id)
            self.held = {tag: max(m.step for m in mlflow.MlflowClient().get_metric_history(run_id, tag))
                         for tag in run.data.metrics}
        self.run_id = self.run.info.run_id
        self.where = mlflow.get_tracking_uri()
        # MLflow refuses to change a parameter: a resumed run adds those the run lacks (new keys).
        params = {key: str(value) for key, value in flatten(to_dict(cfg)).items()}
        mlflow.log_params({key: value for key, value in params.items()
                           if run is None or key not in run.data.params})

    def log(self, scalars: dict[str, float], step: int) -> None:
        new = {tag: value for tag, value in scalars.items() if step > self.held.get(tag, 0)}
        if new:
            self.mlflow.log_metrics(new, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _mlflow_run(client, run_id: str):
    """MLflow's run `run_id`, or None (said in one line) where its store does not hold it or it
    was deleted; any other failure (a server out of reach) is raised."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        why = f"is not in this run's store ({mlflow.get_tracking_uri()})"
    else:
        if run.info.lifecycle_stage != "deleted":
            return run
        why = "was deleted"
    print(f"te_mixtral: note: the checkpoint's mlflow run {run_id} {why}: starting a new one", flush=True)
    return None


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
assert set(TRACKERS) == set(PACKAGES)


def start_trackers(output_dir: Path, cfg: RunConfig, first_step: int, saved_runs: dict[str, str]) -> dict:
    """The trackers `report_to` names, by name, started (rank 0's: the others start none) for a
    run whose first step here is `first_step` (after 1: a resume, which goes on in the runs of
    `saved_runs`, {tracker: run id} as its checkpoint holds them). One that cannot start (a
    server out of reach, a store its package refuses) is refused in one line with its own
    reason."""
    started = {}
    for name in requested(cfg):
        run_id = saved_runs.get(name)
        if first_step > 1 and run_id is None and TRACKERS[name].has_run_id:
            print(f"te_mixtral: note: the checkpoint names no {name} run to continue (it was written without "
                  f"{name}, or before tracker runs were kept): starting a new one", flush=True)
        try:
            started[name] = TRACKERS[name](output_dir, cfg, first_step, run_id)
        except Exception as e:  # each package raises its own kinds
            for tracker in started.values():  # the run is refused: the ones started end with it
                tracker.close()
            raise UserError(f"report_to {name} could not start: {first_line(e)}") from None
    for name, run_id in saved_runs.items():
        if name not in started:
            print(f"te_mixtral: note: the checkpoint's {name} run {run_id} is not continued: report_to does not "
                  f"name {name}", flush=True)
    return started
