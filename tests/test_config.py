"""Config fields carry their own meaning and role: `--help` lists them, saved configs of
older runs (keys since moved) still load, and bare names still find moved keys."""

import dataclasses
import json
import re
import shutil

import pytest
import torch
import yaml
from conftest import REPO
from launch import run_cli

from te_mixtral.config import (
    is_switch,
    load_config,
    load_run_config,
    resumable_keys,
    settings,
    to_dict,
    workload_keys,
)
from te_mixtral.errors import UserError
from te_mixtral.experts.options import FP8Options
from te_mixtral.saved_config import MOVED_KEYS, REMOVED_KEYS, flatten, saved_yaml, upgrade_saved

TINY = str(REPO / "configs" / "tiny.yaml")
RESULTS = REPO / "docs" / "results"


def old_layout(config: dict) -> dict:
    """`config` (today's `to_dict`) as a run saved it before `save_every` and
    `checkpoint_every` moved into `train`: top level, between `save_hf` and `checkpoint_keep`."""
    old = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    moved = {k: old["train"].pop(k) for k in ("save_every", "checkpoint_every")}
    out = {}
    for key, value in old.items():
        out[key] = value
        if key == "save_hf":
            out["save_every"] = moved["save_every"]
        if key == "checkpoint_dir":
            out["checkpoint_every"] = moved["checkpoint_every"]
    return out


def test_every_key_has_a_one_line_meaning():
    config = to_dict(load_config())
    assert list(settings()) == list(flatten(config))  # every key, sections included, in config order
    for key, f in settings().items():
        assert f.metadata["help"].strip() and "\n" not in f.metadata["help"], key


def test_roles_follow_the_fields():
    assert {"model.hidden_size", "train.lr", "data.seq_len", "train.timing_warmup_steps"} <= workload_keys()
    assert not {"train.checkpoint_every", "train.save_every", "train.log_every", "tier", "output_dir"} & workload_keys()
    assert {"train.checkpoint_every", "train.save_every", "checkpoint_keep", "resume"} <= resumable_keys()
    assert not {"train.steps", "train.lr", "train.log_every", "tier"} & resumable_keys()


def test_an_old_saved_config_upgrades_to_todays_layout_and_order():
    cfg = load_config(TINY, {"checkpoint_every": "3", "checkpoint_dir": "ckpt", "save_every": "2", "save_hf": "hf"})
    today = to_dict(cfg)
    old = old_layout(today)
    assert "checkpoint_every" in old and "checkpoint_every" not in old["train"]
    upgraded = upgrade_saved(old)
    assert upgraded == today
    assert list(flatten(upgraded)) == list(flatten(today))  # same order: reproduce commands list keys in it
    assert upgrade_saved(today) == today


def test_an_old_yaml_file_still_loads(tmp_path):
    today = to_dict(load_config(TINY, {"checkpoint_every": "3", "checkpoint_dir": "ckpt"}))
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old_layout(today), sort_keys=False))
    assert to_dict(load_config(str(path))) == today


def test_every_committed_runs_saved_config_loads_to_its_recorded_config(tmp_path, monkeypatch):
    """Every config a committed run saved (docs/results: its config.yaml, the config in its
    results.json's header, a checkpoint's meta.json) loads as `--config` loads it, on the run's
    world size, to the config it recorded: keys added since take their defaults, every saved
    key reads back as saved. A run of a feature taken out since (`REMOVED_KEYS`, at another
    value than the one every run had before it) is refused, in one line."""
    # Before, 18 committed config.yaml files were refused: they saved fp8.min_rows_per_expert
    # 3072, the default of their day, in runs of tiers that never read it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on the GPUs they ran on: bf16
    records = [(path, json.loads(path.read_text())["header"]) for path in sorted(RESULTS.rglob("results.json"))]
    records += [(path, json.loads(path.read_text())) for path in sorted(RESULTS.rglob("meta.json"))]
    assert len(records) > 100
    wrong = []
    for i, (record, saved) in enumerate(records):
        path = record.parent / "config.yaml"  # the file beside results.json holds the header's config
        if record.name != "results.json" or not path.is_file():  # the same config, as its run writes a file
            path = tmp_path / str(i) / "config.yaml"
            path.parent.mkdir()
            path.write_text(saved_yaml(saved["config"]))
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else record.relative_to(REPO)
        taken_out = [key for key, before in REMOVED_KEYS.items() if flatten(saved["config"]).get(key, before) != before]
        try:
            loaded = flatten(to_dict(load_run_config(str(path), world_size=saved["world_size"])))
        except UserError as e:
            if not (taken_out and "which this version no longer has" in str(e) and "\n" not in str(e)):
                wrong.append(f"{where}: {e}")
            continue
        recorded = flatten(upgrade_saved(saved["config"]))
        if taken_out or {k: v for k, v in loaded.items() if k in recorded} != recorded:
            wrong.append(f"{where}: loaded to another config than it recorded, or despite {taken_out}")
    assert not wrong, f"{len(wrong)} saved configs of {len(records)}:\n" + "\n".join(wrong)


