"""The per-phase profile runs on the real model and reports every phase."""

import json

from launch import run_app

PHASES = {"attention", "router", "dispatch", "experts", "combine", "head", "optimizer"}


def test_phase_profile_is_reported(tmp_path):
    proc = run_app(["--steps", "4", "--timing_warmup_steps", "1", "--seq_len", "64", "--profile_phases", "true",
                    "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    phases = json.loads((tmp_path / "results.json").read_text())["phases_ms"]
    assert set(phases) == PHASES and all(ms > 0 for ms in phases.values())
    assert "sum of phases" in proc.stdout
