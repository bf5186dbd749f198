"""`grouped_linear` computes the same expert FFN as the `loop` tier, forward and all three
gradients, in bf16 on a CUDA GPU with Transformer Engine.

Both tiers are measured against a float64 reference computed from the same bf16 values
(written out below, independent of either tier), by relative Frobenius error
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

from expert_reference import GPU_SPLITS, reference_f64
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


def make_inputs(splits, seed, param_dtype=torch.bfloat16):
    """Fresh random (never zero) inputs: x, tokens_per_expert, gate_up, down, dy."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(dtype)

    rows = sum(splits)
    return (
        randn(rows, D),
        torch.tensor(splits, dtype=torch.int64, device="cuda"),
        randn(E, 2 * F, D, scale=D**-0.5, dtype=param_dtype),
        randn(E, D, F, scale=F**-0.5, dtype=param_dtype),
        randn(rows, D),
    )


def poison_free_memory():
    # The caching allocator hands freed blocks back out: fill some with NaN and free them,
    # so the tier's `torch.empty` outputs start as NaN rather than stale valid numbers. It
    # keeps blocks of up to 1 MiB in a separate pool, hence the small ones too.
    nan = float("nan")
    blocks = [torch.full((2**26,), nan, device="cuda")]  # 256 MiB
    blocks += [torch.full((2**17,), nan, device="cuda") for _ in range(64)]  # 512 KiB each
    del blocks
    torch.cuda.synchronize()


def run(tier, x_RD, tokens_per_expert_E, gate_up_E2FD, down_EDF, dy_RD, autocast=False):
    leaves = [t.detach().clone().requires_grad_() for t in (x_RD, gate_up_E2FD, down_EDF)]
    x, gate_up, down = leaves
    poison_free_memory()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = tier(x, tokens_per_expert_E, gate_up, down)
    grads = torch.autograd.grad(y, leaves, dy_RD)
    return (y, *grads)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_available_here():
    GroupedLinearTier().check_available(torch.device("cuda"))


@pytest.mark.parametrize("case", SPLITS)
def test_matches_loop_in_bf16(case):
    splits = SPLITS[case]
    inputs = make_inputs(splits, seed=list(SPLITS).index(case))
    x, _, gate_up, down, dy = inputs
    ref = reference_f64(x, splits, gate_up, down, dy)
    loop = run(LoopTier(), *inputs)
    grouped = run(GroupedLinearTier(), *inputs)

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
    inputs = make_inputs(SPLITS["uneven"], seed=7)
    first, second = run(GroupedLinearTier(), *inputs), run(GroupedLinearTier(), *inputs)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def test_no_rows_at_all():
    inputs = make_inputs([0] * E, seed=3)
    y, dx, d_gate_up, d_down = run(GroupedLinearTier(), *inputs)
    assert y.shape == (0, D) and dx.shape == (0, D)
    assert torch.equal(d_gate_up, torch.zeros_like(d_gate_up))
    assert torch.equal(d_down, torch.zeros_like(d_down))


def test_fp32_master_weights_under_autocast():
    # The training setup: fp32 parameters, forward under bf16 autocast. Weight gradients
    # must come back in fp32 (autograd undoes the tier's casts), as accurate as the loop's.
    splits = SPLITS["zero_middle"]
    inputs = make_inputs(splits, seed=11, param_dtype=torch.float32)
    x, _, gate_up, down, dy = inputs
    ref = reference_f64(x, splits, gate_up, down, dy)
    loop = run(LoopTier(), *inputs, autocast=True)
    grouped = run(GroupedLinearTier(), *inputs, autocast=True)

    assert grouped[0].dtype == torch.bfloat16
    assert grouped[2].dtype == torch.float32 and grouped[3].dtype == torch.float32
    for name, out, loop_out, r in zip(NAMES, grouped, loop, ref):
        err, loop_err = rel_err(out, r), rel_err(loop_out, r)
        assert err <= BF16_REL_TOL, f"{name}: error {err:.2e}"
        assert err <= max(LOOP_ERROR_FACTOR * loop_err, LOOP_ERROR_FLOOR), (
            f"{name}: error {err:.2e}, loop tier's {loop_err:.2e}"
        )
