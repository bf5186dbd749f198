"""benchmarks/optimizer_step.py runs end to end at its --quick size and writes its table (its
`main`, in this process)."""

import json

import pytest
import torch

from benchmarks.optimizer_step import main


@pytest.mark.slow  # a few seconds on a CPU: seven optimizers
def test_optimizer_step_benchmark_quick(tmp_path, capsys):
    out = tmp_path / "bench.json"
    with torch.random.fork_rng():  # it seeds torch's generator
        main(["--quick", "--json", str(out)])
    stdout = capsys.readouterr().out
    payload = json.loads(out.read_text())
    rows = {r["optimizer"]: r for r in payload["results"]}
    for name in ("torch fp32", "torch bf16 (no master)", "MasterAdamW bf16 m", "MasterAdamW fp32 m", "MasterAdamW 8-bit m"):
        assert rows[name]["ms"] > 0 and rows[name]["x_floor"] > 0, rows[name]
    assert rows["MasterAdamW bf16 m"]["moved_bytes"] == 18 and rows["MasterAdamW bf16 m"]["state_bytes"] == 10
    assert rows["MasterAdamW 8-bit m"]["moved_bytes"] == 14 and rows["MasterAdamW 8-bit m"]["state_bytes"] == 6
    assert payload["measured_copy_gbs"] > 0
    assert "MasterAdamW bf16 m" in stdout and payload["header"]["device"] in stdout
