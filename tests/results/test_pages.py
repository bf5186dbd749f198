"""The results page from synthetic runs: its arithmetic, what it flags, its commands, its files."""

import dataclasses
import json
import math
import re
import runpy
import shlex
import sys

import pytest
import torch
from conftest import REPO
from test_config import old_layout

from te_mixtral.cli import parse_args as parse_app_args
from te_mixtral.config import ModelConfig, load_config, to_dict
from te_mixtral.errors import UserError
from te_mixtral.measure.report import run_header, write_results
from te_mixtral.results import pages
from te_mixtral.results.compare import speedup
from te_mixtral.results.pages import build_page, main, write_page
from te_mixtral.results.reproduce import reproduce_command
from te_mixtral.results.runs import find_runs, group_runs
from te_mixtral.saved_config import flatten, upgrade_saved

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = str(REPO / "configs" / "tiny.yaml")


def make_run(root, name, tier, median_ms, *, device="NVIDIA H200", world=1, ep=1, date="2026-11-21T10:00:00",
             overrides=None, loss_check=None, losses=(10.0, 9.0, 8.5, 8.0), p90_ms=None, mfu=0.25, ran=None):
    """Write a run folder `root/name` as run_finetune_ep.py would, with made-up numbers."""
    cfg = load_config(TINY, {"tier": tier, "ep_size": str(ep), "output_dir": str(root / name), **(overrides or {})},
                      world_size=world)
    header = {**run_header(cfg, device, world), "date": date, "precision": "bf16",
              "ran": {"experts": tier, **(ran or {})}}
    summary = {"timed_steps": 3, "median_step_ms": median_ms, "p90_step_ms": p90_ms or 1.2 * median_ms,
               "tokens_per_s": 1000 * world, "tokens_per_s_per_gpu": 1000.4, "tflops_per_gpu": 12.34, "mfu": mfu,
               "peak_memory_gib": 3.456}
    extra = {"loss_check": loss_check} if loss_check else None
    write_results(root / name, header, summary, list(losses), extra)
    return root / name


def page_for(paths, title=None, notes=None):
    groups = group_runs(find_runs([str(p) for p in paths]))
    assert len(groups) == 1
    return build_page(next(iter(groups.values())), title, notes, "python -m te_mixtral.results.pages ...")


def table_row(markdown: str, label: str) -> list[str]:
    """The cells of the tier-table row whose first cell is `label`."""
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(f"`{label}`"):
            return cells
    raise AssertionError(f"no row {label!r} in:\n{markdown}")


def checked(max_rel, tolerance=5e-2, passed=None, step=2):
    return {"reference": "loop/results.json", "passed": max_rel <= tolerance if passed is None else passed,
            "tolerance": tolerance, "max_rel_diff": max_rel, "worst_step": step}


# --- arithmetic -----------------------------------------------------------------------------


def test_speedups_and_table_values(tmp_path):
    runs = [make_run(tmp_path, "hf", "hf", 200.0, loss_check=checked(0.0)), make_run(tmp_path, "loop", "loop", 100.0),
            make_run(tmp_path, "cg", "custom_grouped", 50.0, p90_ms=60.0, loss_check=checked(1.234e-3))]
    page = page_for(runs)
    assert table_row(page.markdown, "custom_grouped") == [
        "`custom_grouped`", "1 / 1", "50.0", "60.0", "4.00x", "2.00x", "1,000", "12.3", "25.0 %", "3.46",
        "passed: first 0.0e+00, max 0.0e+00 (step 0), mean 0.0e+00"]
    assert table_row(page.markdown, "hf")[4:6] == ["1.00x", "0.50x"]
    assert table_row(page.markdown, "loop")[4:6] == ["2.00x", "1.00x"]
    assert table_row(page.markdown, "loop")[-1] == "reference"
    hf, loop, cg = page.runs  # sorted in tier order
    assert (hf.tier, loop.tier, cg.tier) == ("hf", "loop", "custom_grouped")
    assert speedup(cg, hf) == pytest.approx(4.0) and speedup(cg, None) is None
    assert "Check before reading" not in page.markdown


