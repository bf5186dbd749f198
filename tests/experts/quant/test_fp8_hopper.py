"""quant/fp8_hopper.py on the CPU: the Hopper FP8 rowwise recipe, through a float64 stand-in
for torch._scaled_grouped_mm that makes its CUDA kernel's layout checks.

Shape suffixes: see te_mixtral/experts/base.py (its GEMM letters: Q padded rows, I and N a
GEMM's input and output width).
"""

import pytest
import torch
from quant_reference import (
    FP8_ROWWISE_MLP_RTOL,
    group_bounds,
    mlp_inputs,
    random_splits,
    rel_err,
    scaled_grouped_mm_stand_in,
)

from te_mixtral.experts.loop import LoopTier
from te_mixtral.experts.quant.fp8_hopper import (
    FP8HopperGemms,
    quantize_columns_per_group,
    quantize_rowwise,
)
from te_mixtral.experts.quant.padding import pad_rows, padded_rows, unpad_rows
from te_mixtral.experts.quant.scaled_grouped import scaled_grouped_swiglu


def test_rowwise_quantisers():
    x = torch.randn(64, 48)
    x[3] = 0
    q, scale = quantize_rowwise(x)
    assert q.float()[3].eq(0).all() and not q.float().isnan().any()
    assert torch.equal(q.float().abs().amax(1)[[0, 1, 2]], torch.full((3,), 448.0))
    assert rel_err(q.float() * scale[:, None], x) < 0.05

    offsets = torch.tensor([16, 16, 64], dtype=torch.int32)
    q_CQ, scale_GC = quantize_columns_per_group(x, offsets)
    assert q_CQ.shape == (48, 64) and q_CQ.is_contiguous() and scale_GC.shape == (3 * 48,)
    for g, (start, end) in enumerate(group_bounds(offsets)):
        expected = x[start:end].abs().amax(0).clamp(min=1e-12) / 448 if end > start else torch.full((48,), 1e-12 / 448)
        assert torch.allclose(scale_GC[g * 48:(g + 1) * 48], expected)


def test_fp8_hopper_gemms_layouts_and_scales_on_cpu():
    gen = torch.Generator().manual_seed(7)
    counts = random_splits(3, 60, gen)
    padded = padded_rows(counts, int(counts.sum()), align=16, min_rows=16)
    x_QI = pad_rows(torch.randn(int(counts.sum()), 64, generator=gen), padded)
    w_GNI = torch.randn(3, 48, 64, generator=gen)
    dy_QN = pad_rows(torch.randn(int(counts.sum()), 48, generator=gen), padded)
    gemms = FP8HopperGemms(scaled_grouped_mm_stand_in, compile=False)
    offsets = padded.offsets_L
    y, dx, dw = gemms.fprop(x_QI, w_GNI, offsets), gemms.dgrad(dy_QN, w_GNI, offsets), gemms.wgrad(dy_QN, x_QI, offsets)
    x64, w64, dy64 = x_QI.double(), w_GNI.double(), dy_QN.double()
    for g, (start, end) in enumerate(group_bounds(offsets)):
        if end - start and x64[start:end].abs().sum():
            assert rel_err(y[start:end], x64[start:end] @ w64[g].T) < 0.06
            assert rel_err(dx[start:end], dy64[start:end] @ w64[g]) < 0.06
            assert rel_err(dw[g], dy64[start:end].T @ x64[start:end]) < 0.06
        else:
            assert dw[g].eq(0).all()


def test_fp8_hopper_mlp_on_cpu_close_to_fp32():
    gen = torch.Generator().manual_seed(8)
    x_RD, counts, gate_up, down = mlp_inputs(gen, d=64, f=96)
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
    x_RD, counts, gate_up, down = mlp_inputs(gen, d=64, f=96)
    padded = padded_rows(counts, x_RD.shape[0], align=16, min_rows=16)
    dy_QD = torch.randn(padded.rows_Q, 64, generator=gen)
    outputs = []
    for compiled in (False, True):
        gemms = FP8HopperGemms(scaled_grouped_mm_stand_in, compile=compiled)
        y = scaled_grouped_swiglu(pad_rows(x_RD, padded), padded.offsets_L, gate_up, down, gemms)
        outputs.append((y, *torch.autograd.grad(y, (x_RD, gate_up, down), dy_QD)))
    for eager, compiled in zip(*outputs):
        assert torch.equal(eager, compiled)
