"""The folders a run writes to, checked before it trains: a run never deletes or replaces
what is already there unless that is plainly its own to replace, or the user said so
(`overwrite`).

- `output_dir`: a folder that already holds a run's results.json is another run's record;
  one that holds a steps.jsonl (measure/run_log.py) without it, the log of a run that did
  not finish, which `resume` continues.
- `checkpoint_dir`: checkpoints there belong to an earlier run. `resume` continues it; a
  fresh run would prune them away at its first save.
- `save_hf` and `save_adapter`: the export replaces the whole folder. It may replace an earlier te_mixtral
  export (marked by `EXPORT_MARKER`), never the current folder, the checkpoint folder or
  the `--model` folder (nor a folder holding one of them), and other files only with
  `overwrite`.

Every rank runs these checks on its own before the first collective, so all fail alike.
"""

from pathlib import Path

from te_mixtral.config import RunConfig
from te_mixtral.errors import UserError
from te_mixtral.measure.run_log import STEPS_FILE

EXPORT_MARKER = "te_mixtral_export.json"  # written into every Hugging Face export


def check_outputs(cfg: RunConfig, model_dir: Path | None) -> None:
    """Raise a one-line `UserError` if the run would delete or replace what it must not."""
    ckpt = Path(cfg.checkpoint_dir).expanduser() if cfg.checkpoint_dir else None
    if cfg.output_dir and (Path(cfg.output_dir).expanduser() / "results.json").exists() and not cfg.overwrite:
        raise UserError(f"output_dir {cfg.output_dir} already holds a run's results.json; choose another folder, "
                        f"or pass --overwrite to replace it")
    if (cfg.output_dir and (Path(cfg.output_dir).expanduser() / STEPS_FILE).exists() and not cfg.overwrite
            and not cfg.resume):
        raise UserError(f"output_dir {cfg.output_dir} holds the {STEPS_FILE} of a run that did not finish; pass "
                        f"--resume to continue it, --overwrite to replace it, or choose another folder")
    if ckpt is not None and not cfg.resume and not cfg.overwrite and _holds_checkpoints(ckpt):
        raise UserError(f"checkpoint_dir {ckpt} holds an earlier run's checkpoints, which a new run would delete; "
                        f"pass --resume to continue that run, --overwrite to replace them, or choose another folder")
    protected = {"the current folder": Path.cwd(), "the checkpoint folder": ckpt, "the --model folder": model_dir}
    for key in ("save_hf", "save_adapter"):
        if getattr(cfg, key):
            _check_export_folder(key, Path(getattr(cfg, key)).expanduser(), cfg.overwrite, protected)
    if cfg.save_hf and cfg.save_adapter and Path(cfg.save_hf).expanduser().resolve() == \
            Path(cfg.save_adapter).expanduser().resolve():
        raise UserError(f"save_hf and save_adapter name one folder ({cfg.save_hf}): give each its own")


def _holds_checkpoints(folder: Path) -> bool:
    return folder.is_dir() and any(p.name == "latest" or p.name.startswith("step-") for p in folder.iterdir())


def _check_export_folder(key: str, folder: Path, overwrite: bool, protected: dict[str, Path | None]) -> None:
    resolved = folder.resolve()
    for what, path in protected.items():
        if path is not None and (resolved == path.resolve() or resolved in path.resolve().parents):
            raise UserError(f"{key} {folder} would replace {what} ({path}): export to a folder of its own")
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{key} {folder} is a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / EXPORT_MARKER).is_file() and not overwrite:
        raise UserError(f"{key} {folder} holds files that are not an earlier te_mixtral export, and the export "
                        f"replaces the whole folder; choose a new folder, or pass --overwrite to replace them")
