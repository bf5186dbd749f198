"""The command line that reproduces a run, rebuilt from the config it saved.

Every run saves its full config (config.yaml, and `header.config` in results.json), but a
reader wants the short command someone would type:

    python run_finetune_ep.py --config configs/mixtral-8x7b-2layer.yaml --tier hf --ep-size 1 \
        --output-dir /root/out/r2/hf --loss-check /root/out/r2/loop/results.json

`reproduce_command` tries every `configs/*.yaml`, keeps the one that needs the fewest
overrides, and writes those overrides as flags, but for the keys that changed nothing in the
run (`config.changes_nothing`: beside model_path, the checkpoint's config.json is the model). `tests/results/test_pages.py` parses the
command back through `run_finetune_ep.py`'s own argument parser and checks that it loads
to the very same config.

Pitfalls the value formatting handles: floats are written with `repr` (shortest text that
reads back to the same float; `1e-05` is fine, config.py accepts YAML 1.1's exponent
strings for float keys); text is shell-quoted; and a text value that starts with `--`
(a prompt, say) is written `--key=value`, or the app would read it as the next flag.
The command names the config file by its path under the repository root, and its
overrides are those against that file *today*: if the file changes, the command drifts,
which is why the results page prints the full config beside it.
"""

import shlex
from pathlib import Path

import yaml

from te_mixtral.config import FOLLOWS, changes_nothing, headline_keys, load_config, to_dict
from te_mixtral.errors import UserError
from te_mixtral.saved_config import flatten, upgrade_saved

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def cli_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return shlex.quote(str(value))


def cli_flag(key: str) -> str:
    # Top-level keys read best with dashes (--ep-size, as in the README); dotted keys are
    # written as they appear in the YAML (--train.lr).
    return f"--{key}" if "." in key else f"--{key.replace('_', '-')}"


def config_overrides(config: dict, base: dict, base_sets: frozenset[str] = frozenset()) -> list[tuple[str, object]]:
    """(key, value) for every key where `config` differs from `base`, in config order. A key
    that follows another (`config.FOLLOWS`) where the base config file leaves it unset
    (`base_sets`: the keys the file sets) is named only where it differs from what it would
    follow to: its value from the other key's named value."""
    flat, flat_base = flatten(config), flatten(base)
    differs = {k for k, v in flat.items() if flat_base.get(k, object()) != v}
    for key, follows in FOLLOWS.items():
        if key in flat and key not in base_sets:
            differs.discard(key)
            if flat[key] != follows.value(flat[follows.source]):
                differs.add(key)
    return [(k, v) for k, v in flat.items() if k in differs]


def reproduce_command(config: dict, world_size: int, configs_dir: Path = CONFIGS_DIR) -> str | None:
    """A command line that recreates `config` (a `to_dict(RunConfig)`, today's or an older
    run's) on `world_size` processes; None when no config file in `configs_dir` loads."""
    config = upgrade_saved(config)
    flat = flatten(config)
    best = None
    for path in sorted(configs_dir.glob("*.yaml")):
        try:
            base = to_dict(load_config(str(path)))
        except UserError:
            continue
        base_sets = frozenset(flatten(yaml.safe_load(path.read_text()) or {}))
        # A key that changed nothing in the run is not named: beside model_path, the checkpoint is the model.
        overrides = [(k, v) for k, v in config_overrides(config, base, base_sets)
                     if k not in headline_keys() and not changes_nothing(k, flat)]
        if best is None or len(overrides) < len(best[1]):
            best = (path, overrides)
    if best is None:
        return None
    path, overrides = best
    launcher = (["python", "run_finetune_ep.py"] if world_size == 1 else
                ["torchrun", "--standalone", f"--nproc_per_node={world_size}", "run_finetune_ep.py"])
    words = [*launcher, "--config", f"{configs_dir.name}/{path.name}"]
    for key, value in [(k, config[k]) for k in headline_keys()] + overrides:
        text = cli_value(value)
        words += [f"{cli_flag(key)}={text}"] if str(value).startswith("--") else [cli_flag(key), text]
    return " ".join(words)
