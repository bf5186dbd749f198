"""`device_mxfp8` on CUDA GPUs.

Hopper (sm_90), mode `fp8-hopper`:
- each FP8 GEMM (fprop, dgrad, wgrad) against what `torch._scaled_grouped_mm` is documented
  to compute, evaluated in float64 by the CPU suite's stand-in on the same operands;
- the whole tier, forward and all three gradients, against the `loop` tier in float32,
  within FP8_ROWWISE_MLP_RTOL (tests/quant_reference.py says where that number comes from);
- no host synchronisation: the tier's forward and backward run under
  `torch.cuda.set_sync_debug_mode("error")`;
- the Transformer Engine plumbing of the Blackwell mode, run under an FP8 recipe that
  Hopper has (only the recipe differs on Blackwell).
Blackwell (sm_100+), mode `mxfp8-te`: the same accuracy and sync checks (marked
`blackwell`; not run by this project so far, no such GPU was available).

Timing is in test_device_mxfp8_timing_gpu.py.

Relative errors are Frobenius: ||out - ref|| / ||ref||.
"""

import weakref

import pytest
import torch
from expert_reference import accumulated_and_summed_grads, random_expert_inputs
from quant_reference import (
    FP8_ROWWISE_MLP_RTOL,
    MXFP8_MLP_RTOL,
    rel_err,
    scaled_grouped_mm_stand_in,
)
from torch.utils.checkpoint import checkpoint

from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.experts.kernels import scaled_grouped_mm as triton_gemms
from te_mixtral.experts.loop import LoopTier
from te_mixtral.experts.quant import fp8_cast
from te_mixtral.experts.quant.fp8_hopper import (
    FP8HopperGemms,
    quantize_columns_per_group,
    quantize_rowwise,
)
from te_mixtral.experts.quant.fp8_swiglu import FP8SwiGLUExperts
from te_mixtral.experts.quant.padding import pad_rows, padded_rows, unpad_rows
from te_mixtral.experts.quant.te_mxfp8 import MIN_TE_VERSION, TEGroupedExperts
from te_mixtral.te_support import te_available

pytestmark = pytest.mark.cuda

# The real kernel and the float64 stand-in on the same FP8 operands differ by the bf16
# rounding of the output (2^-9 relative), accumulation order, and the FP8 tensor cores'
# narrower accumulator (a few 1e-3 at Mixtral's reductions: docs/precision.md).
SAME_OPERANDS_RTOL = 1e-2
# TE's Float8CurrentScaling is one scale per tensor, E5M2 gradients (HYBRID format): looser
# than rowwise. This checks the wiring (wrong weights or splits give errors near 1).
TE_FP8_TENSOR_RTOL = 0.25

D, F_HIDDEN, E = 512, 1024, 4  # every GEMM dim a multiple of 16, as the FP8 kernel needs
NAMES = ("y", "dx", "d_gate_up", "d_down")
SPLITS = {
    "uneven": [1, 37, 300, 94],
    "zero_middle": [64, 0, 0, 129],
    "one_expert": [0, 0, 256, 0],
}


def _capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


hopper = pytest.mark.skipif(_capability() != (9, 0), reason="needs a Hopper GPU (sm_90)")


def make_inputs(splits, seed, param_dtype=torch.bfloat16):
    """The shared random inputs, with x, gate_up and down as leaves that want gradients."""
    x, counts, gate_up, down, dy = random_expert_inputs(splits, D, F_HIDDEN, seed, param_dtype=param_dtype)
    return x.requires_grad_(), counts, gate_up.requires_grad_(), down.requires_grad_(), dy


def run(tier, x, counts, gate_up, down, dy):
    """Output and the gradients of x, gate_up and down."""
    y = tier(x, counts, gate_up, down)
    return (y, *torch.autograd.grad(y, (x, gate_up, down), dy))


def reference(x, counts, gate_up, down, dy):
    """The `loop` tier in float32 on the same values."""
    leaves = [t.detach().float().requires_grad_() for t in (x, gate_up, down)]
    return run(LoopTier(), leaves[0], counts, leaves[1], leaves[2], dy.float())


