"""torchrun's restarts: `torchrun --max-restarts N` starts a job again, with the same command
line, when one of its processes fails, up to N times. A restarted run continues from the
newest checkpoint its own launch wrote, as `--resume` does: the steps the first attempt
trained are not trained again, and its log goes on in its output folder.

Which checkpoint is the launch's own: torchrun gives every process of one launch, in every
attempt, the same id (TORCHELASTIC_RUN_ID: `--rdzv-id`, or the fresh one `--standalone`
makes), and each checkpoint's meta.json records the id it was written under. A checkpoint of
another launch is never continued by a restart: the first attempt did not continue it either
(without `--resume` it refuses to replace it), so the restart runs as the first attempt did,
and the usual checks refuse whatever of the first attempt's it would replace
(training/outputs.py). torchrun's id when `--rdzv-id` is not given outside `--standalone`,
"none", names no launch, so those restarts continue nothing.

A restart that has nothing of its own to continue says so in one line, then runs as a new run
would: from step 0 into a new output folder, or refused where the first attempt left its log
(each attempt of a run killed before its first checkpoint would otherwise start over on the
last one's files).
"""

from dataclasses import replace
from pathlib import Path

from te_mixtral.config import RunConfig
from te_mixtral.distributed.launcher_env import launch_id_from_env, main_rank_from_env, restart_from_env
from te_mixtral.training.checkpoint import latest_meta


def _newest(cfg: RunConfig) -> tuple[Path, dict] | None:
    """The newest checkpoint in cfg.checkpoint_dir and its meta, whoever wrote it."""
    return latest_meta(Path(cfg.checkpoint_dir)) if cfg.checkpoint_dir else None


def _launchs_latest(cfg: RunConfig) -> Path | None:
    """The newest checkpoint in cfg.checkpoint_dir, where this launch wrote it."""
    launch = launch_id_from_env()
    latest = _newest(cfg) if launch else None
    return latest[0] if latest is not None and latest[1].get("launch") == launch else None


def continue_restarted(cfg: RunConfig) -> RunConfig:
    """`cfg`, resuming its launch's newest checkpoint where torchrun restarted the job (the
    module docstring); rank 0 says which, or why there is none."""
    attempt, most = restart_from_env()
    if attempt == 0 or cfg.resume:
        return cfg
    launch = launch_id_from_env()
    restarted = f"te_mixtral: torchrun restarted the job (restart {attempt} of {most})"
    if (latest := _launchs_latest(cfg)) is not None:
        if main_rank_from_env():
            print(f"{restarted}: it continues from {latest}, as --resume does", flush=True)
        return replace(cfg, resume=True)
    why = ("no --checkpoint-dir" if cfg.checkpoint_dir is None else
           "torchrun's --rdzv-id was not given, so its checkpoints cannot be told from another job's" if launch is None
           else f"none in {cfg.checkpoint_dir} yet" if (newest := _newest(cfg)) is None
           else f"the newest in {cfg.checkpoint_dir}, {newest[0].name}, is another job's")
    if main_rank_from_env():
        print(f"{restarted}, with no checkpoint of its own to continue from ({why}): it runs as a new run would",
              flush=True)
    return cfg


def after_a_lost_peer(cfg: RunConfig) -> str:
    """What follows a rank's death, as the line that reports it says: torchrun's restart while
    it has restarts left (it runs the same command line, so --resume is no advice to give;
    `continue_restarted`), else the user's --resume."""
    attempt, most = restart_from_env()
    if attempt == most:
        return "resume from the last checkpoint with --resume"
    latest = _launchs_latest(cfg)
    return (f"torchrun restarts the job (restart {attempt + 1} of {most}), which continues from "
            + (str(latest) if latest else "this launch's newest checkpoint, if it wrote one"))
