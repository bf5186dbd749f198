"""benchmarks/overlap_probe.py's arithmetic (its one-line refusal without a GPU: test_common.py)."""

import pytest

from benchmarks.overlap_probe import hidden_share


def test_hidden_share_counts_the_shorter_job():
    assert hidden_share(comm_ms=2.0, work_ms=10.0, both_ms=10.0) == 1.0  # the comm ran entirely under the work
    assert hidden_share(comm_ms=2.0, work_ms=10.0, both_ms=12.0) == 0.0  # one after the other
    assert hidden_share(comm_ms=4.0, work_ms=3.0, both_ms=5.5) == pytest.approx(0.5)  # the work is the shorter

