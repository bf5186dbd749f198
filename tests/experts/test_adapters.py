"""LoRA's expert adapters in every tier that takes them, on the CPU: forward and the gradients
of x and of every A and B against a float64 loop over experts (expert_reference.py), with
the base weights frozen (they must get no gradient). The GPU paths are checked in tests/gpu;
the custom_grouped Triton op's, also in Triton's interpreter (test_custom_grouped.py)."""

import pytest
import torch
from conftest import REPO
from expert_reference import random_adapters, reference_lora_f64
from experts.test_custom_grouped import FP32_REL_TOL, SPLITS, make_inputs

from te_mixtral.config import load_run_config
from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.adapters import ExpertAdapters
from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.registry import EXPERT_TIERS, make_tier

TIERS_ON_CPU = ["loop", "custom_grouped"]


def run_with_adapters(tier_call, x, counts, gate_up, down, pairs, scale, dy):
    """y and the gradients of x and of every adapter tensor, the base weights frozen."""
    x = x.detach().clone().requires_grad_()
    leaves = {name: tuple(t.detach().clone().requires_grad_() for t in pair) for name, pair in pairs.items()}
    adapters = ExpertAdapters(leaves.get("gate_up"), leaves.get("down"), scale, 0.0)
    y = tier_call(x, counts, gate_up, down, adapters)
    flat = [t for pair in leaves.values() for t in pair]
    return (y, *torch.autograd.grad(y, [x, *flat], dy))


def assert_close(got, want, what):
    for i, (out, ref) in enumerate(zip(got, want)):
        assert out.shape == ref.shape, f"{what} output {i}: shape {tuple(out.shape)}"
        err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()
        assert err <= FP32_REL_TOL, f"{what} output {i}: error {err:.2e}"


@pytest.mark.parametrize("tier", TIERS_ON_CPU)
@pytest.mark.parametrize("targets", [("gate_up", "down"), ("gate_up",), ("down",)], ids=["both", "gate_up", "down"])
@pytest.mark.parametrize("case", ["uneven", "zero_middle"])
def test_tier_with_adapters_matches_float64(tier, targets, case):
    splits = SPLITS[case]
    x, counts, gate_up, down, dy = make_inputs(splits, 20, 12, seed=len(case) + len(targets))
    pairs = random_adapters(splits, 20, 12, rank=3, seed=5, targets=targets)
    got = run_with_adapters(make_tier(tier), x, counts, gate_up, down, pairs, 1.7, dy)
    assert_close(got, reference_lora_f64(x, splits, gate_up, down, pairs, 1.7, dy), f"{tier} {targets} {case}")


def test_the_tiers_that_take_adapters_say_so():
    """The registry refuses lora for the others (test_config_validation); these run them
    (device_mxfp8 over its frozen FP8 base: tests/experts/quant/test_frozen_fp8.py)."""
    assert {name for name, tier in EXPERT_TIERS.items() if tier.takes_adapters} == \
        {"loop", "grouped_linear", "custom_grouped", "device_mxfp8"}


def test_custom_grouped_refuses_dropout_it_cannot_apply():
    """On a GPU the down adapter reads SwiGLU's output inside the Triton op, where no dropout
    mask can reach: a run that asks for one is refused in one line when its config loads, not
    trained without it; and a call with such adapters is refused, whatever built the tier."""
    lora = {"tier": "custom_grouped", "lora.rank": "4", "lora.dropout": "0.1"}
    with pytest.raises(TierUnavailable, match="no dropout to the down adapter's input"):
        load_run_config(str(REPO / "configs" / "tiny.yaml"), {**lora, "device": "cuda"}, 1)
    load_run_config(str(REPO / "configs" / "tiny.yaml"), {**lora, "device": "cpu"}, 1)  # grouped_mm applies it
    # no down adapter: nothing to refuse
    load_run_config(str(REPO / "configs" / "tiny.yaml"), {**lora, "device": "cuda", "lora.targets": "q_proj,gate_up_proj"},
                    1)
    x_RD = torch.randn(5, 8)
    down_adapter = (torch.zeros(2, 4, 16), torch.zeros(2, 8, 4))
    with pytest.raises(TierUnavailable, match="no dropout to the down adapter's input"):
        CustomGroupedTier._kernels(x_RD, torch.tensor([3, 2]), torch.randn(2, 32, 8), torch.randn(2, 8, 16), True,
                                   ExpertAdapters(None, down_adapter, 1.0, 0.1))
