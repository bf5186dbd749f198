"""The catalogs that scripts/gpu_runs.py launches (scripts/gpu_catalogs/), checked on a CPU:
every training run they launch is a config that loads at its world size (as on the GPU
machine, where precision auto is bf16), every module and test they name exists. A key renamed
or a check added shows here, not an hour into a GPU session."""

import importlib.util
import shlex

import pytest
import torch
from conftest import REPO

from te_mixtral.cli import parse_args
from te_mixtral.config import load_run_config

spec = importlib.util.spec_from_file_location("gpu_runs", REPO / "scripts" / "gpu_runs.py")
gpu_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_runs)


def every_launch():
    catalogs = {"check": gpu_runs.check_runs(8, "tests bench tiers"),
                "multi": gpu_runs.multi_runs(8, ["grouped_linear", "custom_grouped", "device_mxfp8"]),
                **{name: runs for name, runs in gpu_runs.CATALOGS.items()}}
    for catalog, runs in catalogs.items():
        for heading, launches in runs.items():
            for run in launches:
                if isinstance(run, gpu_runs.Launch) and run.program == ("python3",):
                    yield pytest.param(run, id=f"{catalog}:{run.name}")


@pytest.mark.parametrize("run", list(every_launch()))
def test_every_launch_names_what_exists_and_loads_its_config(run, monkeypatch):
    args = list(run.args)
    if args[0] == "run_finetune_ep.py":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        parsed, overrides = parse_args(args[1:])
        load_run_config(str(REPO / parsed.config), overrides, world_size=run.nproc)
    elif args[:2] == ["-m", "pytest"]:
        for test in (a for a in args[2:] if a.startswith("tests/")):
            assert (REPO / test.split("::")[0]).is_file(), test
    elif args[0] == "-m":
        assert importlib.util.find_spec(args[1]) is not None, args[1]
    else:
        assert args[0] == "-c"
        compile(args[1], run.name, "exec")


def test_the_catalogs_are_listed_and_a_wrong_name_is_refused(capsys):
    assert gpu_runs.main(["list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("depth ") for line in listed) >= len(gpu_runs.DEPTH_RUNS)
    assert any(shlex.split(line.split(": ", 1)[1])[:3] == ["torchrun", "--standalone", "--nproc_per_node=4"]
               for line in listed)
    with pytest.raises(SystemExit, match="unknown or no run: nope; depth's runs: cg-none"):
        gpu_runs.sections(["depth", "out", "nope"])


def test_lanes_run_side_by_side_and_report_each(tmp_path, capsys):
    """Each lane is this script again, into its own folder and log; a failing lane fails the
    call, and every lane's end is shown."""
    code = gpu_runs.main(["lanes", str(tmp_path), "0 lora nope", "1,2 depth nor-this"])
    shown = capsys.readouterr().out
    assert code == 1
    assert "##### lane1: 1" in shown and "##### lane2: 1" in shown
    assert "unknown or no run: nope; lora's runs" in (tmp_path / "lane1.log").read_text()
    assert "unknown or no run: nor-this; depth's runs" in (tmp_path / "lane2.log").read_text()
