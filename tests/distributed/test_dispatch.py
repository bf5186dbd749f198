"""Token dispatch over two gloo ranks: empty experts and a rank that receives nothing."""

import pytest
from launch import WORKER, run_worker

SCRIPT = "tests/workers/dispatch_edge_cases.py"
PLANNED_RUNS = {2: [[WORKER, SCRIPT]]}  # run in the session's two-rank launch (conftest.py's launch_planned)


@pytest.mark.slow
def test_dispatch_edge_cases(tmp_path, launch_planned):
    launch_planned(2)
    proc = run_worker(tmp_path, SCRIPT, [], nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok:") == 3
