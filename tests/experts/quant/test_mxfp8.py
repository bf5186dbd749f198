"""quant/mxfp8.py on the CPU: MXFP8 per the OCP MX spec v1.0 on hand-computed blocks, its
error bound, and the emulated GEMMs (and their straight-through backward through
quant/scaled_grouped.py) against float64 on the same quantised operands.

Shape suffixes: see te_mixtral/__init__.py (its GEMM letters: Q padded rows, I and N a
GEMM's input and output width).
"""

import math

import pytest
import torch
from quant_reference import FP32_RTOL, group_bounds, random_splits, rel_err

from te_mixtral.experts.quant.mxfp8 import (
    MXFP8EmulatedGemms,
    e8m0_to_float,
    fake_quantize,
    quantize,
)
from te_mixtral.experts.quant.padding import pad_rows, padded_rows
from te_mixtral.experts.quant.scaled_grouped import scaled_grouped_linear


def block(values, fill=0.0):
    """A [32] float32 block: `values` first, then `fill`."""
    out = torch.full((32,), fill, dtype=torch.float32)
    out[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def scale_bits(q) -> list[int]:
    return q.scales.view(torch.uint8).flatten().tolist()



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


def test_emulated_gemms_match_float64_on_the_quantised_operands():
    gen = torch.Generator().manual_seed(1)
    counts = random_splits(4, 70, gen)
    padded = padded_rows(counts, int(counts.sum()), align=32)
    x_QI = pad_rows(torch.randn(int(counts.sum()), 64, generator=gen), padded)
    w_GNI = torch.randn(4, 96, 64, generator=gen)
    dy_QN = torch.randn(padded.rows_Q, 96, generator=gen)
    gemms = MXFP8EmulatedGemms()
    y, dx, dw = (gemms.fprop(x_QI, w_GNI, padded.offsets_L), gemms.dgrad(dy_QN, w_GNI, padded.offsets_L),
                 gemms.wgrad(dy_QN, x_QI, padded.offsets_L))

    x_I, w_I, dy_N, w_N = (fake_quantize(t, d).double() for t, d in ((x_QI, -1), (w_GNI, -1), (dy_QN, -1), (w_GNI, -2)))
    dy_rows, x_rows = fake_quantize(dy_QN, 0).double(), fake_quantize(x_QI, 0).double()
    for g, (start, end) in enumerate(group_bounds(padded.offsets_L)):
        assert rel_err(y[start:end], x_I[start:end] @ w_I[g].T) < FP32_RTOL
        assert rel_err(dx[start:end], dy_N[start:end] @ w_N[g]) < FP32_RTOL
        assert rel_err(dw[g], dy_rows[start:end].T @ x_rows[start:end]) < FP32_RTOL
    empty = (counts == 0).nonzero().flatten()
    assert empty.numel() and dw[empty].eq(0).all()  # padding rows add nothing


def test_straight_through_backward_uses_the_recipe_gemms():
    gen = torch.Generator().manual_seed(2)
    padded = padded_rows(torch.tensor([40, 0, 25]), 65, align=32)
    x_QI = torch.randn(padded.rows_Q, 32, generator=gen, requires_grad=True)
    w_GNI = torch.randn(3, 64, 32, generator=gen, requires_grad=True)
    dy_QN = torch.randn(padded.rows_Q, 64, generator=gen)
    gemms = MXFP8EmulatedGemms()
    y = scaled_grouped_linear(x_QI, w_GNI, padded.offsets_L, gemms)
    y.backward(dy_QN)
    assert torch.equal(y, gemms.fprop(x_QI, w_GNI, padded.offsets_L))
    assert torch.equal(x_QI.grad, gemms.dgrad(dy_QN, w_GNI, padded.offsets_L))
    assert torch.equal(w_GNI.grad, gemms.wgrad(dy_QN, x_QI, padded.offsets_L))

