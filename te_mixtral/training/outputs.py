"""The folders a run writes to, checked before it trains: a run never deletes or replaces
what is already there unless that is plainly its own to replace, or the user said so
(`overwrite`).

- `output_dir`: every file the run writes there (`output_files`) is refused if it exists:
  a results.json is another run's record; a steps.jsonl (measure/run_log.py) without it,
  the log of a run that did not finish, which `resume` continues, but only with that run's
  own checkpoint (`_check_resumed_log`); a config.yaml or a plot may be the user's own.
  `overwrite` lets the run replace them, except an input of the run itself (the `--config`
  file, the loss-check reference, the ep_placement load): it would be lost while the run
  still means to read it, or to be read again (a resume places its experts as the run did).
  A folder in use by a running run is refused in any case (te_mixtral/folder_lock.py), and
  so is the data set's folder, whose files are all data.
- `checkpoint_dir`: checkpoints there belong to an earlier run. `resume` continues it; a
  fresh run would prune them away at its first save. A save deletes leftovers of an
  interrupted one (`step-N.tmp`, `step-N.old`) and pruning deletes old checkpoints, but only
  folders the checkpointer wrote (training/checkpoint.py `written_here`): anything else of
  those names, and a folder the run writes (output, exports) inside a checkpoint's folder or
  `latest`, are refused here.
- `save_hf` and `save_adapter`: an export replaces only the files an export writes (`is_export_file`), and
  keeps whatever else the folder holds (a model card, evaluation results). It may replace
  its own run's earlier export of its kind (`EXPORT_MARKER` names the run: a `train.save_every`
  export's, or that of the run a resume continues); another run's export, a run's result as its
  results.json is, and export-named files of anyone else only with `overwrite`, as the files
  transformers would read with the export (`_READ_WITH_EXPORT`) wherever they come from. It is
  never the current folder, the output or checkpoint folder, the `--model` folder, the data
  set, the tokenizer or the adapter the run starts from (`lora.init`), nor a folder holding one
  of them: those are not exports, or the run's own inputs (and a data folder would read the
  export as data). The export is written into `DIR.tmp` and the one it replaces moves to `DIR.old`, both deleted
  after: a folder of either name that te_mixtral did not make (`files.check_scratch`) is
  refused, never deleted.

Every rank runs these checks on its own before the first collective, so all fail alike.
"""

import json
import math
import os
import re
from pathlib import Path

from te_mixtral.config import RunConfig
from te_mixtral.config_checks import path_keys
from te_mixtral.errors import UserError
from te_mixtral.files import check_scratch, check_writable, sibling, staged_beside
from te_mixtral.measure.report import RESULTS_FILE
from te_mixtral.measure.run_log import LOSS_PLOT, STEP_TIME_PLOT, STEPS_FILE
from te_mixtral.training.checkpoint import LATEST, latest_meta, leftovers, written_here

CONFIG_FILE = "config.yaml"  # the run's whole config, saved beside results.json at the end
# Written into every export (save_hf, save_adapter), the one file of ours a finished export
# holds (its lock is beside it: te_mixtral/folder_lock.py): it shows the next export that the
# folder's export files are an export's to replace.
EXPORT_MARKER = "te_mixtral_export.json"
CHAT_TEMPLATES_DIR = "additional_chat_templates"  # a tokenizer's named chat templates, NAME.jinja (transformers 5)
# The names of the files a Hugging Face export writes (training/hf_checkpoint.py): only these
# are replaced or removed when an export replaces an earlier one.
_EXPORT_NAMES = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", CHAT_TEMPLATES_DIR,
                 EXPORT_MARKER, "adapter_config.json", "adapter_model.safetensors"}  # the last two: a LoRA adapter export
_EXPORT_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Files no export writes that transformers reads with one: a model.safetensors it loads in place
# of the sharded index, an added_tokens.json whose tokens it adds to the tokenizer (an export's
# tokenizer.json holds every token the run's tokenizer has: a chat run's AutoTokenizer added the
# source's added_tokens.json to it, a text run read tokenizer.json alone). Beside an
# export, either makes the folder load as something else than what was trained: refused, even
# beside an earlier export, and replaced with the export's other files under `overwrite`.
_READ_WITH_EXPORT = {"model.safetensors", "added_tokens.json"}
# The export keys, each with the file that shows an earlier export of its kind. Both kinds
# replace the same names, so one kind into the other's folder would delete the other: a whole
# model, or an adapter.
_KIND_SHOWN_BY = {"save_hf": "model.safetensors.index.json", "save_adapter": "adapter_config.json"}
_EXPORT_KEYS = tuple(_KIND_SHOWN_BY)


