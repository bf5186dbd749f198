"""`GradientReducer` (te_mixtral/distributed/overlap.py): the bucketed all-reduce starts inside
the backward of a step's last micro-batch, not before, and sums exactly what the
per-parameter all-reduce after backward sums (2 ranks, tests/workers/overlapped_reduction.py):
gloo on the CPU, and NCCL on two GPUs, where the buckets launch from the backward's stream."""

import pytest
import torch
from launch import RUN_DIR, WORKER, run_worker

WORLD = 2
SCRIPT = "tests/workers/overlapped_reduction.py"
PLANNED_RUNS = {WORLD: [[WORKER, SCRIPT, RUN_DIR, "cpu"]]}  # run in the session's two-rank launch
DEVICES = ["cpu",
           pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.multigpu])]


def same(got: torch.Tensor, want: torch.Tensor, device: str) -> bool:
    # Two ranks: each sum is a + b in one order or the other. On the CPU the two models' local
    # gradients are the same bits too; on CUDA the backward's atomic accumulations (embedding,
    # expert scatter) may round them apart, but never by a factor or a missing rank's share.
    if device == "cpu":
        return torch.equal(got, want)
    return bool((got - want).norm() <= 1e-6 * want.norm())


@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_reduction_equals_all_reduce_after_backward(tmp_path, device, launch_planned):
    if device == "cpu":
        launch_planned(WORLD)
    proc = run_worker(tmp_path, SCRIPT, [RUN_DIR, device], nproc=WORLD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    for record in records:
        # Several buckets over the world (dense) and over the expert replicas (EP=1: the world).
        assert record["buckets"]["dense"] > 2 and record["buckets"]["experts"] > 2, record["buckets"]
        first, last, second_step = record["launched"]
        assert not any(first)  # accumulating: nothing travels
        assert all(last) and all(second_step)  # every sum started before backward returned
        for step, (want, got) in enumerate(zip(record["reference"], record["overlapped"])):
            assert want.keys() == got.keys()
            for name in want:
                assert same(got[name], want[name], device), f"step {step}: {name}"
    # Summed, not left local: every rank holds the same gradients, which its own data alone
    # would not give (the ranks read different tokens).
    for name, grad in records[0]["overlapped"][0].items():
        assert torch.equal(grad, records[1]["overlapped"][0][name]), name
