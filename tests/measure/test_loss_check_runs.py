"""The loss check on real runs: `hf` agrees with `loop`; a deliberately wrong tier is caught."""

import json

import pytest
from conftest import REPO
from launch import run_cli

import te_mixtral.training.loop
from te_mixtral.config import load_config
from te_mixtral.experts.loop import LoopTier

ARGS = ["--steps", "8", "--timing_warmup_steps", "2", "--seq_len", "64"]


@pytest.fixture(scope="module")
def loop_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("loop")
    proc = run_cli([*ARGS, "--tier", "loop", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / "results.json"


def test_hf_passes_against_loop(loop_results, tmp_path):
    proc = run_cli([*ARGS, "--tier", "hf", "--output-dir", str(tmp_path), "--loss-check", str(loop_results)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "loss check passed" in proc.stdout


class SwappedExperts(LoopTier):
    """Runs every expert's rows through the next expert's weights."""

    def __call__(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
        return super().__call__(x_RD, tokens_per_expert_L, gate_up_L2FD.roll(1, 0), down_LDF.roll(1, 0), adapters)


def test_wrong_tier_fails_the_check(loop_results, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(te_mixtral.training.loop, "make_tier", lambda name, cfg=None: SwappedExperts())
    cfg = load_config(str(REPO / "configs/tiny.yaml"), {"steps": "8", "timing_warmup_steps": "2", "seq_len": "64",
                                            "output_dir": str(tmp_path), "loss_check": str(loop_results)})
    assert te_mixtral.training.loop.main(cfg) == 1
    assert "loss check FAILED" in capsys.readouterr().out


def test_mxfp8_numerics_within_their_tolerance(loop_results, tmp_path):
    """MXFP8-quantised expert GEMMs (emulated on the CPU) against the fp32 loop."""
    proc = run_cli([*ARGS, "--tier", "device_mxfp8", "--fp8.mode", "mxfp8-emulated", "--output-dir",
                    str(tmp_path), "--loss-check", str(loop_results)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "loss check passed" in proc.stdout and "mean" in proc.stdout and "(<= 5e-02)" in proc.stdout
    assert "'recipe': 'mxfp8-emulated'" in proc.stdout
    # ... and the quantisation really happened: the losses are not the fp32 ones.
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["loss_check"]["max_rel_diff"] > 1e-6
    # Every layer call ran the emulation: one per layer per step (8 steps, one micro-batch).
    layers = results["header"]["config"]["model"]["num_hidden_layers"]
    assert results["tier_calls"] == {"mxfp8-emulated": 8 * layers}
