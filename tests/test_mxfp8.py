"""The `device_mxfp8` tier on the CPU: MXFP8 per the OCP MX spec v1.0 on hand-computed
blocks, its error bound, the emulated GEMMs against float64, the row padding, the Hopper
FP8 recipe through a CPU stand-in for its kernel, and how the tier picks its mode.

Shape suffixes: see te_mixtral/experts/base.py (its GEMM letters: P padded rows, K and N a
GEMM's input and output width).
"""

import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from te_mixtral.config import load_config
from te_mixtral.errors import TierUnavailable, UserError
from te_mixtral.experts.base import swiglu
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier, select_mode
from te_mixtral.experts.loop import LoopTier
from te_mixtral.experts.quant import mxfp8
from te_mixtral.experts.quant.fp8_hopper import (
    FP8HopperGemms,
    quantize_columns_per_group,
    quantize_rowwise,
)
from te_mixtral.experts.quant.mxfp8 import (
    MXFP8EmulatedGemms,
    e8m0_to_float,
    fake_quantize,
    quantize,
)
from te_mixtral.experts.quant.padding import pad_rows, padded_rows, unpad_rows
from te_mixtral.experts.quant.scaled_grouped import (
    scaled_grouped_linear,
    scaled_grouped_swiglu,
)
from te_mixtral.experts.quant.te_mxfp8 import MXFP8_ROW_ALIGN
from te_mixtral.experts.registry import make_tier

# Relative Frobenius error of a whole MLP (outputs and gradients) against unquantised fp32:
# one E4M3 rounding is ~3% rms on Gaussian data, a GEMM of two quantised operands ~4%, the
# MLP's chained GEMMs measured 7.5-8.2% (MXFP8, here) and 5.9-6.7% (FP8 rowwise with bf16
# outputs, here and on an H100). About twice that leaves room for other random draws; a
# wrong index or an unwritten expert gives errors near 1.
MXFP8_MLP_RTOL = 0.15
FP8_ROWWISE_MLP_RTOL = 0.12
# The same quantised operands, multiplied in float32 (accumulation order only).
FP32_RTOL = 1e-5


