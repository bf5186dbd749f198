"""Expert parallelism over gloo ranks trains exactly like one process on the same global batch."""

import pytest
import torch
from launch import EP_ARGS, EP_STEPS, train_and_save, train_ep, train_ep_many

from te_mixtral.distributed.layout import is_expert_param

# Launched with the other modules' runs of the same rank count (conftest.py's launch_planned); the
# four-rank ones for the slow tests only.
PLANNED_RUNS = {1: [[*EP_ARGS, "--ep-size", "1"]], 2: [[*EP_ARGS, "--ep-size", "2"]],
                4: [pytest.param([*EP_ARGS, "--ep-size", str(ep)], marks=pytest.mark.slow) for ep in (2, 4)]}


def test_ep2_equals_ep1(tmp_path, launch_planned):
    launch_planned(1)
    launch_planned(2)
    ep1_losses, (ep1,) = train_ep(tmp_path, "ep1", nproc=1, ep=1)
    ep2_losses, (rank0, rank1) = train_ep(tmp_path, "ep2", nproc=2, ep=2)

    assert len(ep2_losses) == EP_STEPS
    for a, b in zip(ep2_losses, ep1_losses):
        assert abs(a - b) / abs(b) < 1e-5, (ep2_losses, ep1_losses)
    # The run must have learned something, or equal weights would prove nothing.
    assert ep1_losses[-1] < ep1_losses[0]

    for name, full in ep1.items():
        if is_expert_param(name):
            half = full.shape[0] // 2
            pieces = [(rank0[name], full[:half]), (rank1[name], full[half:])]
        else:
            pieces = [(rank0[name], full), (rank1[name], full)]
        for got, want in pieces:
            # atol: 1/300 of one Adam step at lr 3e-3. Rarely seen embedding rows have gradients
            # in Adam's eps regime, where the rounding of a two-rank sum moves the update a little
            # (measured 1.5e-6); a missing or mis-scaled gradient moves weights by whole steps.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_results_hold_each_ranks_peak_memory(tmp_path, launch_planned):
    launch_planned(2)
    results, _, _ = train_and_save(tmp_path / "ep2", [*EP_ARGS, "--ep-size", "2"], 2)
    by_rank = results["peak_memory_gib_by_rank"]
    assert len(by_rank) == 2 and all(peak > 0 for peak in by_rank)
    assert max(by_rank) == results["summary"]["peak_memory_gib"]  # the summary's is the fullest rank's
    assert results["allocator_retries_by_rank"] == [0, 0]  # a CPU run has no CUDA allocator to run short


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, launch_planned):
    """Both four-rank layouts, trained in one launch."""
    launch_planned(4)
    return train_ep_many(tmp_path_factory.mktemp("four_ranks"), 4, {"w4ep2": (2,), "w4ep4": (4,)})


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4], ids=["ep2xdp2", "ep4"])
def test_four_ranks_equal_one(tmp_path, four_ranks, launch_planned, ep):
    """World 4 in both layouts the 8-GPU runs use: EP=2 x DP=2 (replicas of the experts) and EP=4."""
    launch_planned(1)
    ep1_losses, (ep1,) = train_ep(tmp_path, "ep1", nproc=1, ep=1)
    losses, shards = four_ranks[f"w4ep{ep}"]
    for a, b in zip(losses, ep1_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ep1_losses)
    for rank, shard in enumerate(shards):
        ep_rank = rank % ep
        for name, full in ep1.items():
            want = full.chunk(ep)[ep_rank] if is_expert_param(name) else full
            torch.testing.assert_close(shard[name], want, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")
