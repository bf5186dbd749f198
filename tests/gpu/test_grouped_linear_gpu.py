"""`grouped_linear` computes the same expert FFN as the `loop` tier, forward and all three
gradients, in bf16 on a CUDA GPU with Transformer Engine.

Both tiers are measured against a float64 reference computed from the same bf16 values
(`tests/expert_reference.py`, independent of either tier), by relative Frobenius error
||out - ref|| / ||ref||. Two bars, both named:

- BF16_REL_TOL: bf16 operands with fp32 accumulation land between 1e-3 and 1e-2; a wrong
  index or an expert's rows left unwritten land far above.
- LOOP_ERROR_FACTOR: no worse than twice the error of the `loop` tier on the same inputs
  (with a floor, LOOP_ERROR_FLOOR, for when the loop happens to be very close).

Memory freed just before each tier call is filled with NaN first, so an output element TE
fails to write reads as NaN, and NaN never passes.
"""

import pytest
import torch
from expert_reference import (
    GPU_SPLITS,
    random_expert_inputs,
    reference_f64,
    rel_err,
    run_tier,
)

from te_mixtral.experts.grouped_linear import MIN_TE_VERSION, GroupedLinearTier
from te_mixtral.experts.loop import LoopTier
from te_mixtral.te_support import te_available

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and te_available(MIN_TE_VERSION)),
        reason=f"needs a CUDA GPU and Transformer Engine >= {MIN_TE_VERSION}",
    ),
]

BF16_REL_TOL = 1e-2
LOOP_ERROR_FACTOR = 2.0
LOOP_ERROR_FLOOR = 1e-3

D, F, E = 256, 384, 4  # small, but every GEMM dimension a multiple of 16 like real models
NAMES = ("y", "dx", "d_gate_up", "d_down")

SPLITS = GPU_SPLITS


def test_available_here():
    GroupedLinearTier().check_available(torch.device("cuda"))


@pytest.mark.parametrize("case", SPLITS)
def test_matches_loop_in_bf16(case):
    splits = SPLITS[case]
    inputs = random_expert_inputs(splits, D, F, seed=list(SPLITS).index(case))
    x, _, gate_up, down, dy = inputs
    ref = reference_f64(x, splits, gate_up, down, dy)
    loop = run_tier(LoopTier(), *inputs)
    grouped = run_tier(GroupedLinearTier(), *inputs)

    assert grouped[0].dtype == torch.bfloat16 and grouped[0].shape == (sum(splits), D)
    for name, out, loop_out, r in zip(NAMES, grouped, loop, ref):
        err, loop_err = rel_err(out, r), rel_err(loop_out, r)
        assert err <= BF16_REL_TOL, f"{case} {name}: error {err:.2e}"
        assert err <= max(LOOP_ERROR_FACTOR * loop_err, LOOP_ERROR_FLOOR), (
            f"{case} {name}: error {err:.2e}, loop tier's {loop_err:.2e}"
        )

    # Per expert, so that one small expert's rows cannot hide inside the total.
    y, _, d_gate_up, d_down = grouped
    for e, (y_ND, ref_ND) in enumerate(zip(y.split(splits), ref[0].split(splits))):
        if splits[e] == 0:
            # TE writes zeros for an expert with no rows; nothing may be left unwritten.
            assert torch.equal(d_gate_up[e], torch.zeros_like(d_gate_up[e])), f"expert {e}"
            assert torch.equal(d_down[e], torch.zeros_like(d_down[e])), f"expert {e}"
            continue
        assert rel_err(y_ND, ref_ND) <= BF16_REL_TOL, f"{case} y of expert {e}"
        assert rel_err(d_gate_up[e], ref[2][e]) <= BF16_REL_TOL, f"{case} d_gate_up[{e}]"
        assert rel_err(d_down[e], ref[3][e]) <= BF16_REL_TOL, f"{case} d_down[{e}]"


def test_same_inputs_same_bits():
    # A result that moves between identical runs means a race, not rounding.
    inputs = random_expert_inputs(SPLITS["uneven"], D, F, seed=7)
    first, second = run_tier(GroupedLinearTier(), *inputs), run_tier(GroupedLinearTier(), *inputs)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def test_no_rows_at_all():
    inputs = random_expert_inputs([0] * E, D, F, seed=3)
    y, dx, d_gate_up, d_down = run_tier(GroupedLinearTier(), *inputs)
    assert y.shape == (0, D) and dx.shape == (0, D)
    assert torch.equal(d_gate_up, torch.zeros_like(d_gate_up))
    assert torch.equal(d_down, torch.zeros_like(d_down))


def test_fp32_master_weights_under_autocast():
    # The training setup: fp32 parameters, forward under bf16 autocast. Weight gradients
    # must come back in fp32 (autograd undoes the tier's casts), as accurate as the loop's.
    splits = SPLITS["zero_middle"]
    inputs = random_expert_inputs(splits, D, F, seed=11, param_dtype=torch.float32)
    x, _, gate_up, down, dy = inputs
    ref = reference_f64(x, splits, gate_up, down, dy)
    loop = run_tier(LoopTier(), *inputs, autocast=True)
    grouped = run_tier(GroupedLinearTier(), *inputs, autocast=True)

    assert grouped[0].dtype == torch.bfloat16
    assert grouped[2].dtype == torch.float32 and grouped[3].dtype == torch.float32
    for name, out, loop_out, r in zip(NAMES, grouped, loop, ref):
        err, loop_err = rel_err(out, r), rel_err(loop_out, r)
        assert err <= BF16_REL_TOL, f"{name}: error {err:.2e}"
        assert err <= max(LOOP_ERROR_FACTOR * loop_err, LOOP_ERROR_FLOOR), (
            f"{name}: error {err:.2e}, loop tier's {loop_err:.2e}"
        )