def block(values, fill=0.0):
    """A [32] float32 block: `values` first, then `fill`."""
    out = torch.full((32,), fill, dtype=torch.float32)
    out[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def scale_bits(q) -> list[int]:
    return q.scales.view(torch.uint8).flatten().tolist()


def rel_err(a, b) -> float:
    """||a - b|| / ||b||, and 0 where both are zero (an expert with no rows)."""
    diff, ref = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return diff / ref if ref else diff


def random_splits(num_experts, max_rows, generator):
    """Token counts with at least one empty expert, as routing produces."""
    counts = torch.randint(0, max_rows, (num_experts,), generator=generator)
    counts[torch.randint(0, num_experts, (1,), generator=generator)] = 0
    return counts


# --- MXFP8 on hand-computed blocks ------------------------------------------------------


def test_all_zero_block_gets_smallest_scale_and_zero_elements():
    q = quantize(torch.zeros(32))
    assert scale_bits(q) == [0x00]  # 2^-127: log2(0) = -inf, clamped to E8M0's minimum
    assert q.elements.float().eq(0).all()
    assert q.dequantize().eq(0).all()


def test_block_with_known_scale():
    # amax 3 -> floor(log2 3) = 1 -> s = 1 - 8 = -7: X = 2^-7, E8M0 bits 127 - 7 = 120.
    x = block([3.0, 1.0, -0.5, 0.01, 2.9])
    q = quantize(x)
    assert scale_bits(q) == [120]
    # Elements are x * 2^7 rounded to E4M3: 384 = 1.5*2^8, 128, -64 exact; 0.01 * 128 = 1.28
    # -> 1.25 (E4M3 spacing 0.125 in [1, 2)); 2.9 * 128 = 371.2 -> 384 (spacing 32 in [256, 512)).
    assert q.elements.float()[:5].tolist() == [384.0, 128.0, -64.0, 1.25, 384.0]
    assert q.dequantize()[:5].tolist() == [3.0, 1.0, -0.5, 1.25 / 128, 3.0]


@pytest.mark.parametrize("amax, bits, top_element", [
    (256.0, 127, 256.0),  # 2^8: s = 0, the top value is E4M3's top power of two
    (1.0, 119, 256.0),  # 2^0: s = -8
    (448.0 * 8, 130, 448.0),  # 448 * 2^3 = 3584: floor(log2) = 11, s = 3, lands on 448 exactly
    (448.0 * 2.0**-20, 107, 448.0),  # the same at a negative exponent: s = -20
])
def test_amax_on_a_power_of_two_or_448_times_one(amax, bits, top_element):
    q = quantize(block([amax, -amax / 4]))
    assert scale_bits(q) == [bits]
    assert q.elements.float()[:2].tolist() == [top_element, -top_element / 4]
    assert q.dequantize()[:2].tolist() == [amax, -amax / 4]  # exact: nothing saturates


def test_values_above_448_times_scale_saturate():
    # amax 500 -> floor(log2 500) = 8 -> s = 0; E4M3 stops at 448 (480 would be the next
    # step of the [256, 512) binade, but that code is NaN), so 460, 470, 500, -511 saturate.
    q = quantize(block([500.0, 470.0, 460.0, -511.0, 300.0]))
    assert scale_bits(q) == [127]
    assert q.elements.float()[:5].tolist() == [448.0, 448.0, 448.0, -448.0, 288.0]


def test_subnormal_elements_are_kept_and_round_to_nearest_even():
    # amax 1 -> s = -8. E4M3 subnormals are k * 2^-9, k = 1..7.
    q = quantize(block([1.0, 2.0**-15, 3 * 2.0**-18, 2.0**-18, 5 * 2.0**-17]))
    elements = q.elements.float()[:5].tolist()
    assert elements[1] == 2.0**-7  # 4 * 2^-9: a subnormal, exact
    assert elements[2] == 2.0**-8  # 1.5 * 2^-9: a tie, to even (2 * 2^-9)
    assert elements[3] == 0.0  # 0.5 * 2^-9: a tie, to even (0)
    assert elements[4] == 5 * 2.0**-9  # exact
    assert q.dequantize()[1].item() == 2.0**-15


def test_amax_below_the_scale_range_clamps_the_scale():
    # floor(log2 2^-130) - 8 = -138 < -127: the scale clamps to 2^-127 and the elements
    # absorb the rest (2^-130 * 2^127 = 2^-3), so the value still reads back exactly.
    q = quantize(block([2.0**-130]))
    assert scale_bits(q) == [0x00]
    assert q.dequantize()[0].item() == 2.0**-130


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_makes_the_whole_block_nan(special):
    x = torch.stack([block([1.0, special, 2.0]), block([1.0, 2.0])])  # two blocks
    q = quantize(x)
    assert scale_bits(q) == [0xFF, 120]  # NaN for the first block; 2^(1-8) for the second
    assert q.dequantize()[0].isnan().all()
    assert q.elements.float()[0].isnan().all()
    assert q.dequantize()[1, :2].tolist() == [1.0, 2.0]
    assert e8m0_to_float(q.scales)[0].isnan()


def test_blocks_run_along_the_chosen_dim():
    x = torch.randn(64, 96)
    along_rows = quantize(x, dim=0)
    assert along_rows.scales.shape == (2, 96)
    assert torch.equal(along_rows.dequantize(), quantize(x.t().contiguous(), dim=-1).dequantize().t())
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48))