def test_without_a_loop_run_nothing_is_checked(tmp_path):
    page = page_for([make_run(tmp_path, "hf", "hf", 100.0), make_run(tmp_path, "gl", "grouped_linear", 90.0)])
    assert table_row(page.markdown, "grouped_linear")[-1] == "not checked: no `loop` run of this workload"


def test_a_run_without_recompute_is_checked_against_a_loop_run_with_it(tmp_path):
    # Where `loop` only fits with recompute: the losses must agree whatever the recompute,
    # while every other workload difference still keeps runs apart.
    paths = [make_run(tmp_path, "loop", "loop", 100.0, overrides={"recompute": "selective"}),
             make_run(tmp_path, "cg", "custom_grouped", 50.0, overrides={"recompute": "none"}),
             make_run(tmp_path, "cg_lr", "custom_grouped", 50.0, overrides={"recompute": "none", "lr": "1e-3"})]
    markdown = page_for(paths).markdown
    no_recompute, other_lr = table_row(markdown, "custom_grouped [B]"), table_row(markdown, "custom_grouped [C]")
    assert no_recompute[-1].startswith("passed (against `loop` [A], train.recompute: selective -> none): first")
    assert no_recompute[5] == "-"  # a speedup still needs the same workload
    assert other_lr[-1] == "not checked: no `loop` run of this workload"


def test_a_cpu_page_names_what_it_measured(tmp_path):
    cpu = page_for([make_run(tmp_path / "cpu", "loop", "loop", 100.0, device="cpu", mfu=None)]).markdown
    assert "tokens/s/process" in cpu and "TFLOP/s/process" in cpu and "per process" in cpu
    assert "peak resident set" in cpu and "caching allocator" not in cpu  # no GPU allocator on a CPU
    gpu = page_for([make_run(tmp_path / "gpu", "loop", "loop", 100.0)]).markdown
    assert "tokens/s/GPU" in gpu and "caching allocator" in gpu and "resident set" not in gpu


def test_unknown_mfu_reads_na(tmp_path):
    page = page_for([make_run(tmp_path, "loop", "loop", 100.0, mfu=None)])
    assert table_row(page.markdown, "loop")[8] == "n/a"


@pytest.mark.parametrize("present", [["loop", "custom_grouped"], ["custom_grouped"], ["hf", "custom_grouped"]])
def test_missing_baselines_are_dashes_and_said(tmp_path, present):
    paths = [make_run(tmp_path, tier, tier, 100.0 if tier != "custom_grouped" else 40.0) for tier in present]
    page = page_for(paths)
    row = table_row(page.markdown, "custom_grouped")
    for column, tier in ((4, "hf"), (5, "loop")):
        if tier in present:
            assert row[column] == "2.50x"
        else:
            assert row[column] == "-"
            assert f"No `{tier}` run in this set" in page.markdown


def test_mismatched_configs_are_flagged_and_not_compared(tmp_path):
    paths = [make_run(tmp_path, "loop", "loop", 100.0, overrides={"seq_len": "64"}),
             make_run(tmp_path, "loop32", "loop", 60.0, overrides={"seq_len": "32"}),
             make_run(tmp_path, "cg32", "custom_grouped", 30.0, overrides={"seq_len": "32"}),
             make_run(tmp_path, "cgfp", "custom_grouped", 20.0, overrides={"seq_len": "32", "lr": "1e-3"})]
    page = page_for(paths)
    md = page.markdown
    assert "Mismatched configs: workload B differs from A in `data.seq_len: 64 -> 32`" in md
    assert "workload C differs from A in `data.seq_len: 64 -> 32`; `train.lr: 0.003 -> 0.001`" in md
    # Each custom_grouped run is compared with the loop run of its own workload, or with none.
    labels = [r.label for r in page.runs]
    assert labels == ["loop [A]", "loop [B]", "custom_grouped [B]", "custom_grouped [C]"]
    assert table_row(md, "custom_grouped [B]")[5] == "2.00x"
    assert table_row(md, "custom_grouped [C]")[5] == "-"
    assert table_row(md, "loop [A]")[5] == "1.00x"


def test_output_and_logging_keys_are_not_workload(tmp_path):
    paths = [make_run(tmp_path, "loop", "loop", 100.0, overrides={"log_every": "1"}),
             make_run(tmp_path, "cg", "custom_grouped", 50.0, overrides={"loss_check": "x/results.json"})]
    page = page_for(paths)
    assert "Mismatched" not in page.markdown
    assert table_row(page.markdown, "custom_grouped")[5] == "2.00x"