# Every key that names a file or folder (or a hub id), and a path for each.
PATH_KEYS = {"output_dir": "out", "checkpoint_dir": "ckpt", "save_hf": "hf", "save_adapter": "adapter",
             "loss_check": "ref/results.json", "model_path": "base", "data.dataset": "data.jsonl",
             "data.tokenizer": "tokenizer", "lora.init": "lora_adapter", "ep_placement": "load/results.json"}


def test_a_home_in_a_config_files_paths_is_expanded_for_every_path_key(tmp_path, monkeypatch):
    """The shell expands a `~` on the command line, not in a config file: there it stood as
    written, so transformers read `model_path: ~/m` as a hub id and the run wrote `output_dir:
    ~/out` into a folder named `~` of the current one. Every path key alike is the home's."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    shutil.copytree(REPO / "tests" / "lora_adapter", home / "lora_adapter")  # read as the config loads
    nested = {}
    for key, path in PATH_KEYS.items():
        section, _, name = key.rpartition(".")
        (nested.setdefault(section, {}) if section else nested)[name] = f"~/{path}"
    config = tmp_path / "run.yaml"
    nested["lora"]["rank"], nested["ep_size"] = 2, 2  # ep_placement places experts at EP > 1
    config.write_text(yaml.safe_dump(nested))
    flat = flatten(to_dict(load_config(str(config), world_size=2)))
    assert {key: flat[key] for key in PATH_KEYS} == {key: str(home / path) for key, path in PATH_KEYS.items()}
    assert {key for key, f in settings().items() if f.metadata["path"]} == set(PATH_KEYS)  # and no other key


def test_a_key_in_both_places_is_refused():
    old = {"checkpoint_every": 5, "train": {"checkpoint_every": 3}}
    with pytest.raises(UserError, match="both 'checkpoint_every' and 'train.checkpoint_every'"):
        upgrade_saved(old)


def test_moved_keys_name_keys_that_exist_today():
    assert set(MOVED_KEYS.values()) <= set(settings())
    assert not set(MOVED_KEYS) & set(settings())


def test_a_removed_key_reads_as_absent_at_its_old_value_and_is_refused_at_another():
    assert not set(REMOVED_KEYS) & set(settings())
    key, before = next(iter(REMOVED_KEYS.items()))
    section, name = key.split(".")
    today = to_dict(load_config(None, {}))
    saved = {**today, section: {**today[section], name: before}}
    assert upgrade_saved(saved) == today
    with pytest.raises(UserError) as refused:
        upgrade_saved({**today, section: {**today[section], name: not before}}, "a checkpoint")
    assert f"a checkpoint sets {key}, which this version no longer has" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_fp8_tiers_old_top_level_keys_read_as_its_section():
    """Runs saved, and command lines written, before the FP8 tier's options became the `fp8`
    section name them at the top level; both still set the section."""
    want = FP8Options(mode="fp8-hopper", min_rows_per_expert=7, weight_cache=False)
    old = {"mxfp8-mode": "fp8-hopper", "fp8_min_rows_per_expert": "7", "fp8-weight-cache": "false"}
    assert load_config(TINY, {**old, "tier": "device_mxfp8"}).fp8 == want
    saved = {k: v for k, v in to_dict(load_config(TINY)).items() if k != "fp8"}
    saved.update(mxfp8_mode="fp8-hopper", fp8_min_rows_per_expert=7, fp8_weight_cache=False)
    assert upgrade_saved(saved)["fp8"] == dataclasses.asdict(want)
    assert is_switch("fp8_weight_cache") and is_switch("fp8.weight_cache")


def test_help_groups_the_keys_by_who_owns_them():
    # Before, one list of a hundred keys: the tier's options under `fp8`, which said nothing of a
    # tier, eighty rows from --tier; the run's own keys (the tier, EP, --model, the exports) last.
    from te_mixtral.config import SECTIONS
    from te_mixtral.experts.registry import EXPERT_TIERS

    groups = help_groups(run_cli(["--help"]).stdout)
    headings = list(groups)
    assert "" not in groups and all(rows for rows in groups.values())
    run = groups[headings[0]]  # the run's own keys first, the tier first of them
    assert list(run)[0] == "tier" and {"ep_size", "model_path", "save_hf", "save_adapter", "checkpoint_dir"} <= set(run)
    assert all("." not in key for key in run)
    owned = [(name, tier.options) for name, tier in EXPERT_TIERS.items() if tier.options is not None]
    assert owned, "no tier declares options"
    for (name, options), heading in zip(owned, headings[1:]):  # each tier's options right after the tier
        [section] = [s for s, cls in SECTIONS.items() if cls is options]
        assert heading.startswith(f"tier {name}'s options"), heading
        assert list(groups[heading]) == [f"{section}.{f.name}" for f in dataclasses.fields(options)]
    for section, cls in SECTIONS.items():  # every other section a group of its own, named by it
        if cls not in dict(owned).values():
            [heading] = [h for h in headings if h.startswith(f"{section}.*")]
            assert list(groups[heading]) == [f"{section}.{f.name}" for f in dataclasses.fields(cls)]


def test_each_tier_option_section_is_declared_by_the_one_tier_that_reads_it():
    from te_mixtral.config import SECTIONS
    from te_mixtral.experts import options
    from te_mixtral.experts.registry import EXPERT_TIERS

    declared = [cls for cls in SECTIONS.values() if cls.__module__ == options.__name__]
    owners = [tier.options for tier in EXPERT_TIERS.values() if tier.options is not None]
    assert sorted(owners, key=id) == sorted(declared, key=id), "a tier's options with no tier, or two tiers'"


def test_bare_names_find_the_moved_keys():
    cfg = load_config(TINY, {"checkpoint-every": "10", "checkpoint-dir": "ckpt", "save_every": "4", "save-hf": "hf"})
    assert (cfg.train.checkpoint_every, cfg.train.save_every) == (10, 4)
    with pytest.raises(UserError, match="train.checkpoint_every needs checkpoint_dir"):
        load_config(TINY, {"checkpoint-every": "10"})


def key_listing(stdout: str) -> list[str]:
    """The lines of `--help`'s key listing, after its column names (the first empty line)."""
    listing = stdout.split("config keys, with their values")[1].splitlines()
    return listing[listing.index("") + 1:]