def output_files(cfg: RunConfig) -> list[str]:
    """The names of the files a run writes into its output folder (TensorBoard's event
    files aside: each carries the host, the time and the process id in its name)."""
    return [RESULTS_FILE, STEPS_FILE, CONFIG_FILE, *((LOSS_PLOT, STEP_TIME_PLOT) if cfg.plots else ())]


def is_export_file(name: str) -> bool:
    """Whether a Hugging Face export (save_hf) or an adapter export (save_adapter) replaces a
    file (or the folder of named chat templates) of this name: one it writes, or one
    transformers would read with it."""
    return name in _EXPORT_NAMES or name in _READ_WITH_EXPORT or _EXPORT_SHARD.fullmatch(name) is not None


def check_outputs(cfg: RunConfig, model_dir: Path | None, config_path: str | None = None) -> None:
    """Raise a one-line `UserError` if the run would delete or replace what it must not;
    `config_path` is the `--config` file the run was read from."""
    out = Path(cfg.output_dir) if cfg.output_dir is not None else None
    ckpt = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
    # Every path the run writes or reads, by its key.
    paths = {key: Path(p) for key, p in {**path_keys(cfg), "--config": config_path}.items() if p}
    if out is not None:
        inputs = {"the --config file": config_path, "the loss-check reference": cfg.loss_check,
                  "the ep_placement load": cfg.ep_placement}
        _check_output_folder(out, cfg, {what: Path(p) for what, p in inputs.items() if p})
    if out is not None and ckpt is not None and cfg.resume:  # even with overwrite: a resume keeps the log's lines
        _check_resumed_log(out / STEPS_FILE, ckpt)
    if ckpt is not None:  # what the run writes or reads must not be where pruning deletes
        _check_checkpoint_folder(ckpt, {key: path for key, path in paths.items() if key != "checkpoint_dir"})
    if ckpt is not None and not cfg.resume and not cfg.overwrite and _holds_checkpoints(ckpt):
        raise UserError(f"checkpoint_dir {ckpt} holds an earlier run's checkpoints, which a new run would delete; "
                        f"pass --resume to continue that run, --overwrite to replace them, or choose another folder")
    # Local inputs only: a hub name is no folder here.
    data, tokenizer = (Path(p) if p and Path(p).exists() else None
                       for p in (cfg.data.dataset, cfg.data.tokenizer))
    if out is not None and data is not None and data.is_dir() and out.resolve() == data.resolve():
        raise UserError(f"output_dir {out} is the data set folder, whose files are all read as data: the run's "
                        f"{RESULTS_FILE} and {STEPS_FILE} would be the next run's; choose another folder")
    protected = {"the current folder": Path.cwd(), "the output folder": out, "the checkpoint folder": ckpt,
                 "the --model folder": model_dir, "the data set": data, "the tokenizer": tokenizer,
                 "the lora.init adapter": Path(cfg.lora.init) if cfg.lora.init is not None else None}
    exports = {key: Path(getattr(cfg, key)) for key in _EXPORT_KEYS
               if getattr(cfg, key) is not None}
    own_run = _resumed_run_id(ckpt) if ckpt is not None and cfg.resume else None
    for key, folder in exports.items():
        _check_staging(key, folder, {other: path for other, path in paths.items() if other != key})
        _check_export_folder(key, folder, cfg.overwrite, protected, own_run)
    if len(exports) == 2 and exports["save_hf"].resolve() == exports["save_adapter"].resolve():
        raise UserError(f"save_hf and save_adapter name one folder ({cfg.save_hf}): give each its own")


def check_writable_folders(cfg: RunConfig) -> None:
    """Refuse, before anything is made or trained, a folder the run would write into and
    cannot (`files.check_writable`): the output and checkpoint folders, and each export's,
    with the folder an export is staged in beside it (`DIR.tmp`)."""
    for key in ("output_dir", "checkpoint_dir", *_EXPORT_KEYS):
        if getattr(cfg, key) is not None:
            check_writable(Path(getattr(cfg, key)), key, ".tmp" if key in _EXPORT_KEYS else None)