def test_schedules_are_not_workload_and_old_saved_configs_compare(tmp_path):
    paths = [make_run(tmp_path, "loop", "loop", 100.0, overrides={"checkpoint_every": "2", "checkpoint_dir": "c"}),
             make_run(tmp_path, "cg", "custom_grouped", 50.0)]
    # The loop run as a run saved it before `checkpoint_every` and `save_every` moved into `train`.
    results = json.loads((paths[0] / "results.json").read_text())
    results["header"]["config"] = old_layout(results["header"]["config"])
    (paths[0] / "results.json").write_text(json.dumps(results))
    page = page_for(paths)
    assert "Mismatched" not in page.markdown
    assert table_row(page.markdown, "custom_grouped")[5] == "2.00x"
    assert "checkpoint_every: 2\n" in page.markdown.split("### `loop`")[1]  # its config as it was saved


def test_same_tier_twice_gets_told_apart_and_ep_matched(tmp_path):
    paths = [make_run(tmp_path, "loop1", "loop", 100.0, world=2, ep=1), make_run(tmp_path, "loop2", "loop", 80.0,
                                                                                 world=2, ep=2),
             make_run(tmp_path, "cg2", "custom_grouped", 40.0, world=2, ep=2)]
    page = page_for(paths)
    assert [r.label for r in page.runs] == ["loop EP1", "loop EP2", "custom_grouped"]
    assert table_row(page.markdown, "custom_grouped")[1] == "2 / 2"
    assert table_row(page.markdown, "custom_grouped")[5] == "2.00x"  # against the EP2 loop, not the EP1 one


def test_repeated_runs_are_told_apart_by_time_and_the_newest_is_the_baseline(tmp_path):
    paths = [make_run(tmp_path, "loop-a", "loop", 100.0, date="2026-11-21T10:00:00"),
             make_run(tmp_path, "loop-b", "loop", 80.0, date="2026-11-21T11:00:00"),
             make_run(tmp_path, "cg", "custom_grouped", 40.0)]
    page = page_for(paths)
    assert [r.label for r in page.runs] == ["loop 11-21 10:00:00", "loop 11-21 11:00:00", "custom_grouped"]
    assert table_row(page.markdown, "custom_grouped")[5] == "2.00x"


def test_runs_that_differ_in_how_they_ran_are_labelled_by_it(tmp_path):
    """Not the workload (the losses are the same, so is the baseline), but what an A/B of them
    compares: the label says it, not the time alone."""
    placed = {"ep_placement": str(tmp_path / "first" / "results.json")}
    paths = [make_run(tmp_path, "loop", "loop", 100.0, world=2, ep=2, date="2026-11-21T10:00:00"),
             make_run(tmp_path, "placed", "loop", 90.0, world=2, ep=2, date="2026-11-21T11:00:00", overrides=placed),
             make_run(tmp_path, "again", "loop", 95.0, world=2, ep=2, date="2026-11-21T12:00:00", overrides=placed),
             # Its file's load placed every layer in order: nothing moved.
             make_run(tmp_path, "unmoved", "loop", 97.0, world=2, ep=2, date="2026-11-21T09:00:00", overrides=placed),
             make_run(tmp_path, "cg", "custom_grouped", 40.0, world=2, ep=2),
             make_run(tmp_path, "cg2", "custom_grouped", 50.0, world=2, ep=2, overrides={"ep_chunks": "2"})]
    for run in paths[1:3]:  # as a placed run records its placement
        results = json.loads((run / "results.json").read_text())
        (run / "results.json").write_text(json.dumps({**results, "expert_load": {"placement": [[1, 0], [0, 1]]}}))
    page = page_for(paths)
    assert [r.label for r in page.runs] == ["loop in order 11-21 09:00:00", "loop in order 11-21 10:00:00",
                                            "loop placed 11-21 11:00:00", "loop placed 11-21 12:00:00",
                                            "custom_grouped ep_chunks 1", "custom_grouped ep_chunks 2"]
    assert "Mismatched" not in page.markdown and {r.workload for r in page.runs} == {"A"}
    assert table_row(page.markdown, "custom_grouped ep_chunks 2")[5] == "1.90x"  # against the newest loop


