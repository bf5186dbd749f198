"""The per-phase profile runs on the real model and reports every phase."""

import json

import pytest
from launch import run_cli, train_and_save

PHASES = {"attention", "router", "dispatch", "experts", "combine", "head", "clip", "optimizer"}
SHORT = ["--batch_size", "4", "--steps", "2", "--timing_warmup_steps", "1", "--seq_len", "64",
         "--profile_phases", "true"]
EP2 = [*SHORT, "--ep-size", "2"]
FSDP = [*SHORT, "--ep-size", "1", "--sharding", "fsdp"]
# Launched with the other modules' two-rank runs (conftest.py's launch_planned); FSDP's for the slow test.
PLANNED_RUNS = {2: [EP2, pytest.param(FSDP, marks=pytest.mark.slow)]}


@pytest.mark.parametrize("accum", [1, 2])
def test_phase_profile_is_reported(tmp_path, accum):
    proc = run_cli(["--steps", "4", "--timing_warmup_steps", "1", "--seq_len", "64", "--profile_phases", "true",
                    "--grad_accum_steps", str(accum), "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    phases = json.loads((tmp_path / "results.json").read_text())["phases_ms"]
    assert set(phases) == PHASES and all(ms > 0 for ms in phases.values())
    assert "sum of phases" in proc.stdout


def test_expert_rows_per_rank_cover_every_token_copy(tmp_path, launch_planned):
    launch_planned(2)
    results, _, _ = train_and_save(tmp_path, EP2, nproc=2)
    assert set(results["phases_ms"]) == PHASES | {"all-reduce"}
    rows = results["expert_rows_per_rank"]
    # Every token's top-2 copies land on exactly one rank, in each of the tiny model's 2 layers.
    assert len(rows) == 2 and sum(rows) == 4 * 64 * 2 * 2


@pytest.mark.slow
def test_phase_profile_under_fsdp(tmp_path, launch_planned):
    """Compute phases run on gathered weights; the gather is a phase of its own, no all-reduce."""
    launch_planned(2)
    phases = train_and_save(tmp_path, FSDP, nproc=2)[0]["phases_ms"]
    assert set(phases) == PHASES | {"all-gather"} and all(ms > 0 for ms in phases.values())