def _check_output_folder(out: Path, cfg: RunConfig, inputs: dict[str, Path]) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir {out} is a file, not a folder")
    written = [out / name for name in output_files(cfg)]
    for path in written:
        for what, source in inputs.items():
            if path.exists() and source.exists() and os.path.samefile(path, source):
                raise UserError(f"output_dir {out} would replace {what} ({source}) with the run's {path.name}, even "
                                f"with --overwrite; choose another folder")
    if cfg.overwrite:
        return
    if (out / RESULTS_FILE).exists():
        raise UserError(f"output_dir {out} already holds a run's {RESULTS_FILE}; choose another folder, "
                        f"or pass --overwrite to replace it")
    if (out / STEPS_FILE).exists() and not cfg.resume:
        unfinished = f"output_dir {out} holds the {STEPS_FILE} of a run that did not finish"
        ckpt = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
        if ckpt is not None and (ckpt / LATEST).is_file():
            raise UserError(f"{unfinished}; pass --resume to continue it, --overwrite to replace it, or choose "
                            f"another folder")
        # Killed before its first checkpoint, or its checkpoints are elsewhere: --resume alone fails.
        nothing = (f"checkpoint_dir {ckpt} holds no checkpoint to continue it from" if ckpt is not None else
                   "this run names no checkpoint_dir to continue it from (--resume with the one it saved into)")
        raise UserError(f"{unfinished}, and {nothing}; pass --overwrite to replace it, or choose another folder")
    others = [path.name for path in written if path.name not in (RESULTS_FILE, STEPS_FILE) and path.exists()]
    if others:
        raise UserError(f"output_dir {out} already holds {', '.join(others)}, which this run would replace; choose "
                        f"another folder, or pass --overwrite to replace {'it' if len(others) == 1 else 'them'}")