def test_phase_profiles_get_their_own_table(tmp_path):
    loop = make_run(tmp_path, "loop", "loop", 100.0)
    cg = make_run(tmp_path, "cg", "custom_grouped", 50.0, overrides={"profile_phases": "true"})
    results = json.loads((cg / "results.json").read_text())
    results["phases_ms"] = {"attention": 20.0, "experts": 25.0}
    (cg / "results.json").write_text(json.dumps(results))
    md = page_for([loop, cg]).markdown
    assert "Mismatched" not in md  # profiling runs after training: not part of the workload
    assert "| phase, fwd+bwd: ms (share of the median step) | `custom_grouped` |" in md
    assert "| experts | 25.0 (50 %) |" in md and "| sum of phases | 45.0 (90 %) |" in md
    assert "busiest rank" not in md  # one rank: nothing to balance

    results["expert_rows_per_rank"] = [300, 100, 200, 200]
    (cg / "results.json").write_text(json.dumps(results))
    md = page_for([loop, cg]).markdown
    assert "| expert rows: busiest rank / mean | 1.50x (300 rows) |" in md
    assert "| experts: ms per 1,000 rows of the busiest rank | 83.33 |" in md  # 25 ms / 300 rows


# --- loss checks ---------------------------------------------------------------------------


LOOP_LOSSES = (10.0, 9.0, 8.5, 8.0)


def test_loss_checks_are_recomputed_against_the_loop_run(tmp_path):
    shifted = (10.0, 9.45, 8.9, 8.4)  # every step after the first ~5 % high: a bug's signature
    paths = [make_run(tmp_path, "loop", "loop", 100.0, losses=LOOP_LOSSES),
             make_run(tmp_path, "gl", "grouped_linear", 50.0, losses=shifted),
             make_run(tmp_path, "cg", "custom_grouped", 50.0, losses=(10.0, 9.0, math.nan, 8.0)),
             # recorded as failed at the tolerance of its day, within today's criteria
             make_run(tmp_path, "hf", "hf", 150.0, losses=(10.0001, 9.2, 8.3, 8.1),
                      loss_check=checked(3.16e-2, tolerance=2e-2))]
    md = page_for(paths).markdown
    assert table_row(md, "grouped_linear")[-1] == "**FAILED**: first 0.0e+00, max 5.0e-02 (step 3), mean 3.5e-02"
    assert table_row(md, "custom_grouped")[-1] == "**FAILED**: non-finite loss at step 2"
    assert table_row(md, "hf")[-1].startswith("passed: first 1.0e-05, max 2.4e-02 (step 2)")
    assert "`hf`: the run's own check recorded FAILED" in md and "says passed" in md
    assert "`grouped_linear` fails its loss check" in md and "`custom_grouped` fails its loss check" in md
    assert "`hf` fails" not in md


def test_an_8bit_tier_is_judged_at_its_own_precision(tmp_path):
    eight_bit = (10.05, 9.5, 8.1, 8.3)  # 5e-3 first step: over bf16's bound, within fp8's
    paths = [make_run(tmp_path, "loop", "loop", 100.0, losses=LOOP_LOSSES),
             make_run(tmp_path, "mx", "device_mxfp8", 90.0, losses=eight_bit,
                      ran={"precision": "mxfp8", "recipe": "mxfp8-emulated"},
                      overrides={"fp8.mode": "mxfp8-emulated"})]
    md = page_for(paths).markdown
    row = table_row(md, "device_mxfp8")
    assert row[0] == "`device_mxfp8` (mxfp8-emulated)"
    assert row[5] == "1.11x"  # the tier's mode is what the row compares, not another workload
    assert row[-1].startswith("passed: first 5.0e-03")
    assert "its loss check" not in md


# --- grouping, commands, files -------------------------------------------------------------


