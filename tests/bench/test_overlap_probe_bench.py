"""benchmarks/overlap_probe.py's CPU parts: its arithmetic, and its one-line refusal without a GPU."""

import pytest
from refusals import refusals

from benchmarks.overlap_probe import hidden_share


def test_hidden_share_counts_the_shorter_job():
    assert hidden_share(comm_ms=2.0, work_ms=10.0, both_ms=10.0) == 1.0  # the comm ran entirely under the work
    assert hidden_share(comm_ms=2.0, work_ms=10.0, both_ms=12.0) == 0.0  # one after the other
    assert hidden_share(comm_ms=4.0, work_ms=3.0, both_ms=5.5) == pytest.approx(0.5)  # the work is the shorter


def test_refuses_without_a_gpu_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the probe would run")
    (answer,), _ = refusals("overlap_probe", [[]], heavy=())
    assert answer == (2, "overlap_probe: error: needs a CUDA GPU, and none is visible\n")
