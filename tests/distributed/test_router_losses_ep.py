"""The router losses under expert parallelism equal one process's on the same global batch:
the counts are all-reduced, each rank's share of the probabilities carries the gradient."""

import pytest
import torch
from launch import EP_ARGS, train_and_save, train_and_save_many

from te_mixtral.distributed.layout import is_expert_param

# Six experts and six samples a step: EP=2 and EP=3 both divide them. Coefficients well above Mixtral's 0.02, so a
# wrong router gradient moves the weights by more than the tolerance.
ROUTER_ARGS = ["--num_experts", "6", "--batch_size", "6", "--router_aux_loss_coef", "0.5", "--router_z_loss_coef", "0.05"]


def run_args(ep: int, *extra: str) -> list[str]:
    return [*EP_ARGS, "--ep-size", str(ep), *extra]


# Launched with the other modules' runs of the same rank count (conftest.py's launch_planned); the
# three-rank one for the slow test only.
PLANNED_RUNS = {1: [run_args(1, *ROUTER_ARGS), run_args(1, *ROUTER_ARGS[:4])], 2: [run_args(2, *ROUTER_ARGS)],
                3: [pytest.param(run_args(3, *ROUTER_ARGS), marks=pytest.mark.slow)]}


def run(tmp_path, name, nproc, *extra):
    results, weights, _ = train_and_save(tmp_path / name, run_args(nproc, *extra), nproc)
    return results, weights


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, launch_planned):
    """The single-process runs, with the router losses and without them, in one launch."""
    folder = tmp_path_factory.mktemp("one_process")
    launch_planned(1)
    (want, (full,), _), (_, (plain,), _) = train_and_save_many(
        [(folder / name, args) for name, args in zip(("ep1", "plain"), PLANNED_RUNS[1])], 1)
    return want, full, plain


@pytest.mark.parametrize("ep", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ep_router_losses_equal_one_process(tmp_path, one_process, launch_planned, ep):
    want, full, plain = one_process
    launch_planned(ep)
    got, shards = run(tmp_path, f"ep{ep}", ep, *ROUTER_ARGS)
    for key in ("losses", "aux_losses", "z_losses"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    # The same routing, counted over every rank's tokens, on the first step at least (later
    # steps may flip a near-tie as rounding differs).
    assert got["expert_load"]["max_over_mean"][0] == want["expert_load"]["max_over_mean"][0]
    got_ranks, want_ranks = (run["expert_load"]["busiest_rank_over_mean"] for run in (got, want))
    assert got_ranks.keys() == want_ranks.keys()
    for ep_size in want_ranks:  # approx takes no nested dicts (pytest >= 9.2)
        assert got_ranks[ep_size] == pytest.approx(want_ranks[ep_size], rel=1e-5), ep_size
    for rank, shard in enumerate(shards):
        for name, weight in full.items():
            expected = weight.chunk(ep)[rank] if is_expert_param(name) else weight
            torch.testing.assert_close(shard[name], expected, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")

    # And the losses trained the routers: without them the routers end elsewhere.
    moved = [(full[n] - plain[n]).abs().max().item() for n in full if n.endswith("mlp.gate.weight")]
    assert min(moved) > 1e-3, moved
