"""LoRA's expert adapters on a CUDA GPU, in bf16: the custom_grouped Triton op and the
grouped_linear tier (TE) against float64 with the base frozen, and a zero B leaving the op's
output bit for bit; device_mxfp8's frozen FP8 base (Hopper) within the FP8 recipe's tolerance. Tolerance as in test_custom_grouped_gpu.py: bf16 operands with fp32
accumulation land between 1e-3 and 1e-2; a dropped adapter, a wrong scale or a wrong
expert lands far above."""

import pytest
import torch
from expert_reference import GPU_SPLITS, random_adapters, reference_lora_f64, rel_err
from experts.test_adapters import run_with_adapters
from quant_reference import FP8_ROWWISE_MLP_RTOL

from te_mixtral.experts.adapters import ExpertAdapters
from te_mixtral.experts.custom_grouped import kernels_swiglu
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.experts.registry import make_tier

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16_REL_TOL = 1e-2
D, F_, RANK = 256, 384, 16


def inputs(splits, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, R = len(splits), sum(splits)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)
    return (randn(R, D), torch.tensor(splits, dtype=torch.int64, device="cuda"),
            randn(E, 2 * F_, D, scale=D**-0.5), randn(E, D, F_, scale=F_**-0.5), randn(R, D))


def tier_call(name):
    if name == "custom_grouped":
        return kernels_swiglu
    tier = make_tier(name)
    tier.check_available(torch.device("cuda"))
    return tier


@pytest.mark.parametrize("tier", ["custom_grouped", "grouped_linear"])
@pytest.mark.parametrize("case", ["uneven", "zero_middle", "one_expert"])
def test_adapters_match_float64(tier, case):
    splits = GPU_SPLITS[case]
    x, counts, gate_up, down, dy = inputs(splits, seed=len(case))
    pairs = random_adapters(splits, D, F_, RANK, seed=3, device="cuda", dtype=torch.bfloat16)
    got = run_with_adapters(tier_call(tier), x, counts, gate_up, down, pairs, 2.0, dy)
    assert_within_bf16(got, reference_lora_f64(x, splits, gate_up, down, pairs, 2.0, dy), f"{tier} {case}")


def assert_within_bf16(got, want, what):
    """y and the gradients of x and every A and B (run_with_adapters') against float64."""
    names = ("y", "dx", "dA_gate_up", "dB_gate_up", "dA_down", "dB_down")
    for name, out, ref in zip(names, got, want):
        assert torch.isfinite(out).all(), f"{what} {name}"
        assert rel_err(out, ref) <= BF16_REL_TOL, f"{what} {name}: {rel_err(out, ref):.2e}"


def test_zero_b_leaves_the_op_bit_for_bit():
    x, counts, gate_up, down, _ = inputs(GPU_SPLITS["uneven"], seed=5)
    pairs = random_adapters(GPU_SPLITS["uneven"], D, F_, RANK, seed=4, device="cuda", dtype=torch.bfloat16)
    zero_b = ExpertAdapters(*((a, torch.zeros_like(b)) for a, b in pairs.values()), 2.0, 0.0)
    with torch.no_grad():
        assert torch.equal(kernels_swiglu(x, counts, gate_up, down, zero_b), kernels_swiglu(x, counts, gate_up, down))


def test_frozen_base_runs_no_weight_gradient():
    """With the base frozen the op's backward returns no weight gradient (its two
    weight-gradient GEMMs do not run), and every other gradient is finite."""
    x, counts, gate_up, down, dy = inputs([1024] * 4, seed=6)
    pairs = random_adapters([1024] * 4, D, F_, RANK, seed=7, device="cuda", dtype=torch.bfloat16)
    got = run_with_adapters(kernels_swiglu, x, counts, gate_up, down, pairs, 2.0, dy)
    assert all(torch.isfinite(g).all() for g in got)
    assert gate_up.grad is None and down.grad is None


def is_hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not torch.cuda.is_available() or not is_hopper(), reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("case", ["uneven", "zero_middle", "one_expert"])
def test_frozen_fp8_base_matches_float64_within_the_fp8_tolerance(case):
    """device_mxfp8 over a base held in FP8 alone (quantised from the bf16 weights as a
    checkpoint loads): y and the gradients of x and of every adapter against float64 on the
    bf16 weights, within the FP8 rowwise recipe's tolerance, every call in FP8; no gradient
    anywhere near the base."""
    splits = GPU_SPLITS[case]
    x, counts, gate_up, down, dy = inputs(splits, seed=len(case) + 10)
    tier = DeviceMXFP8Tier("fp8-hopper", min_rows_per_expert=10**9)  # a frozen base ignores min_rows_per_expert
    tier.check_available(torch.device("cuda"))
    with torch.device("cuda"):  # where a run builds its model
        frozen = [tier.expert_weight(w.shape, frozen=True) for w in (gate_up, down)]
    for storage, w in zip(frozen, (gate_up, down)):
        storage[:].copy_(w)
    pairs = random_adapters(splits, D, F_, RANK, seed=3, device="cuda", dtype=torch.bfloat16)
    got = run_with_adapters(tier, x, counts, *frozen, pairs, 2.0, dy)
    want = reference_lora_f64(x, splits, gate_up, down, pairs, 2.0, dy)
    names = ("y", "dx", "dA_gate_up", "dB_gate_up", "dA_down", "dB_down")
    for name, out, ref in zip(names, got, want):
        assert torch.isfinite(out).all(), f"{case} {name}"
        assert rel_err(out, ref) <= FP8_ROWWISE_MLP_RTOL, f"{case} {name}: {rel_err(out, ref):.2e}"
    assert tier.calls() == {"fp8-hopper, frozen FP8 base": 1}
    assert "frozen base" in tier.describe()["kernel"]