def help_groups(stdout: str) -> dict[str, dict[str, tuple[str, str, str]]]:
    """{heading: {key: (value, default, meaning)}} from the key listing of `--help`: its rows
    indented by two, each group's heading above them (a row before any heading goes under '').
    A meaning wrapped goes on in lines indented further (or all of it there, in a narrow
    terminal), a heading wrapped in lines of its own, unindented."""
    groups, heading, row = {"": {}}, "", None
    for line in key_listing(stdout):
        if line and not line.startswith(" "):
            if row is not None or not heading:
                heading, row = line, None
                groups[heading] = {}
            else:  # a heading's next line
                groups[heading + " " + line] = groups.pop(heading)
                heading += " " + line
        elif line.startswith("   "):  # a meaning's next line
            key, (value, default, meaning) = row, groups[heading][row]
            groups[heading][key] = (value, default, f"{meaning} {line.strip()}".strip())
        elif line.strip():
            key, value, default, *meaning = line.split(maxsplit=3)
            groups[heading][key], row = (value, default, "".join(meaning)), key
    return {heading: rows for heading, rows in groups.items() if rows or heading}


def help_rows(stdout: str) -> dict[str, tuple[str, str, str]]:
    """{key: (value, default, meaning)} from the key listing of `--help`."""
    return {key: row for rows in help_groups(stdout).values() for key, row in rows.items()}


@pytest.mark.parametrize("columns", [100, 60])
def test_help_wraps_the_key_listing_to_the_terminal(columns, monkeypatch):
    # Before, a meaning was one line of up to 400 characters, a heading up to 140, whatever the terminal.
    monkeypatch.setenv("COLUMNS", str(columns))  # what shutil.get_terminal_size reads first, as argparse does
    proc = run_cli(["--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    # What cannot be broken may stick out: one word, or a row's key, value and default alone.
    too_wide = [line for line in key_listing(proc.stdout) if len(line) > columns and len(line.split()) > 1
                and not (re.match(r"  \S", line) and len(line.split()) <= 3)]
    assert not too_wide, too_wide[:3]
    fields = settings()  # and nothing lost: every meaning whole
    assert {key: row[2] for key, row in help_rows(proc.stdout).items()} == {
        key: " ".join(f.metadata["help"].split()) for key, f in fields.items()}


def test_help_lists_every_key_with_its_value_default_and_meaning():
    proc = run_cli(["--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Fine-tune a Mixtral-style MoE model" in proc.stdout
    assert not re.search(r"step\s+\d+/\d+", proc.stdout)  # help only: nothing trained
    rows = help_rows(proc.stdout)
    assert sorted(rows) == sorted(settings()) and len(rows) == len(settings())
    assert rows["model.hidden_size"][0] == "64"  # configs/tiny.yaml, the default --config
    assert rows["train.checkpoint_every"] == ("0", "0", settings()["train.checkpoint_every"].metadata["help"])
    assert rows["data.tokenizer"][:2] == ("null", "null") and rows["resume"][:2] == ("false", "false")
    assert rows["model.hidden_size"][1] == "4096"  # the default, beside tiny.yaml's value
    assert rows["train.min_lr"][:2] == ("0.0003", "lr/10")  # a default that follows another key

    proc = run_cli(["--config", "configs/mixtral-8x7b-2layer.yaml", "--lr", "0.5", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = help_rows(proc.stdout)
    assert rows["model.hidden_size"][0] == "4096" and rows["train.lr"][0] == "0.5"