def test_runs_group_by_device_and_world_size(tmp_path):
    paths = [make_run(tmp_path, "a", "loop", 100.0, device="NVIDIA H200", date="2026-11-20T23:00:00"),
             make_run(tmp_path, "b", "custom_grouped", 50.0, device="NVIDIA H200", date="2026-11-21T01:00:00"),
             make_run(tmp_path, "c", "loop", 90.0, device="NVIDIA H100 80GB HBM3", world=2, ep=2)]
    assert main([str(p) for p in paths] + ["--out", str(tmp_path / "out"), "--no-plots", "--suffix", "EP test"]) == 0
    pages = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert pages == ["2026-11-21-h100-80gb-hbm3-x2-ep-test.md", "2026-11-21-h200-x1-ep-test.md"]
    h200 = (tmp_path / "out" / "2026-11-21-h200-x1-ep-test.md").read_text()
    assert "runs from 2026-11-20T23:00:00 to 2026-11-21T01:00:00" in h200
    assert "H100" not in h200


def test_reproduce_command_loads_back_to_the_same_config():
    overrides = {"seq_len": "32", "lr": "1e-3", "min_lr": "1e-05", "steps": "7", "generate": "--dash first",
                 "dataset": "my data.txt", "eval_fraction": "0.1", "loss_check": "ref dir/results.json",
                 "tie_word_embeddings": "true"}
    cfg = load_config(TINY, {"tier": "custom_grouped", "ep_size": "2", **overrides}, world_size=2)
    command = reproduce_command(to_dict(cfg), world_size=2)
    words = shlex.split(command)
    assert words[:8] == ["torchrun", "--standalone", "--nproc_per_node=2", "run_finetune_ep.py", "--config",
                         "configs/tiny.yaml", "--tier", "custom_grouped"]
    args, app_overrides = parse_app_args(words[4:])
    assert to_dict(load_config(str(REPO / args.config), app_overrides, world_size=2)) == to_dict(cfg)


def test_reproduce_command_of_an_old_saved_config_is_todays():
    cfg = load_config(TINY, {"checkpoint_every": "5", "checkpoint_dir": "ck", "lr": "1e-3"})
    command = reproduce_command(to_dict(cfg), world_size=1)
    assert command == reproduce_command(old_layout(to_dict(cfg)), world_size=1)
    assert command.endswith("--train.lr 0.001 --train.checkpoint_every 5 --checkpoint-dir ck")


def test_reproduce_command_of_a_run_from_a_checkpoint_leaves_its_model_to_the_checkpoint():
    cfg = load_config(TINY, {"model_path": "mistralai/Mixtral-8x7B-v0.1", "lr": "1e-3"})
    # As the run saved it: its model section is the checkpoint's config.json.
    saved = to_dict(dataclasses.replace(cfg, model=ModelConfig(num_hidden_layers=3, router_aux_loss_coef=0.02)))
    command = reproduce_command(saved, world_size=1)
    assert "--model-path mistralai/Mixtral-8x7B-v0.1" in command and "--model.num_hidden_layers" not in command
    assert "--model.router_aux_loss_coef 0.02" in command  # a training choice, which applies beside it
    args, overrides = parse_app_args(shlex.split(command)[2:])
    load_config(str(REPO / args.config), overrides)  # before: refused, the model's keys named beside model_path


def test_reproduce_command_picks_the_nearest_config_file():
    cfg = load_config(str(REPO / "configs" / "mixtral-8x7b-2layer.yaml"), {"tier": "loop", "output_dir": "/o/loop"})
    assert reproduce_command(to_dict(cfg), world_size=1) == (
        "python run_finetune_ep.py --config configs/mixtral-8x7b-2layer.yaml --tier loop --ep-size 1 "
        "--output-dir /o/loop")