def test_round_trip_error_bound_on_random_data():
    """Derivation in quant/mxfp8.py's docstring: with s the block's scale exponent, an
    unsaturated element is off by at most max(2^-4 |x|, 2^(s-10)); a saturated one
    (|x| > 448 * 2^s) by less than 2^(s+6), a quarter of the block's top power of two."""
    gen = torch.Generator().manual_seed(0)
    magnitude = torch.exp2(torch.randint(-40, 40, (512, 1), generator=gen).float())
    x = (torch.randn(512, 32, generator=gen) * magnitude).flatten()
    q = quantize(x)
    s = torch.log2(e8m0_to_float(q.scales)).repeat_interleave(32)
    error = (q.dequantize() - x).abs()
    saturated = x.abs() > 448 * torch.exp2(s)
    assert saturated.any() and (~saturated).any()
    bound = torch.maximum(x.abs() * 2.0**-4, torch.exp2(s - 10))
    assert (error[~saturated] <= bound[~saturated]).all()
    assert (error[saturated] < torch.exp2(s[saturated] + 6)).all()
    # The dequantised values are MXFP8 values: on the block's grid, and idempotent.
    assert torch.equal(fake_quantize(q.dequantize()), q.dequantize())


# --- the emulated GEMMs against float64 on the same quantised operands ------------------


def _groups(offsets):
    ends = offsets.tolist()
    return list(zip([0] + ends[:-1], ends))


def test_emulated_gemms_match_float64_on_the_quantised_operands():
    gen = torch.Generator().manual_seed(1)
    counts = random_splits(4, 70, gen)
    padded = padded_rows(counts, int(counts.sum()), align=32)
    x_PK = pad_rows(torch.randn(int(counts.sum()), 64, generator=gen), padded)
    w_GNK = torch.randn(4, 96, 64, generator=gen)
    dy_PN = torch.randn(padded.rows_P, 96, generator=gen)
    gemms = MXFP8EmulatedGemms()
    y, dx, dw = (gemms.fprop(x_PK, w_GNK, padded.offsets_L), gemms.dgrad(dy_PN, w_GNK, padded.offsets_L),
                 gemms.wgrad(dy_PN, x_PK, padded.offsets_L))

    x_K, w_K, dy_N, w_N = (fake_quantize(t, d).double() for t, d in ((x_PK, -1), (w_GNK, -1), (dy_PN, -1), (w_GNK, -2)))
    dy_rows, x_rows = fake_quantize(dy_PN, 0).double(), fake_quantize(x_PK, 0).double()
    for g, (start, end) in enumerate(_groups(padded.offsets_L)):
        assert rel_err(y[start:end], x_K[start:end] @ w_K[g].T) < FP32_RTOL
        assert rel_err(dx[start:end], dy_N[start:end] @ w_N[g]) < FP32_RTOL
        assert rel_err(dw[g], dy_rows[start:end].T @ x_rows[start:end]) < FP32_RTOL
    empty = (counts == 0).nonzero().flatten()
    assert empty.numel() and dw[empty].eq(0).all()  # padding rows add nothing


def test_straight_through_backward_uses_the_recipe_gemms():
    gen = torch.Generator().manual_seed(2)
    padded = padded_rows(torch.tensor([40, 0, 25]), 65, align=32)
    x_PK = torch.randn(padded.rows_P, 32, generator=gen, requires_grad=True)
    w_GNK = torch.randn(3, 64, 32, generator=gen, requires_grad=True)
    dy_PN = torch.randn(padded.rows_P, 64, generator=gen)
    gemms = MXFP8EmulatedGemms()
    y = scaled_grouped_linear(x_PK, w_GNK, padded.offsets_L, gemms)
    y.backward(dy_PN)
    assert torch.equal(y, gemms.fprop(x_PK, w_GNK, padded.offsets_L))
    assert torch.equal(x_PK.grad, gemms.dgrad(dy_PN, w_GNK, padded.offsets_L))
    assert torch.equal(w_GNK.grad, gemms.wgrad(dy_PN, x_PK, padded.offsets_L))


def _mlp_inputs(gen, num_experts=4, d=64, f=96, max_rows=50):
    counts = random_splits(num_experts, max_rows, gen)
    x_RD = torch.randn(int(counts.sum()), d, generator=gen, requires_grad=True)
    gate_up = (torch.randn(num_experts, 2 * f, d, generator=gen) / d**0.5).requires_grad_()
    down = (torch.randn(num_experts, d, f, generator=gen) / f**0.5).requires_grad_()
    return x_RD, counts, gate_up, down


