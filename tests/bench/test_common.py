"""The benchmarks as one family: each imports on a machine without a GPU, runs as
`python3 -m benchmarks.NAME`, and one that needs CUDA says so in one line; the shared timer
leaves the warm-up out; `--json` writes the payload with its run header, and a path it cannot
write is refused as the command line is read."""

import argparse
import importlib
import importlib.metadata
import json
import pkgutil
import time

import pytest
import torch
from conftest import REPO

import benchmarks
from benchmarks import common

# What a header records: the installed distribution's version (its metadata), which on some images
# lacks the local "+cu130" that torch.__version__ carries.
TORCH_VERSION = importlib.metadata.version("torch")

MODULES = sorted(name for _, name, _ in pkgutil.iter_modules(benchmarks.__path__))
SHARED = {"common", "custom_grouped_ops", "gemm_floors", "lora_base_compare", "peers",
          "peer_workload"}  # imported by the scripts, not run
SCRIPTS = [name for name in MODULES if name not in SHARED]
# The scripts that need a GPU for anything at all, with the arguments that get them past parsing.
CUDA_ONLY = {"custom_grouped_bench": [], "custom_grouped_gemms": [], "custom_grouped_grid": [],
             "custom_grouped_host_time": [], "fp8_accuracy": [], "fp8_break_even": [], "fp8_casts": [],
             "fp8_gemms": [], "fp8_row_counts": [], "kernel_profile": ["ours"], "lora_fp8_base": [], "op_profile": [],
             "overlap_probe": []}


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_imports_without_a_gpu(name):
    importlib.import_module(f"benchmarks.{name}")


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_says_how_to_run_it_as_a_module(name):
    doc = importlib.import_module(f"benchmarks.{name}").__doc__
    assert f"python3 -m benchmarks.{name}" in doc
    assert f"`{name}.py`" in (REPO / "benchmarks" / "README.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("name", sorted(CUDA_ONLY))
def test_a_cuda_benchmark_without_a_gpu_says_so_in_one_line(name, capsys):
    assert importlib.import_module(f"benchmarks.{name}").main(CUDA_ONLY[name]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"{name}: error: needs a CUDA GPU, and none is visible\n"


def test_the_timer_leaves_the_warm_up_out():
    calls = []

    def step():
        calls.append(len(calls))
        time.sleep(0.002 if len(calls) > common.WARMUP_STEPS else 0.05)  # warm-up is slow, as a compile is

    ms = common.median_ms(step, torch.device("cpu"), min_reps=5, max_reps=5)
    assert len(calls) == common.WARMUP_STEPS + 1 + 5  # warm-up, one call to size the budget, the timed ones
    assert 2 <= ms < 50


def test_json_is_the_one_output_flag_and_carries_the_header(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    common.add_json_flag(parser)
    path = tmp_path / "new folder" / "out.json"
    args = parser.parse_args(["--json", str(path)])
    header = common.run_header(torch.device("cpu"), sizes={"hidden": 8})
    common.write_json(args.json, {"header": header, "rows": [1, 2]})
    written = json.loads(path.read_text())
    assert written["rows"] == [1, 2] and written["header"]["device"] == "cpu"
    assert written["header"]["sizes"] == {"hidden": 8} and written["header"]["versions"]["torch"] == TORCH_VERSION
    assert capsys.readouterr().out == f"wrote {path}\n"
    line = common.header_line(header)
    assert line.startswith(f"date {header['date']}  device cpu  torch {TORCH_VERSION}")
    common.write_json(parser.parse_args([]).json, {"header": header})  # no --json: nothing written
    assert list(tmp_path.rglob("*.json")) == [path]


# The scripts that write a JSON file once they have run (--json; te_example's --splits-json too),
# read from their source so that a new one is checked as well.
JSON_FLAGS = {name: flags for name in SCRIPTS for flags in [
    [flag for call, flag in (("add_json_flag(", "--json"), ("add_run_flags(", "--json"), ('"--splits-json"',
                                                                                        "--splits-json"))
     if call in (REPO / "benchmarks" / f"{name}.py").read_text()]] if flags}


@pytest.mark.parametrize("name, flag", [(name, flag) for name, flags in JSON_FLAGS.items() for flag in flags])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(name, flag, tmp_path, capsys):
    # Before, a script ran (or refused something else) and the file failed to be written after
    # the whole run, with a traceback.
    blocker = tmp_path / "a file"
    blocker.write_text("")
    for target, why in [(blocker / "out.json", f"{blocker} is a file, not a folder"),
                        (blocker / "sub" / "out.json", f"{blocker} is a file, not a folder"),
                        (tmp_path, "it is a folder: name the file to write")]:
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(f"benchmarks.{name}").main([flag, str(target)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1].endswith(f"error: argument {flag}: cannot write {target}: {why}"), err
        assert "Traceback" not in err


def test_a_split_keeps_every_row():
    assert common.split_by_fractions(8192, (0.70, 0.20, 0.09, 0.01)) == [5735, 1638, 737, 82]  # rounding to the largest share
    assert sum(common.split_by_fractions(100, (1 / 3, 1 / 3, 1 / 3, 0.0))) == 100
