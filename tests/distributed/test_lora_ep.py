"""LoRA under expert parallelism: EP=2 and EP=2 x DP=2 over gloo ranks train the adapters
exactly like one process on the same global batch (the expert adapters split with their
experts, the dense ones summed over every rank)."""

import pytest
import torch
from launch import EP_ARGS, train_ep, train_ep_many

from te_mixtral.distributed.layout import is_expert_param
from te_mixtral.model.lora import is_adapter_param

LORA = ("--lora.rank", "4", "--lora.alpha", "8")
PLANNED_RUNS = {1: [[*EP_ARGS, "--ep-size", "1", *LORA]], 2: [[*EP_ARGS, "--ep-size", "2", *LORA]],
                4: [pytest.param([*EP_ARGS, "--ep-size", "2", *LORA], marks=pytest.mark.slow)]}


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["ep2", "ep2xdp2"])
def test_lora_under_ep_equals_one_process(tmp_path, launch_planned, nproc):
    launch_planned(1)
    launch_planned(nproc)
    one_losses, (one,) = train_ep(tmp_path, "ep1", 1, 1, *LORA)
    losses, ranks = train_ep_many(tmp_path, nproc, {"ep2": (2, *LORA)})["ep2"]

    for a, b in zip(losses, one_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, one_losses)
    adapters = [name for name in one if is_adapter_param(name)]
    # Every B starts at zero: one that moved trained, so equal adapters say something.
    assert all(one[name].abs().max() > 0 for name in adapters if name.endswith(".B"))
    assert any(is_expert_param(name) for name in adapters) and not all(is_expert_param(name) for name in adapters)
    for rank, weights in enumerate(ranks):
        assert weights.keys() == one.keys()
        for name, full in one.items():
            want = full.chunk(2)[rank % 2] if is_expert_param(name) else full
            torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
