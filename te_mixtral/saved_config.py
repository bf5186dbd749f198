"""Config mappings as files hold them: flattened to full keys and back, and older saved
layouts upgraded to today's.

Runs save their config (config.yaml, the results.json header, a checkpoint's meta.json) as a
nested mapping. Reading one back goes through `upgrade_saved`, so a run saved before a key
moved or was renamed still loads, compares with today's runs on a results page and resumes.

A saved config names every key because a run writes every key, not because anyone asked for
it: fp8's options in a loop run, at the default of the day they ran, which may have changed
since. Loaded again with `--config`, such a file is known as saved (`is_saved`), and a key
that changes nothing in its run is taken as saved (`config_checks.check_needs`), where a
config written by hand, or the command line, is refused for it.
"""

import hashlib
import json
import re
from pathlib import Path

import yaml

from te_mixtral.errors import UserError

# The first line of the config.yaml a run saves, which marks it as saved. It holds the digest of
# the config below it (`_digest`): a copy edited by hand keeps the line, and where the line alone
# marked it, a key edited in that changes nothing in its run was taken, and ignored, silently.
SAVED_MARK = ("# A te_mixtral run's config, saved whole: every key as it ran, those that changed nothing in it too "
              "(sha256 {})\n")
_MARKED = re.compile(re.escape(SAVED_MARK).replace(re.escape("{}"), "([0-9a-f]{64})"))
# Where a run records its results, its config in the header (measure/report.py writes it).
RESULTS_FILE = "results.json"

SECTION_NAMES = ("model", "data", "train", "lora", "fp8")


def flatten(config: dict, where: str = "the config") -> dict[str, object]:
    """{"train": {"lr": ...}, "tier": ...} -> {"train.lr": ..., "tier": ...}, in config order."""
    flat = {}
    for key, value in config.items():
        if key in SECTION_NAMES:
            if not isinstance(value, dict):
                raise UserError(f"'{key}' in {where} must be a mapping of keys")
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def _digest(raw) -> str:
    """The SHA-256 of a config as YAML reads it: its comments, layout and key order are not part of it."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()


def saved_yaml(config: dict) -> str:
    """A run's whole config (`config.to_dict`) as its config.yaml: `SAVED_MARK`, then the keys
    in config order."""
    text = yaml.safe_dump(config, sort_keys=False)
    return SAVED_MARK.format(_digest(yaml.safe_load(text))) + text


def is_marked(text: str) -> bool:
    """Whether a config file's `text` starts with `SAVED_MARK`, whatever was edited since."""
    return _MARKED.match(text) is not None


def is_saved(path: Path, text: str, raw) -> bool:
    """Whether the config file at `path` (its `text`, read as `raw`) is a config a run saved: it
    starts with `SAVED_MARK` and holds the config the mark's digest names, or, saved before runs
    wrote that mark, the results.json its run wrote beside it records the same config."""
    marked = _MARKED.match(text)
    if marked and marked.group(1) == _digest(raw):
        return True
    results = path.parent / RESULTS_FILE
    if not results.is_file():
        return False
    try:
        recorded = json.loads(results.read_text())
    except (OSError, UnicodeDecodeError, ValueError):  # not a run's results
        return False
    header = recorded.get("header") if isinstance(recorded, dict) else None
    return isinstance(header, dict) and header.get("config") == raw


def _nest(flat: dict[str, object]) -> dict:
    """The inverse of `flatten`: {"train.lr": ...} -> {"train": {"lr": ...}}."""
    nested: dict = {}
    for key, value in flat.items():
        section, _, name = key.partition(".")
        if name and section in SECTION_NAMES:
            nested.setdefault(section, {})[name] = value
        else:
            nested[key] = value
    return nested


# Keys that moved or were renamed, old full key -> today's. Configs saved by older runs
# (config.yaml, results.json headers, checkpoints' meta.json) are read through
# `upgrade_saved`, so that they still load, compare with today's runs and resume.
MOVED_KEYS = {
    "model.num_local_experts": "model.num_experts",
    "save_every": "train.save_every",
    "checkpoint_every": "train.checkpoint_every",
    "mxfp8_mode": "fp8.mode",
    "fp8_min_rows_per_expert": "fp8.min_rows_per_expert",
    "fp8_weight_cache": "fp8.weight_cache",
}


def _tensorboard_as_report_to(on) -> str:
    if not isinstance(on, bool):
        raise UserError(f"tensorboard (now report_to tensorboard) must be true or false, got {on!r}")
    return "tensorboard" if on else "none"


# Keys that were renamed as their values changed type, old full key -> (today's key, the old
# value as today's). They were switches, and stay so on the command line (`--tensorboard`
# alone means true).
RETYPED_KEYS = {
    "tensorboard": ("report_to", _tensorboard_as_report_to),
}


# Keys that were taken out, full key -> the value they had in every run before they existed.
# A saved config holding one at that value is today's config (the key changed nothing there);
# at any other value it describes a run this version cannot repeat.
REMOVED_KEYS = {
    "train.optimizer_overlap": False,  # the update on its own stream beside the next forward: did not pay
}


def upgrade_key(key: str, value) -> tuple[str, object]:
    """An old key and its value as today's key and value (others unchanged)."""
    if key in RETYPED_KEYS:
        new, convert = RETYPED_KEYS[key]
        return new, convert(value)
    return MOVED_KEYS.get(key, key), value


def upgrade_saved(raw: dict, where: str = "a saved config") -> dict:
    """A config as some version of `to_dict` wrote it (or a YAML file), in today's layout.

    A renamed key keeps its place, and a key moved into a section goes to the section's end
    (where `TrainConfig` declares the schedules that moved), so an upgraded config lists its
    keys in today's order: reproduce commands and page warnings list keys in that order.
    """
    flat = flatten(raw, where)
    for key, before in REMOVED_KEYS.items():
        if key in flat and flat.pop(key) != before:
            raise UserError(f"{where} sets {key}, which this version no longer has; only a run without it "
                            f"({key} {before}) can be repeated or resumed here")
    for old, new in [*MOVED_KEYS.items(), *((old, new) for old, (new, _) in RETYPED_KEYS.items())]:
        if old in flat and new in flat:
            raise UserError(f"{where} sets both '{old}' and '{new}', its new name: keep '{new}'")
    return _nest(dict(upgrade_key(key, value) for key, value in flat.items()))