def _check_resumed_log(log: Path, ckpt: Path) -> None:
    """Refuse to resume a checkpoint into the steps.jsonl of another run, which the resumed
    run would continue as if it were its own (two runs spliced into one log).

    A run's id is in its checkpoints' meta.json and in every line of its log: a line with
    another id is another run's. (Losses are no proof: two runs of one seed and data log
    the same first loss.) Where the checkpoint or a line has no id (written before run ids
    were), the losses are compared instead: the checkpoint holds every step's loss up to its
    own, and the log the same numbers, written from the same floats. A checkpoint that
    cannot be read is left for the resume to report."""
    if (latest := latest_meta(ckpt)) is None:
        return
    folder, meta = latest
    try:
        saved, run_id = meta["losses"], meta.get("run_id")
        lines = log.read_text().splitlines() if log.is_file() else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    for line in lines:
        try:
            record = json.loads(line)
            step = int(record["step"])
            if run_id is not None and record.get("run_id") not in (None, run_id):
                raise UserError(f"{log} is the log of another run than checkpoint {folder}'s (its run id "
                                f"{str(record['run_id'])[:12]}..., the checkpoint's {str(run_id)[:12]}...), and "
                                f"resuming would splice the two; resume into the checkpoint's own output folder, "
                                f"or a new one")
            if run_id is not None and "run_id" in record:
                continue
            loss = float(record["loss"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a line cut short by a killed run: the resume drops it; an evaluation's line
        if not 1 <= step <= len(saved):
            continue  # past the checkpoint: the resume drops it
        expected = float(saved[step - 1])
        if loss != expected and not (math.isnan(loss) and math.isnan(expected)):
            raise UserError(f"{log} is the log of another run than checkpoint {folder}'s (step {step}: loss {loss} "
                            f"there, {expected} in the checkpoint), and resuming would splice the two; resume "
                            f"into the checkpoint's own output folder, or a new one")


def _check_checkpoint_folder(ckpt: Path, paths: dict[str, Path]) -> None:
    """Refuse what a save or pruning would delete that the checkpointer did not write, and a
    path the run writes or reads (`paths`: key -> path) where a save or pruning would."""
    for key, folder in paths.items():
        if folder == ckpt or ckpt.resolve() not in folder.resolve().parents:
            continue
        inside = folder.resolve().relative_to(ckpt.resolve()).parts[0]
        if inside.startswith("step-") or inside == LATEST:
            raise UserError(f"{key} {folder} is inside {ckpt / inside}, which a checkpoint save replaces (and pruning "
                            f"deletes a step folder): choose a place outside it")
    for leftover in leftovers(ckpt) if ckpt.is_dir() else []:
        if not written_here(leftover):
            raise UserError(f"{leftover} is in the way: a checkpoint save deletes leftovers of that name, and nothing "
                            f"shows te_mixtral wrote it; move it away or delete it yourself")


# An export's folders beside it (`DIR.tmp`, `DIR.old`), each deleted once the export is in.
_STAGED_AS = {".tmp": "written first", ".old": "moved to as it is replaced"}


def _check_staging(key: str, folder: Path, paths: dict[str, Path]) -> None:
    """Refuse a path the run writes or reads (`paths`: key -> path) at or inside a folder the
    export `folder` stages in: an output or input there would fail the export after training,
    'in the way' (the next export's, under train.save_every), or be deleted with it were it empty."""
    for suffix, how in _STAGED_AS.items():
        staged = sibling(staged_beside(folder), suffix)
        for other, path in paths.items():
            if path.resolve() == staged or staged in path.resolve().parents:
                raise UserError(f"{other} {path} is where the {key} export {folder} is {how}, and deleted after; "
                                f"choose another name for one of them")


def _holds_checkpoints(folder: Path) -> bool:
    return folder.is_dir() and any(p.name == "latest" or p.name.startswith("step-") for p in folder.iterdir())


def _check_export_folder(key: str, folder: Path, overwrite: bool, protected: dict[str, Path | None],
                         own_run: str | None) -> None:
    """`own_run` is the run id of the checkpoint a resume continues (None for a new run): an
    export its run wrote is this run's own to replace."""
    resolved = staged_beside(folder)
    for what, path in protected.items():
        if path is None:
            continue
        path = path.resolve()
        if resolved == path or resolved in path.parents:
            raise UserError(f"{key} {folder} would write into {what} ({path}): export to a folder of its own")
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{key} {folder} is a file, not a folder")
    check_scratch(sibling(resolved, ".tmp"), f"the {key} export")
    check_scratch(sibling(resolved, ".old"), f"the export that {key} replaces")
    if not folder.is_dir() or overwrite:
        return
    read_with = sorted(p.name for p in folder.iterdir() if p.name in _READ_WITH_EXPORT)
    if read_with:
        raise UserError(f"{key} {folder} holds {', '.join(read_with)}, which transformers would read with the "
                        f"export (a model.safetensors in place of its weights, an added_tokens.json as tokens the "
                        f"model does not have); move {'it' if len(read_with) == 1 else 'them'} away, or pass "
                        f"--overwrite to replace {'it' if len(read_with) == 1 else 'them'}")
    if _holds_export(folder):
        for kind, shown_by in _KIND_SHOWN_BY.items():
            if kind != key and (folder / shown_by).is_file():
                raise UserError(f"{key} {folder} holds an earlier {kind} export ({shown_by}), which this export would "
                                f"replace; choose another folder, or pass --overwrite to replace it")
        if own_run is None or _export_run_id(folder) != own_run:
            raise UserError(f"{key} {folder} holds the export of another run, which this export would replace; "
                            f"choose another folder, or pass --overwrite to replace it")
        return
    theirs = sorted(p.name for p in folder.iterdir() if is_export_file(p.name))
    if theirs:
        raise UserError(f"{key} {folder} holds {', '.join(theirs[:3])}{' ...' if len(theirs) > 3 else ''}, which "
                        f"the export would replace, and no earlier te_mixtral export; choose another folder, or "
                        f"pass --overwrite to replace them (the folder's other files are kept either way)")


def _holds_export(folder: Path) -> bool:
    """Whether `folder` holds a te_mixtral export: its marker, or the marker of the export
    being replaced when a run died midway (`files.replace_files` keeps it in `DIR.old`)."""
    return _marker(folder) is not None


def _marker(folder: Path) -> Path | None:
    return next((marker for marker in (folder / EXPORT_MARKER, sibling(staged_beside(folder), ".old") / EXPORT_MARKER)
                 if marker.is_file()), None)


def export_marker(run_id: str | None) -> str:
    """The text of an export's marker: the id of the run that wrote it (training/checkpoint.py
    TrainState.run_id), whose resumes may replace it unasked; None for an export no run made."""
    return json.dumps({"written_by": "te_mixtral", "run_id": run_id}) + "\n"


def _export_run_id(folder: Path) -> str | None:
    """The id of the run whose export `folder` holds; None where its marker names none (an
    export written before markers held one) or cannot be read."""
    try:
        run_id = json.loads(_marker(folder).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) else None


def _resumed_run_id(ckpt: Path) -> str | None:
    """The run id of the checkpoint a resume continues; None where there is none, or it has
    none (written before run ids), or it cannot be read (the resume reports that)."""
    latest = latest_meta(ckpt)
    run_id = latest[1].get("run_id") if latest is not None else None
    return run_id if isinstance(run_id, str) else None
