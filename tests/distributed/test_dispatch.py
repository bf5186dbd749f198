"""Token dispatch over two gloo ranks: empty experts and a rank that receives nothing."""

import pytest
from launch import run_app


@pytest.mark.slow
def test_dispatch_edge_cases():
    proc = run_app([], nproc=2, timeout=120, script="tests/workers/dispatch_edge_cases.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok:") == 3