def test_emulated_tier_forward_matches_float64_on_the_quantised_operands():
    gen = torch.Generator().manual_seed(3)
    x_RD, counts, gate_up, down = _mlp_inputs(gen)
    tier = DeviceMXFP8Tier("mxfp8-emulated")
    y_RD = tier(x_RD, counts, gate_up, down)

    padded = padded_rows(counts, x_RD.shape[0], align=32)
    x_PD = fake_quantize(pad_rows(x_RD, padded)).double()
    gate_up_q, down_q = fake_quantize(gate_up).double(), fake_quantize(down).double()
    expected = torch.zeros(padded.rows_P, x_RD.shape[1], dtype=torch.float64)
    for e, (start, end) in enumerate(_groups(padded.offsets_L)):
        h = swiglu(x_PD[start:end] @ gate_up_q[e].T)
        expected[start:end] = fake_quantize(h.float()).double() @ down_q[e].T
    # fp32 vs float64 h can land an element of h on the other side of an E4M3 rounding
    # boundary, now and then: far below the MXFP8 error itself.
    assert rel_err(y_RD, unpad_rows(expected, padded)) < 1e-4


@pytest.mark.parametrize("seed", [4, 5])
def test_emulated_tier_forward_and_backward_close_to_fp32(seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = _mlp_inputs(gen)
    y = DeviceMXFP8Tier("mxfp8-emulated")(*inputs)
    y_ref = LoopTier()(*inputs)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (inputs[0], inputs[2], inputs[3]), dy)
    grads_ref = torch.autograd.grad(y_ref, (inputs[0], inputs[2], inputs[3]), dy)
    assert rel_err(y, y_ref) < MXFP8_MLP_RTOL
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad, grad_ref) < MXFP8_MLP_RTOL


def test_tier_handles_no_rows_at_all():
    gen = torch.Generator().manual_seed(6)
    x_RD, _, gate_up, down = _mlp_inputs(gen)
    x_RD = x_RD[:0].detach().requires_grad_()
    y = DeviceMXFP8Tier("mxfp8-emulated")(x_RD, torch.zeros(4, dtype=torch.int64), gate_up, down)
    assert y.shape == (0, x_RD.shape[1])
    y.sum().backward()
    assert gate_up.grad.eq(0).all() and down.grad.eq(0).all()


# --- row padding ---------------------------------------------------------------------------


@pytest.mark.parametrize("align, min_rows", [(32, 0), (16, 16), (1, 0), (32, 5)])
def test_padding_round_trip_with_fresh_random_splits(align, min_rows):
    gen = torch.Generator().manual_seed(align + min_rows)
    for trial in range(20):
        num_experts = int(torch.randint(1, 9, (1,), generator=gen))
        counts = random_splits(num_experts, 100, gen) if trial % 5 else torch.zeros(num_experts, dtype=torch.int64)
        rows = int(counts.sum())
        padded = padded_rows(counts, rows, align, min_rows)

        splits = padded.splits_L
        assert int(splits.sum()) == padded.rows_P
        assert (splits % align == 0).all() and (splits >= counts).all()
        assert (splits[counts == 0][:-1] >= min_rows).all() if num_experts > 1 else True
        assert torch.equal(padded.offsets_L, splits.cumsum(0).to(torch.int32))
        # The padded size is a function of the row count alone: the host never needs the split.
        other_split = torch.tensor([rows] + [0] * (num_experts - 1))
        assert padded.rows_P == padded_rows(other_split, rows, align, min_rows).rows_P

        x_RD = torch.randn(rows, 3, generator=gen)
        x_PD = pad_rows(x_RD, padded)
        assert torch.equal(unpad_rows(x_PD, padded), x_RD)
        starts = (padded.offsets_L.long() - splits).tolist()
        for e, (start, n) in enumerate(zip(starts, counts.tolist())):
            first = int(counts[:e].sum())
            assert torch.equal(x_PD[start:start + n], x_RD[first:first + n])  # in order, at the start
            assert x_PD[start + n:start + int(splits[e])].eq(0).all()  # then zeros


