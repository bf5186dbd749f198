"""Resume under `train.sharding: fsdp` with bf16 parameters and master_adamw: a run stopped
after N of 2N steps and resumed from its sharded checkpoint trains exactly like the run that
was never stopped (2 gloo ranks at EP=1, so dense and expert state are both sharded; the
4-rank layouts are checked bit for bit in tests/distributed/test_sharded_master_adamw.py)."""

import json

from launch import STOPPED_AT, train_and_save
from test_resume import steps_logged

N = 2
ARGS = ["--ep-size", "1", "--steps", str(2 * N), "--timing_warmup_steps", "1", "--batch_size", "4",
        "--seq_len", "32", "--log_every", "1", "--checkpoint-every", str(N), "--sharding", "fsdp",
        "--dtype", "bf16", "--optimizer", "master_adamw"]
# The run never stopped and the resumed one (launch.STOPPED_AT) train with the other modules'
# two-rank runs (conftest.py's launch_planned).
STOPPED_AND_RESUMED = [STOPPED_AT, str(N), *ARGS]
PLANNED_RUNS = {2: [STOPPED_AND_RESUMED]}


def test_sharded_stop_and_resume_equals_one_run(tmp_path, launch_planned):
    launch_planned(2)
    train_and_save(tmp_path, STOPPED_AND_RESUMED, nproc=2)
    whole, resumed = tmp_path / "whole", tmp_path
    want = json.loads((whole / "results.json").read_text())
    got = json.loads((resumed / "results.json").read_text())
    assert got["losses"] == want["losses"]  # bit for bit: weights, remainders, moments, RNG, data
    assert got["grad_norms"] == want["grad_norms"]
    # Only the remaining steps ran: the resumed run's log starts after its checkpoint.
    assert steps_logged(resumed) == [N + 1, 2 * N]
