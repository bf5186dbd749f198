"""`python run_finetune_ep.py` alone: the tiny default model on the embedded data (its command
line run in this process: the entry script's own process is started by other tests)."""

import json

import yaml
from launch import run_cli


def test_default_run_trains_and_reports(tmp_path):
    proc = run_cli(["--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    for metric in ("median step", "p90 step", "tokens/s/process", "TFLOP/s/process", "MFU", "peak memory"):
        assert metric in proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert len(results["losses"]) == saved["train"]["steps"] == 40
    assert results["summary"]["timed_steps"] == 40 - saved["train"]["timing_warmup_steps"]
    # 40 steps on real text: the loss must come down from its uniform-guess start (ln 2048 = 7.6).
    assert results["losses"][-1] < results["losses"][0] - 0.5
