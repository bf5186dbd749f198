"""benchmarks/optimizer_step.py runs end to end at its --quick size and writes its table."""

import json
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow  # about 10 s on a CPU: Python start-up, imports and seven optimizers
def test_optimizer_step_benchmark_quick(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.optimizer_step", "--quick", "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads(out.read_text())
    rows = {r["optimizer"]: r for r in payload["results"]}
    for name in ("torch fp32", "torch bf16 (no master)", "MasterAdamW bf16 m", "MasterAdamW fp32 m", "MasterAdamW 8-bit m"):
        assert rows[name]["ms"] > 0 and rows[name]["x_floor"] > 0, rows[name]
    assert rows["MasterAdamW bf16 m"]["moved_bytes"] == 18 and rows["MasterAdamW bf16 m"]["state_bytes"] == 10
    assert rows["MasterAdamW 8-bit m"]["moved_bytes"] == 14 and rows["MasterAdamW 8-bit m"]["state_bytes"] == 6
    assert payload["measured_copy_gbs"] > 0
    assert "MasterAdamW bf16 m" in result.stdout and payload["header"]["device"] in result.stdout