def test_padding_is_differentiable_and_mxfp8_alignment_is_the_block():
    padded = padded_rows(torch.tensor([3, 0, 33]), 36, align=MXFP8_ROW_ALIGN)
    x_RD = torch.randn(36, 4, requires_grad=True)
    dy = torch.randn(36, 4)
    unpad_rows(pad_rows(x_RD, padded) * 2, padded).backward(dy)
    assert torch.equal(x_RD.grad, 2 * dy)
    assert MXFP8_ROW_ALIGN == mxfp8.BLOCK_SIZE == 32
    assert padded.splits_L.tolist()[:2] == [32, 0] and padded.splits_L[2] >= 64


# --- the Hopper FP8 recipe, through a CPU stand-in for torch._scaled_grouped_mm -------------


def scaled_grouped_mm_stand_in(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """What `torch._scaled_grouped_mm` computes with rowwise scales (PyTorch 2.11, CUDA), in
    float64 on the CPU, with the layout checks its CUDA kernel makes."""
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
    assert scale_a.dtype == scale_b.dtype == torch.float32 and out_dtype == torch.bfloat16
    assert mat_a.stride(-1) == 1, "mat_a must be row-major"
    assert mat_b.stride(-2) == 1, "mat_b must be column-major"
    assert mat_a.shape[-1] % 16 == 0 and mat_b.shape[-2] % 16 == 0 and mat_b.shape[-1] % 16 == 0
    assert offs.dtype == torch.int32
    a, b, groups = mat_a.double(), mat_b.double(), _groups(offs)
    if mat_b.dim() == 3:  # 2-D x 3-D: groups of A's rows
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (start, end) in enumerate(groups):
            out[start:end] = a[start:end] @ b[g] * scale_a[start:end, None] * scale_b[g]
    else:  # 2-D x 2-D: groups along the reduction dim, scales group-major
        m, n = a.shape[0], b.shape[1]
        assert scale_a.shape == (len(groups) * m,) and scale_b.shape == (len(groups) * n,)
        out = a.new_zeros(len(groups), m, n)
        for g, (start, end) in enumerate(groups):
            assert end - start > 0 and (end - start) % 16 == 0  # a device-side assert on CUDA
            out[g] = a[:, start:end] @ b[start:end] * scale_a[g * m:(g + 1) * m, None] * scale_b[g * n:(g + 1) * n]
    return out.to(out_dtype)


def test_rowwise_quantisers():
    x = torch.randn(64, 48)
    x[3] = 0
    q, scale = quantize_rowwise(x)
    assert q.float()[3].eq(0).all() and not q.float().isnan().any()
    assert torch.equal(q.float().abs().amax(1)[[0, 1, 2]], torch.full((3,), 448.0))
    assert rel_err(q.float() * scale[:, None], x) < 0.05

    offsets = torch.tensor([16, 16, 64], dtype=torch.int32)
    q_CP, scale_GC = quantize_columns_per_group(x, offsets)
    assert q_CP.shape == (48, 64) and q_CP.is_contiguous() and scale_GC.shape == (3 * 48,)
    for g, (start, end) in enumerate(_groups(offsets)):
        expected = x[start:end].abs().amax(0).clamp(min=1e-12) / 448 if end > start else torch.full((48,), 1e-12 / 448)
        assert torch.allclose(scale_GC[g * 48:(g + 1) * 48], expected)


def test_fp8_hopper_gemms_layouts_and_scales_on_cpu():
    gen = torch.Generator().manual_seed(7)
    counts = random_splits(3, 60, gen)
    padded = padded_rows(counts, int(counts.sum()), align=16, min_rows=16)
    x_PK = pad_rows(torch.randn(int(counts.sum()), 64, generator=gen), padded)
    w_GNK = torch.randn(3, 48, 64, generator=gen)
    dy_PN = pad_rows(torch.randn(int(counts.sum()), 48, generator=gen), padded)
    gemms = FP8HopperGemms(scaled_grouped_mm_stand_in, compile=False)
    offsets = padded.offsets_L
    y, dx, dw = gemms.fprop(x_PK, w_GNK, offsets), gemms.dgrad(dy_PN, w_GNK, offsets), gemms.wgrad(dy_PN, x_PK, offsets)
    x64, w64, dy64 = x_PK.double(), w_GNK.double(), dy_PN.double()
    for g, (start, end) in enumerate(_groups(offsets)):
        if end - start and x64[start:end].abs().sum():
            assert rel_err(y[start:end], x64[start:end] @ w64[g].T) < 0.06
            assert rel_err(dx[start:end], dy64[start:end] @ w64[g]) < 0.06
            assert rel_err(dw[g], dy64[start:end].T @ x64[start:end]) < 0.06
        else:
            assert dw[g].eq(0).all()


def test_fp8_hopper_mlp_on_cpu_close_to_fp32():
    gen = torch.Generator().manual_seed(8)
    x_RD, counts, gate_up, down = _mlp_inputs(gen, d=64, f=96)
    padded = padded_rows(counts, x_RD.shape[0], align=16, min_rows=16)
    gemms = FP8HopperGemms(scaled_grouped_mm_stand_in, compile=False)
    y = unpad_rows(scaled_grouped_swiglu(pad_rows(x_RD, padded), padded.offsets_L, gate_up, down, gemms), padded)
    y_ref = LoopTier()(x_RD, counts, gate_up, down)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (x_RD, gate_up, down), dy)
    grads_ref = torch.autograd.grad(y_ref, (x_RD, gate_up, down), dy)
    assert y.dtype == x_RD.dtype
    assert rel_err(y, y_ref) < FP8_ROWWISE_MLP_RTOL
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad, grad_ref) < FP8_ROWWISE_MLP_RTOL