def assert_close(got, ref, rtol):
    errors = {name: rel_err(a, b) for name, a, b in zip(NAMES, got, ref)}
    print(" ".join(f"{name}={error:.4f}" for name, error in errors.items()))
    assert all(a.isfinite().all() for a in got)
    assert max(errors.values()) < rtol, errors


# --- Hopper: fp8-hopper ----------------------------------------------------------------------


@hopper
def test_describe_and_refusals_on_hopper():
    tier = DeviceMXFP8Tier()
    tier.check_available(torch.device("cuda"))
    described = tier.describe()
    print(described)
    assert tier.mode == "fp8-hopper" and described["recipe"] == "fp8-rowwise"
    assert "(sm_90)" in described["device"] and triton_gemms.KERNEL in described["kernel"]
    with pytest.raises(TierUnavailable, match="Blackwell") as error:
        DeviceMXFP8Tier("mxfp8-te").check_available(torch.device("cuda"))
    assert "\n" not in str(error.value)


@hopper
def test_fp8_gemms_compute_what_scaled_grouped_mm_documents():
    counts = torch.tensor([40, 0, 300, 17], device="cuda")
    padded = padded_rows(counts, 357, align=16, min_rows=16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_QI = pad_rows(torch.randn(357, 256, device="cuda", generator=gen).bfloat16(), padded)
    dy_QN = pad_rows(torch.randn(357, 384, device="cuda", generator=gen).bfloat16(), padded)
    w_GNI = torch.randn(E, 384, 256, device="cuda", generator=gen).bfloat16()
    real = FP8SwiGLUExperts().gemms
    documented = FP8HopperGemms(scaled_grouped_mm_stand_in)
    for op, operands in (("fprop", (x_QI, w_GNI)), ("dgrad", (dy_QN, w_GNI)), ("wgrad", (dy_QN, x_QI))):
        got_operands, expected_operands = operands, operands
        if op != "wgrad":
            got_operands, expected_operands = (operands[0], real.weight(w_GNI)), (operands[0], documented.weight(w_GNI))
        got = getattr(real, op)(*got_operands, padded.offsets_L)
        expected = getattr(documented, op)(*expected_operands, padded.offsets_L)
        print(op, f"{rel_err(got, expected):.2e}")
        assert got.shape == expected.shape and got.dtype == torch.bfloat16
        assert rel_err(got, expected) < SAME_OPERANDS_RTOL, op


@hopper
@pytest.mark.parametrize("reduction", [4096, 28672])  # Mixtral-8x7B's fprop and gate_up dgrad
def test_triton_fp8_gemms_at_mixtral_reductions(reduction):
    """The tier's Triton FP8 GEMM against the float64 stand-in and against
    torch._scaled_grouped_mm (CUTLASS, exact accumulation) on the same operands: the error
    Hopper's FP8 accumulation adds over long reductions stays within the tolerance."""
    counts = torch.tensor([200, 0, 56], device="cuda")
    padded = padded_rows(counts, 256, align=16, min_rows=16)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = pad_rows(torch.randn(256, reduction, device="cuda", generator=gen).bfloat16(), padded)
    w = torch.randn(3, 512, reduction, device="cuda", generator=gen).bfloat16()
    errors = {}
    for name, mm in (("triton", triton_gemms.scaled_grouped_mm), ("cutlass", None)):
        gemms = FP8HopperGemms(mm)
        errors[name] = rel_err(gemms.fprop(x, gemms.weight(w), padded.offsets_L),
                               FP8HopperGemms(scaled_grouped_mm_stand_in).fprop(x, gemms.weight(w), padded.offsets_L))
    print(reduction, {name: f"{error:.2e}" for name, error in errors.items()})
    assert errors["triton"] < SAME_OPERANDS_RTOL and errors["cutlass"] < SAME_OPERANDS_RTOL


@hopper
def test_triton_quantisers_equal_the_torch_reference_bit_for_bit():
    """quant/fp8_cast.py against fp8_hopper.py's PyTorch quantisers, in FP8 on the GPU
    (the CPU interpreter checks the same kernels before the cast)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for cols in (4096, 28672):  # a row in one block, and one of several blocks
        x = torch.randn(48, cols, device="cuda", generator=gen).bfloat16() * 3
        x[5] = 0
        q, scale = fp8_cast.quantize_rows(x)
        ref_q, ref_scale = quantize_rowwise(x)
        assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), cols
    ends = torch.tensor([48, 48, 1040, 1088], device="cuda", dtype=torch.int32)
    x = torch.randn(1088, 640, device="cuda", generator=gen).bfloat16()
    q, scale = fp8_cast.quantize_columns(x, ends)
    ref_q, ref_scale = quantize_columns_per_group(x, ends)
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    w = torch.randn(4, 384, 256, device="cuda", generator=gen).bfloat16()
    for got, expected in zip(fp8_cast.quantize_weight(w), (quantize_rowwise(w), quantize_rowwise(w.transpose(-2, -1)))):
        assert torch.equal(got[1], expected[1]) and torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))


@hopper
@pytest.mark.parametrize("split", SPLITS)
def test_fp8_hopper_tier_close_to_fp32(split):
    inputs = make_inputs(SPLITS[split], seed=1)
    assert_close(run(DeviceMXFP8Tier("fp8-hopper"), *inputs), reference(*inputs), FP8_ROWWISE_MLP_RTOL)


@hopper
def test_fp8_hopper_runs_bf16_custom_grouped_below_its_break_even_size():
    inputs = make_inputs(SPLITS["uneven"], seed=6)  # 432 rows over 4 experts: 108 per expert
    bf16 = run(CustomGroupedTier(), *inputs)
    for min_rows, expect_bf16 in ((109, True), (108, False)):
        tier = DeviceMXFP8Tier("fp8-hopper", min_rows_per_expert=min_rows)
        tier.check_available(torch.device("cuda"))
        got = run(tier, *inputs)
        assert "BF16 custom_grouped kernels for calls under" in tier.describe()["kernel"]
        assert all(torch.equal(a, b) for a, b in zip(got, bf16)) == expect_bf16, min_rows
        assert_close(got, reference(*inputs), FP8_ROWWISE_MLP_RTOL)


@hopper
def test_fp8_hopper_without_the_weight_cache_computes_the_same_bits():
    # Quantising the weights at every use instead of once per step changes what is held, not
    # the values: the same quantiser on the same weights, so the same bits everywhere.
    inputs = make_inputs(SPLITS["uneven"], seed=7)
    cached, uncached = DeviceMXFP8Tier("fp8-hopper"), DeviceMXFP8Tier("fp8-hopper", cache_weights=False)
    for tier in (cached, uncached):
        tier.check_available(torch.device("cuda"))
    assert "weights quantised at every use" in uncached.describe()["kernel"]
    assert all(torch.equal(a, b) for a, b in zip(run(uncached, *inputs), run(cached, *inputs)))


@hopper
def test_without_the_weight_cache_a_recomputed_call_keeps_no_fp8_weights():
    # With fp8.weight_cache off, torch's checkpoint drops the FP8 weights the forward made
    # (saved tensors, like the rest) and the recompute makes them again: none outlive the
    # forward, which is what lets a recomputed layer hold them only while it runs.
    tier = DeviceMXFP8Tier("fp8-hopper", min_rows_per_expert=0, cache_weights=False)
    tier.check_available(torch.device("cuda"))
    gemms, made = tier._runner.gemms, []
    quantize = gemms._quantize_weight

    def remembered(w):
        value = quantize(w)
        made.extend(weakref.ref(t) for orientation in value for t in orientation)
        return value

    gemms._quantize_weight = remembered
    x, counts, gate_up, down, dy = make_inputs(SPLITS["uneven"], seed=8)
    y = checkpoint(tier, x, counts, gate_up, down, use_reentrant=False)
    assert len(made) == 8 and all(ref() is None for ref in made)  # 2 weights x 2 orientations x (q, scale)
    grads = torch.autograd.grad(y, (x, gate_up, down), dy)
    assert len(made) == 16  # made again by the recompute
    assert all(torch.equal(a, b) for a, b in zip((y, *grads), run(tier, x, counts, gate_up, down, dy)))


@hopper
def test_fp8_hopper_tier_under_autocast_with_fp32_master_weights():
    x, counts, gate_up, down, dy = make_inputs(SPLITS["uneven"], seed=2, param_dtype=torch.float32)
    with torch.autocast("cuda", torch.bfloat16):
        got = run(DeviceMXFP8Tier(), x, counts, gate_up, down, dy)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == got[3].dtype == torch.float32
    assert_close(got, reference(x, counts, gate_up, down, dy), FP8_ROWWISE_MLP_RTOL)


@hopper
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_fp8_hopper_micro_batches_add_into_grad(param_dtype):
    # From the second micro-batch the FP8 wgrad kernel adds into .grad. Against the
    # micro-batches' gradients summed apart, only roundings differ: the bf16 output of each
    # wgrad there, one rounding to the parameters' dtype per addition here.
    tier = DeviceMXFP8Tier("fp8-hopper", min_rows_per_expert=0)
    tier.check_available(torch.device("cuda"))

    def op(*args):
        with torch.autocast("cuda", torch.bfloat16, enabled=param_dtype == torch.float32):
            return tier(*args)

    batches = [random_expert_inputs(SPLITS[name], D, F_HIDDEN, seed=30 + n, param_dtype=param_dtype)
               for n, name in enumerate(SPLITS)]
    grads, summed = accumulated_and_summed_grads(op, [(x, counts, dy) for x, counts, _, _, dy in batches],
                                                 *batches[0][2:4])
    assert tier.calls() == {"fp8-hopper": 2 * len(batches)}
    for name, grad, total in zip(("d_gate_up", "d_down"), grads, summed):
        assert grad.dtype == param_dtype and rel_err(grad, total) <= 1e-2, name


@pytest.mark.parametrize("mode", ["fp8-hopper", "mxfp8-emulated"])
def test_no_host_sync_in_forward_and_backward(mode):
    tier = DeviceMXFP8Tier(mode)
    try:
        tier.check_available(torch.device("cuda"))
    except TierUnavailable as error:
        pytest.skip(str(error))
    inputs = make_inputs(SPLITS["zero_middle"], seed=3)
    run(tier, *inputs)  # warm-up: compilation, kernel handles, the allocator's pools
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(tier, *inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@hopper
@pytest.mark.skipif(not te_available(MIN_TE_VERSION), reason=f"needs Transformer Engine >= {MIN_TE_VERSION}")
def test_te_plumbing_on_hopper_with_an_fp8_recipe_hopper_has():
    """`mxfp8-te` minus MXFP8: the same meta-device `te.GroupedLinear`, `functional_call`,
    padded CUDA `m_splits` and `te.autocast`, with Float8CurrentScaling instead."""
    from transformer_engine.common.recipe import Float8CurrentScaling

    experts = TEGroupedExperts(Float8CurrentScaling())
    print(experts.recipe, "|", experts.kernel, "| row_align", experts.row_align)

    def tier(x_RD, counts, gate_up, down):
        padded = padded_rows(counts, x_RD.shape[0], experts.row_align, experts.min_rows)
        return unpad_rows(experts.mlp(pad_rows(x_RD, padded), padded, gate_up, down), padded)

    inputs = make_inputs(SPLITS["uneven"], seed=4)
    assert_close(run(tier, *inputs), reference(*inputs), TE_FP8_TENSOR_RTOL)


# --- Blackwell: mxfp8-te (not run here) -------------------------------------------------------


@pytest.mark.blackwell
@pytest.mark.parametrize("split", SPLITS)
def test_mxfp8_te_tier_on_blackwell(split):
    tier = DeviceMXFP8Tier()
    tier.check_available(torch.device("cuda"))
    print(tier.describe())
    assert tier.mode == "mxfp8-te"
    inputs = make_inputs(SPLITS[split], seed=5)
    got = run(tier, *inputs)
    assert_close(got, reference(*inputs), MXFP8_MLP_RTOL)
    # TE and the emulation both compute MXFP8; they differ in how the block scale is
    # rounded (quant/mxfp8.py) and in accumulation order.
    assert_close(got, run(DeviceMXFP8Tier("mxfp8-emulated"), *inputs), MXFP8_MLP_RTOL)
