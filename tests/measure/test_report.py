"""results.json round trip and its failure modes, and the printed tables."""

import json
import math
from datetime import datetime

import pytest

from te_mixtral.config import RunConfig
from te_mixtral.errors import UserError
from te_mixtral.measure.report import (
    default_output_dir,
    format_table,
    read_results,
    run_header,
    timing_table,
    write_results,
)

SUMMARY = {
    "timed_steps": 10,
    "median_step_ms": 55.0,
    "p90_step_ms": 90.0,
    "tokens_per_s": 20000.0,
    "tokens_per_s_per_gpu": 10000.0,
    "tflops_per_gpu": 20.0,
    "mfu": None,
    "peak_memory_gib": 3.0,
}
LOSSES = [10.4, 9.8, 9.1, 8.7, 8.2, 7.9]


def header() -> dict:
    return run_header(RunConfig(device="cpu"), device_name="cpu", world_size=2)


# --- results.json --------------------------------------------------------------------------


def test_results_round_trip(tmp_path):
    path = write_results(tmp_path / "run", header(), SUMMARY, LOSSES, extra={"note": "x"})
    assert path == tmp_path / "run" / "results.json"
    results = read_results(path)
    assert results["losses"] == LOSSES
    assert results["summary"] == SUMMARY
    assert results["header"] == json.loads(json.dumps(header() | {"date": results["header"]["date"]}))
    assert results["header"]["config"]["tier"] == "loop"
    assert results["note"] == "x"


def test_nan_loss_survives_round_trip(tmp_path):
    path = write_results(tmp_path, {}, SUMMARY, [1.0, math.nan])
    assert math.isnan(read_results(path)["losses"][1])


def test_write_leaves_no_temporary_files(tmp_path):
    write_results(tmp_path, {}, SUMMARY, LOSSES)
    write_results(tmp_path, {}, SUMMARY, LOSSES[:2])  # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert read_results(tmp_path / "results.json")["losses"] == LOSSES[:2]


def test_failed_write_keeps_old_file_and_cleans_up(tmp_path):
    write_results(tmp_path, {}, SUMMARY, LOSSES)
    with pytest.raises(TypeError):  # not JSON-serialisable: fails midway through the dump
        write_results(tmp_path, {}, SUMMARY, LOSSES[:1], extra={"bad": object()})
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert read_results(tmp_path / "results.json")["losses"] == LOSSES


def test_extra_may_not_replace_core_keys(tmp_path):
    with pytest.raises(ValueError):
        write_results(tmp_path, {}, SUMMARY, LOSSES, extra={"losses": []})


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ('{"header": {}}', "has no 'losses'"),
        ("[1, 2]", "has no 'losses'"),
        ('{"losses": "1.0"}', "list of numbers"),
        ('{"losses": [1.0, "x"]}', "list of numbers"),
    ],
)
def test_read_results_errors(tmp_path, content, message):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=message) as err:
        read_results(path)
    assert "\n" not in str(err.value)


def test_default_output_dir_is_fresh(tmp_path):
    now = datetime(2025, 3, 4, 5, 6, 7)
    first = default_output_dir("loop", root=tmp_path, now=now)
    second = default_output_dir("loop", root=tmp_path, now=now)
    third = default_output_dir("loop", root=tmp_path, now=now)
    assert first == tmp_path / "20250304-050607-loop"
    assert second == tmp_path / "20250304-050607-loop-2"
    assert third == tmp_path / "20250304-050607-loop-3"
    assert first.is_dir() and second.is_dir() and third.is_dir()


# --- tables --------------------------------------------------------------------------------


def test_format_table_aligns_columns():
    text = format_table([("a", "1"), ("longer", "12345")], header=("name", "n"))
    lines = text.splitlines()
    assert lines[0].startswith("name  ")
    assert set(lines[1]) <= {"-", " "}
    assert len({len(line) for line in lines}) == 1  # right-aligned numbers end together
    assert lines[2].endswith("    1")


def test_timing_table_names_the_run_and_every_metric():
    text = timing_table(SUMMARY, header())
    for needle in ("tier", "loop", "world size", "EP size", "precision", "fp32", "55.0 ms", "90.0 ms",
                   "20,000", "10,000", "20.0", "MFU", "n/a", "3.00 GiB", "timed steps"):
        assert needle in text, needle
    assert "34.5 %" in timing_table(SUMMARY | {"mfu": 0.345}, header())
    assert text.isascii()


def test_timing_table_on_a_cpu_is_per_process_and_shows_its_small_flops():
    cpu = timing_table(SUMMARY | {"tflops_per_gpu": 0.000412}, header())
    assert "tokens/s/process" in cpu and "TFLOP/s/process" in cpu and "GPU" not in cpu
    assert "0.00041" in cpu and " 0.0\n" not in cpu  # not a meaningless 0.0
    gpu = timing_table(SUMMARY, {**header(), "device": "NVIDIA H100 80GB HBM3"})
    assert "tokens/s/GPU" in gpu and "TFLOP/s/GPU" in gpu and "process" not in gpu
