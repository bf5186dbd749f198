"""Resume under `train.sharding: fsdp` with bf16 parameters and master_adamw: a run stopped
after N of 2N steps and resumed from its sharded checkpoint trains exactly like the run that
was never stopped (2 gloo ranks at EP=1, so dense and expert state are both sharded; the
4-rank layouts are checked bit for bit in tests/distributed/test_sharded_master_adamw.py)."""

import json
import shutil

import pytest
from launch import RUN_DIR, run_app, train_and_save

N = 2
ARGS = ["--ep-size", "1", "--steps", str(2 * N), "--timing_warmup_steps", "1", "--batch_size", "4",
        "--seq_len", "32", "--log_every", "1", "--checkpoint-every", str(N), "--sharding", "fsdp",
        "--dtype", "bf16", "--optimizer", "master_adamw"]
WHOLE = [*ARGS, "--checkpoint-dir", f"{RUN_DIR}/ckpt"]
# The run never stopped trains with the other modules' two-rank runs (conftest.py's
# launch_planned); the resumed one is the app's own launch, as a user resumes.
PLANNED_RUNS = {2: [WHOLE]}


@pytest.mark.slow
def test_sharded_stop_and_resume_equals_one_run(tmp_path, launch_planned):
    whole = tmp_path / "whole"
    launch_planned(2)
    train_and_save(whole, WHOLE, nproc=2)

    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "ckpt", resumed / "ckpt")
    shutil.rmtree(resumed / "ckpt" / f"step-{2 * N:06d}")
    (resumed / "ckpt" / "latest").write_text(f"step-{N:06d}\n")
    proc = run_app([*ARGS, "--checkpoint-dir", str(resumed / "ckpt"), "--output-dir", str(resumed), "--resume"],
                   nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(step {N} of {2 * N})" in proc.stdout

    want = json.loads((whole / "results.json").read_text())
    got = json.loads((resumed / "results.json").read_text())
    assert got["losses"] == want["losses"]  # bit for bit: weights, remainders, moments, RNG, data
    assert got["grad_norms"] == want["grad_norms"]