@pytest.mark.slow
def test_compiled_quantisers_match_eager_ones():
    """The tier runs the quantisers through torch.compile on the GPU; same numbers here."""
    gen = torch.Generator().manual_seed(9)
    x_RD, counts, gate_up, down = _mlp_inputs(gen, d=64, f=96)
    padded = padded_rows(counts, x_RD.shape[0], align=16, min_rows=16)
    dy_PD = torch.randn(padded.rows_P, 64, generator=gen)
    outputs = []
    for compiled in (False, True):
        gemms = FP8HopperGemms(scaled_grouped_mm_stand_in, compile=compiled)
        y = scaled_grouped_swiglu(pad_rows(x_RD, padded), padded.offsets_L, gate_up, down, gemms)
        outputs.append((y, *torch.autograd.grad(y, (x_RD, gate_up, down), dy_PD)))
    for eager, compiled in zip(*outputs):
        assert torch.equal(eager, compiled)


# --- no host synchronisation -----------------------------------------------------------------

# Ops that make the host wait for the GPU when their tensors live there: reading a value
# (.item(), .tolist(), int(t)), an output whose size depends on the data, or a tensor made
# from Python data on its way to the device (assigning a Python number into a CUDA tensor
# is one: a host-to-device copy from pageable memory).
SYNCHRONISING_OPS = {
    "aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.lift_fresh",
    "aten.repeat_interleave", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim",
    "aten.equal", "aten.is_nonzero",
}


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _shape_only_kernel(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_grouped_mm's output shape, no arithmetic: the kernel itself reads the
    offsets on the device, so only what the tier does around it is under test here."""
    if mat_b.dim() == 3:
        return torch.zeros(mat_a.shape[0], mat_b.shape[2], dtype=out_dtype)
    return torch.zeros(offs.numel(), mat_a.shape[0], mat_b.shape[1], dtype=out_dtype)


@pytest.mark.parametrize("gemms", ["mxfp8-emulated", "fp8-hopper"])
def test_no_synchronising_op_in_forward_and_backward(gemms):
    """The CPU half of tests/gpu's set_sync_debug_mode("error") check: every aten op the
    tier issues, forward and backward, is one that never waits for the GPU."""
    with _OpRecorder() as recorder:
        t = torch.zeros(3, dtype=torch.int64)
        t[-1] = 1
    assert "aten.lift_fresh" in recorder.ops  # the recorder does see such ops

    gen = torch.Generator().manual_seed(10)
    x_RD, counts, gate_up, down = _mlp_inputs(gen)
    dy = torch.randn(x_RD.shape, generator=gen)
    if gemms == "mxfp8-emulated":
        tier = DeviceMXFP8Tier("mxfp8-emulated")
    else:
        hopper_gemms = FP8HopperGemms(_shape_only_kernel, compile=False)

        def tier(x_RD, counts, gate_up, down):
            padded = padded_rows(counts, x_RD.shape[0], hopper_gemms.row_align, hopper_gemms.min_rows)
            y_PD = scaled_grouped_swiglu(pad_rows(x_RD, padded), padded.offsets_L, gate_up, down, hopper_gemms)
            return unpad_rows(y_PD, padded)

    with _OpRecorder() as recorder:
        torch.autograd.grad(tier(x_RD, counts, gate_up, down), (x_RD, gate_up, down), dy)
    assert recorder.ops and not recorder.ops & SYNCHRONISING_OPS


# --- choosing the mode ----------------------------------------------------------------------


def test_auto_mode_by_device():
    assert select_mode("auto", "cuda", (9, 0)) == "fp8-hopper"
    assert select_mode("auto", "cuda", (10, 0)) == "mxfp8-te"
    assert select_mode("mxfp8-emulated", "cuda", (8, 0)) == "mxfp8-emulated"


@pytest.mark.parametrize("mode, device_type, capability, te_reason, message", [
    ("auto", "cpu", None, None, "no 8-bit grouped GEMM for cpu; use --mxfp8_mode mxfp8-emulated"),
    ("auto", "cuda", (8, 0), None, "no 8-bit grouped GEMM for cuda sm_80"),
    ("auto", "cuda", (12, 0), None, "no 8-bit grouped GEMM for cuda sm_120"),
    ("auto", "cuda", (10, 0), "not installed", "mode 'mxfp8-te' (picked by mode 'auto') here: not installed"),
    ("mxfp8-te", "cuda", (9, 0), None, "need a Blackwell GPU (sm_100 to sm_110), this one is sm_90"),
    ("fp8-hopper", "cuda", (10, 0), None, "needs a Hopper GPU (sm_90) and this one is sm_100"),
    ("fp8-hopper", "cpu", None, None, "needs a CUDA GPU"),
    ("mxfp8-te", "cpu", None, None, "needs a CUDA GPU"),
])
def test_modes_that_cannot_run_say_why_in_one_line(mode, device_type, capability, te_reason, message):
    with pytest.raises(TierUnavailable, match=re.escape(message)) as error:
        select_mode(mode, device_type, capability, lambda: te_reason)
    assert "\n" not in str(error.value)


def test_tier_from_the_registry_describes_what_runs():
    tier = make_tier("device_mxfp8")
    assert tier.name == "device_mxfp8" and tier.requested_mode == "auto"
    with pytest.raises(RuntimeError):
        tier.describe()
    with pytest.raises(TierUnavailable):  # auto never picks emulation
        tier.check_available(torch.device("cpu"))
    tier = make_tier("device_mxfp8", load_config(None, {"mxfp8_mode": "mxfp8-emulated"}))
    tier.check_available(torch.device("cpu"))
    assert tier.describe() == {
        "recipe": "mxfp8-emulated",
        "kernel": "torch.nn.functional.grouped_mm on MXFP8-dequantised operands",
        "device": "cpu",
        "precision": "mxfp8",
    }
    with pytest.raises(TierUnavailable):
        DeviceMXFP8Tier("fp8-hopper").check_available("cpu")
    with pytest.raises(UserError, match="mode must be one of"):
        DeviceMXFP8Tier("fp8")
