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

Each is flushed (or sends) as it logs, so a run that dies keeps its steps so far. Its resume
(`resume`, into the same output folder) goes on from its last checkpoint: TensorBoard hides the
steps the dead run logged past it (`purge_step`), as steps.jsonl drops their lines; wandb and
MLflow start a run of their own beside the dead one, which keeps all it logged.
"""

import importlib.util
import os
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


class TensorBoard:
    def __init__(self, output_dir: Path, cfg: RunConfig, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run goes on from its checkpoint, but the run it resumes may have logged
        # steps past it before it died, into its own event file: TensorBoard hides those
        # (`purge_step`), as steps.jsonl drops their lines.
        self.writer = SummaryWriter(log_dir=str(output_dir), purge_step=first_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, output_dir: Path, cfg: RunConfig, first_step: int):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "te_mixtral"), name=output_dir.name,
                              dir=str(output_dir), config=flatten(to_dict(cfg)))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, output_dir: Path, cfg: RunConfig, first_step: int):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "te_mixtral"))
        self.run = mlflow.start_run(run_name=output_dir.name)
        mlflow.log_params({key: str(value) for key, value in flatten(to_dict(cfg)).items()})

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
assert set(TRACKERS) == set(PACKAGES)


def start_trackers(output_dir: Path, cfg: RunConfig, first_step: int) -> list:
    """The trackers `report_to` names, started (rank 0's: the others start none) for a run
    whose first step here is `first_step` (after 1: a resume). One that cannot start (a server
    out of reach, a store its package refuses) is refused in one line with its own reason."""
    started = []
    for name in requested(cfg):
        try:
            started.append(TRACKERS[name](output_dir, cfg, first_step))
        except Exception as e:  # each package raises its own kinds
            for tracker in started:  # the run is refused: the ones started end with it
                tracker.close()
            raise UserError(f"report_to {name} could not start: {first_line(e)}") from None
    return started