def test_page_names_how_everything_was_made(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("The loop beats hf here because hf's experts index the stacked weight.\n")
    paths = [make_run(tmp_path, "loop", "loop", 100.0), make_run(tmp_path, "hf", "hf", 150.0)]
    assert main([str(tmp_path), "--out", str(tmp_path / "out"), "--title", "Tiers on H200", "--notes",
                 str(notes), "--no-plots"]) == 0
    md = (tmp_path / "out" / "2026-11-21-h200-x1.md").read_text()
    assert md.startswith("# Tiers on H200\n")
    assert "- **GPU**: NVIDIA H200 x 1" in md and "- **Date**: 2026-11-21" in md
    assert "- **Versions**: python 3." in md
    assert f"- **This page**: `python -m te_mixtral.results.pages {tmp_path} --out {tmp_path / 'out'}" in md
    assert "## Notes\n\nThe loop beats hf here" in md
    assert f"### `hf` (`{paths[1]}`)" in md
    assert "python run_finetune_ep.py --config configs/tiny.yaml --tier hf --ep-size 1" in md
    assert "```yaml\nmodel:\n  vocab_size: 2048" in md


def test_command_line_writes_page_and_pngs(tmp_path, monkeypatch, capsys):
    make_run(tmp_path, "loop", "loop", 100.0)
    make_run(tmp_path, "cg", "custom_grouped", 45.0, losses=(10.0, 9.1, 8.4, 8.1), loss_check=checked(1e-2))
    out = tmp_path / "docs"
    # `python -m te_mixtral.results ...`, as -m runs it, in this process.
    monkeypatch.setattr(sys, "argv", ["te_mixtral.results", str(tmp_path / "loop"), str(tmp_path / "cg" / "results.json"),
                                      "--out", str(out)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("te_mixtral.results", run_name="__main__", alter_sys=True)
    stdout, stderr = capsys.readouterr()
    assert exited.value.code == 0, stderr
    stem = "2026-11-21-h200-x1"
    for name in (f"{stem}-step-time.png", f"{stem}-loss.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, name
        assert f"]({name})" in (out / f"{stem}.md").read_text()
    assert f"wrote {out / stem}.md" in stdout


def test_the_output_folder_is_named_and_a_page_there_is_kept(tmp_path, capsys, monkeypatch):
    make_run(tmp_path, "loop", "loop", 100.0)
    monkeypatch.chdir(tmp_path)  # where a default folder would land
    with pytest.raises(SystemExit):
        main([str(tmp_path / "loop"), "--no-plots"])
    assert "the following arguments are required: --out" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]  # nothing written
    out = tmp_path / "pages"
    assert main([str(tmp_path / "loop"), "--out", str(out), "--no-plots"]) == 0
    page = out / "2026-11-21-h200-x1.md"
    page.write_text("edited by hand")
    capsys.readouterr()
    assert main([str(tmp_path / "loop"), "--out", str(out), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"{page} exists: pass --overwrite to replace, or another --out" in err and err.count("\n") == 1
    assert page.read_text() == "edited by hand"
    assert main([str(tmp_path / "loop"), "--out", str(out), "--no-plots", "--overwrite"]) == 0
    assert page.read_text().startswith("# te_mixtral expert tiers")
    assert "--overwrite" not in page.read_text()  # the page names how it is made, not how it was replaced


def test_write_page_is_repeatable(tmp_path):
    make_run(tmp_path, "loop", "loop", 100.0)
    first = write_page(page_for([tmp_path / "loop"]), tmp_path / "a")
    second = write_page(page_for([tmp_path / "loop"]), tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


@pytest.mark.parametrize("name, text, message", [
    ("nowhere", None, "does not exist"),
    ("", None, "holds no results.json"),
    ("bad.json", "{", "is not valid JSON"),
    ("old.json", '{"losses": [1.0]}', "has no 'header'"),
])
def test_unusable_inputs_are_one_line_errors(tmp_path, capsys, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text)
    assert main([str(tmp_path / name), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("te_mixtral: error: ") and message in err and err.count("\n") == 1


# --- the committed pages ---------------------------------------------------------------------


COMMITTED_PAGES = sorted(p for p in (REPO / "docs" / "results").glob("*.md") if "- **This page**: `" in p.read_text())


@pytest.mark.parametrize("committed", COMMITTED_PAGES, ids=lambda p: p.name)
def test_committed_pages_regenerate_unchanged(committed, monkeypatch):
    """Each page in docs/results, remade from its committed runs by the command it names,
    is the committed page byte for byte (the markdown; the PNGs are not compared)."""
    command = re.search(r"^- \*\*This page\*\*: `(.*)`$", committed.read_text(), re.MULTILINE).group(1)
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "te_mixtral.results.pages"]
    made = []
    monkeypatch.setattr(pages, "write_page", lambda page, out_dir, plots: made.append((page, out_dir)) or [])
    monkeypatch.chdir(REPO)  # the command names its runs and notes from the repository root
    assert main([*words[3:], "--overwrite"]) == 0  # the page is there: it is what is compared
    [(page, out_dir)] = [(p, o) for p, o in made if p.stem == committed.stem]
    assert out_dir / f"{page.stem}.md" == committed.relative_to(REPO)
    assert page.markdown == committed.read_text()


def test_every_reproduce_command_on_a_committed_page_loads_today(monkeypatch):
    # Before, pages carried `--fp8.min_rows_per_expert 3072` for tiers loop and custom_grouped
    # (saved by runs whose configs held every key), which today's config refuses as changing nothing.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on the GPUs they ran on: bf16
    for page in COMMITTED_PAGES:
        for command in re.findall(r"^(?:python|torchrun) .*run_finetune_ep\.py .*$", page.read_text(), re.MULTILINE):
            words = shlex.split(command)
            args, overrides = parse_app_args(words[words.index("run_finetune_ep.py") + 1:])
            nproc = next((int(w.split("=")[1]) for w in words if w.startswith("--nproc_per_node=")), 1)
            try:
                load_config(str(REPO / args.config), overrides, world_size=nproc)
            except UserError as e:
                pytest.fail(f"{page.name}: {command}: {e}")


def test_runs_saved_before_num_experts_was_renamed_still_load():
    """Committed runs saved `model.num_local_experts` (HF's name); they read as `num_experts`."""
    runs = REPO / "docs" / "results" / "2026-11-21-kernel-notes" / "runs"  # the page that cites them
    run_dir = runs / "2026-11-21-h200-x4-ep4" / "custom_grouped"
    assert "num_local_experts" in (run_dir / "config.yaml").read_text()  # the old name, as saved
    assert load_config(str(run_dir / "config.yaml"), world_size=4).model.num_experts == 8
    (run,) = find_runs([str(run_dir)])
    assert run.header["config"]["model"]["num_local_experts"] == 8  # a page shows the config as saved
    command = reproduce_command(run.header["config"], run.world_size)
    assert "experts" not in command  # 8 experts is the config file's own value: no override
    args, app_overrides = parse_app_args(shlex.split(command)[4:])
    saved = flatten(upgrade_saved(run.header["config"]))  # keys added since then take their defaults
    loaded = flatten(to_dict(load_config(str(REPO / args.config), app_overrides, world_size=4)))
    assert {k: v for k, v in loaded.items() if k in saved} == saved


def test_router_balance_gets_a_line_and_a_heatmap(tmp_path):
    plain = make_run(tmp_path, "loop", "loop", 100.0)
    balanced = make_run(tmp_path, "aux", "custom_grouped", 50.0)
    results = json.loads((balanced / "results.json").read_text())
    router = {"aux_losses": [2.5, 2.25, 2.0, 2.0], "z_losses": [1.0, 1.0, 1.0, 1.0],
              "expert_load": {"max_over_mean": [1.5, 1.4, 1.3, 1.2],
                              "busiest_rank_over_mean": {"2": [1.2, 1.1, 1.1, 1.0]},
                              "tokens_per_expert": [[30, 10, 20, 20], [20, 20, 20, 20]],
                              "tokens_per_expert_steps": [1, 4]}}
    (balanced / "results.json").write_text(json.dumps({**results, **router}))
    page = page_for([plain, balanced])
    # An EP=1 run: EP=2 is what it would have met, not what it ran (before, "busiest rank/mean EP=2 1.100").
    line = ("- router: aux loss 2.188, z-loss 1.000, expert max/mean 1.350, busiest rank/mean, were it split: "
            "EP=2 1.100 (means over the run's steps)")
    assert page.markdown.count("- router:") == 1 and line in page.markdown
    split = make_run(tmp_path, "ep2", "custom_grouped", 50.0, world=2, ep=2)
    (split / "results.json").write_text(json.dumps({**json.loads((split / "results.json").read_text()), **router}))
    assert "busiest rank/mean: this run's EP=2 1.100 (means" in page_for([split]).markdown
    heatmap = f"{page.stem}-expert-load-{pages.slug('custom_grouped')}.png"
    assert f"]({heatmap})" in page.markdown
    written = write_page(page, tmp_path / "out")
    assert tmp_path / "out" / heatmap in written
    assert (tmp_path / "out" / heatmap).read_bytes().startswith(PNG_SIGNATURE)
