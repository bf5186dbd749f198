"""quant/fp8_hopper.py on the CPU: the Hopper FP8 rowwise recipe, through a float64 stand-in
for torch._scaled_grouped_mm that makes its CUDA kernel's layout checks.

Shape suffixes: see te_mixtral/__init__.py (its GEMM letters: Q padded rows, I and N a
GEMM's input and output width).
"""

import os

import pytest
import torch
from background import assert_passed, interpreter_run
from conftest import interpreter_runs_reduced_loop_bounds, some_slow
from expert_reference import random_adapters, reference_lora_f64
from quant_reference import (
    FP8_ROWWISE_MLP_RTOL,
    group_bounds,
    mlp_inputs,
    random_splits,
    rel_err,
    scaled_grouped_mm_stand_in,
)

from te_mixtral.experts.adapters import ExpertAdapters
from te_mixtral.experts.base import swiglu
from te_mixtral.experts.kernels.scaled_grouped_mm import scaled_grouped_mm as triton_scaled_grouped_mm
from te_mixtral.experts.loop import LoopTier
from te_mixtral.experts.quant.fp8_hopper import (
    INV_E4M3_MAX,
    MIN_AMAX,
    FP8HopperGemms,
    quantize_columns_per_group,
    quantize_rowwise,
)
from te_mixtral.experts.quant.fp8_swiglu import FP8SwiGLUExperts
from te_mixtral.experts.quant.frozen_fp8 import FrozenFP8Weight
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
    gemms = FP8HopperGemms(scaled_grouped_mm_stand_in)
    offsets = padded.offsets_L
    weight = gemms.weight(w_GNI)
    y, dx = gemms.fprop(x_QI, weight, offsets), gemms.dgrad(dy_QN, weight, offsets)
    dw = gemms.wgrad(dy_QN, x_QI, offsets)
    x64, w64, dy64 = x_QI.double(), w_GNI.double(), dy_QN.double()
    for g, (start, end) in enumerate(group_bounds(offsets)):
        if end - start and x64[start:end].abs().sum():
            assert rel_err(y[start:end], x64[start:end] @ w64[g].T) < 0.06
            assert rel_err(dx[start:end], dy64[start:end] @ w64[g]) < 0.06
            assert rel_err(dw[g], dy64[start:end].T @ x64[start:end]) < 0.06
        else:
            assert dw[g].eq(0).all()
    # A kernel that takes no addend (torch's, this stand-in) gets it added after the product.
    add_QN, add_QI = torch.randn(y.shape, generator=gen), torch.randn(dx.shape, generator=gen)
    assert torch.equal(gemms.fprop(x_QI, weight, offsets, add=add_QN), y + add_QN)
    assert torch.equal(gemms.dgrad(dy_QN, weight, offsets, add=add_QI), dx + add_QI)


def test_fp8_hopper_mlp_on_cpu_close_to_fp32():
    gen = torch.Generator().manual_seed(8)
    x_RD, counts, gate_up, down = mlp_inputs(gen, d=64, f=96)
    padded = padded_rows(counts, x_RD.shape[0], align=16, min_rows=16)
    gemms = FP8HopperGemms(scaled_grouped_mm_stand_in)
    y = unpad_rows(scaled_grouped_swiglu(pad_rows(x_RD, padded), padded.offsets_L, gate_up, down, gemms), padded)
    y_ref = LoopTier()(x_RD, counts, gate_up, down)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (x_RD, gate_up, down), dy)
    grads_ref = torch.autograd.grad(y_ref, (x_RD, gate_up, down), dy)
    assert y.dtype == x_RD.dtype
    assert rel_err(y, y_ref) < FP8_ROWWISE_MLP_RTOL
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad, grad_ref) < FP8_ROWWISE_MLP_RTOL



# --- the weight cache ------------------------------------------------------------------------


def _counting_gemms():
    gemms = FP8HopperGemms(scaled_grouped_mm_stand_in)
    made = []  # shapes only: holding the weights would keep them alive
    quantize = gemms._quantize_weight
    gemms._quantize_weight = lambda w: made.append(w.shape) or quantize(w)
    return gemms, made


class _UnversionedSGD(torch.optim.Optimizer):
    """Writes the parameters as a kernel would, without bumping their version counters
    (MasterAdamW's Triton kernel on the GPU, FSDP's all-gather)."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self):
        for p in self.param_groups[0]["params"]:
            p.data.sub_(p.grad)


@pytest.mark.parametrize("optimizer", ["adamw", "unversioned"])
def test_weights_are_quantised_once_per_optimizer_step(optimizer):
    w = torch.nn.Parameter(torch.randn(2, 32, 16))
    gemms, made = _counting_gemms()
    first = gemms.weight(w)
    assert gemms.weight(w) is first and len(made) == 1  # micro-batches, recompute and dgrad share it
    assert torch.equal(first[0][0].float(), quantize_rowwise(w.detach())[0].float())

    w.grad = torch.randn_like(w)
    opt = torch.optim.AdamW([w], lr=0.1) if optimizer == "adamw" else _UnversionedSGD([w])
    version = w._version
    opt.step()
    assert (w._version == version) == (optimizer == "unversioned")
    second = gemms.weight(w)
    assert len(made) == 2 and not torch.equal(second[0][0].float(), first[0][0].float())
    assert torch.equal(second[0][0].float(), quantize_rowwise(w.detach())[0].float())


def test_without_the_cache_weights_are_quantised_at_every_use():
    gemms = FP8HopperGemms(scaled_grouped_mm_stand_in, cache_weights=False)
    made = []
    quantize = gemms._quantize_weight
    gemms._quantize_weight = lambda w: made.append(w.shape) or quantize(w)
    w = torch.randn(2, 32, 16)
    first, second = gemms.weight(w), gemms.weight(w)
    assert len(made) == 2 and first is not second and "weights quantised at every use" in gemms.kernel
    for a, b in zip(first, second):
        assert all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))


def test_weight_cache_sees_in_place_writes_and_never_a_freed_tensor():
    gemms, made = _counting_gemms()
    w = torch.randn(2, 32, 16)
    gemms.weight(w)
    with torch.no_grad():
        w.mul_(2)  # bumps w's version
    assert torch.equal(gemms.weight(w)[0][1], quantize_rowwise(w)[1]) and len(made) == 2

    # A fresh tensor (autocast's cast of fp32 master weights, made every forward) is a miss
    # even if it lands on the freed one's memory with the same version.
    address = w.data_ptr()
    del w
    fresh = torch.randn(2, 32, 16)
    gemms.weight(fresh)
    assert len(made) == 3, f"stale hit (same address: {fresh.data_ptr() == address})"
    assert len(gemms._weights._entries) == 1  # the freed tensor's entry is gone


# --- the Triton quantisers, run by the interpreter in a fresh process --------------------------

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETER_RUN = interpreter_run(__file__)
PLANNED_COMMANDS = [INTERPRETER_RUN]  # run from the session's start (conftest.py's planned_command)


@pytest.mark.skipif(INTERPRETING, reason="this is the launcher")
@interpreter_runs_reduced_loop_bounds
def test_triton_quantisers_in_interpreter(planned_command):
    assert_passed(planned_command(INTERPRETER_RUN)[0], __file__)


def _scaled(x, scale):
    """What the kernels store before the FP8 cast: the reference's values, unrounded."""
    return (x.float() / scale).clamp(-448.0, 448.0)


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("row_block", [None, 16])  # one block per row; rows of several blocks
def test_interpreter_quantize_rows_matches_reference(monkeypatch, row_block):
    from te_mixtral.experts.quant import fp8_cast

    if row_block:
        monkeypatch.setattr(fp8_cast, "_MAX_ROW_BLOCK", row_block)
    x = torch.randn(3, 20, 48) * torch.rand(3, 20, 1) * 10
    x[1, 4] = 0
    q, scale = fp8_cast.quantize_rows(x, out_dtype=torch.float32)
    ref_q, ref_scale = quantize_rowwise(x)
    assert scale.shape == (3, 20) and torch.equal(scale, ref_scale)
    assert torch.equal(q, _scaled(x, ref_scale[..., None]))
    strided = torch.randn(20, 80)[:, :48]  # rows with a stride
    assert torch.equal(fp8_cast.quantize_rows(strided, out_dtype=torch.float32)[1], quantize_rowwise(strided)[1])


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
def test_interpreter_quantize_columns_matches_reference():
    from te_mixtral.experts.quant import fp8_cast

    # Groups of 16-row multiples that straddle the kernel's 64-row tiles, one empty group,
    # and columns that are not a multiple of its 64-column tiles.
    ends = torch.tensor([48, 48, 176, 192], dtype=torch.int32)
    x = torch.randn(192, 80) * torch.rand(1, 80) * 5
    q_CQ, scale = fp8_cast.quantize_columns(x, ends, out_dtype=torch.float32)
    ref_q, ref_scale = quantize_columns_per_group(x, ends)
    assert torch.equal(scale, ref_scale)
    scale_GC = ref_scale.reshape(4, 80)
    for g, (start, end) in enumerate(group_bounds(ends)):
        assert torch.equal(q_CQ[:, start:end], _scaled(x[start:end], scale_GC[g]).t())


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
def test_interpreter_quantize_columns_of_rows_times_a_factor_at_any_split():
    """With `row_scale_Q` the columns quantised are those of x with each row multiplied by
    its factor; groups start anywhere, and q's rows are 16 aligned for the GEMM's loads."""
    from te_mixtral.experts.quant import fp8_cast

    ends = torch.tensor([5, 5, 150, 181], dtype=torch.int32)
    x = torch.randn(181, 80) * torch.rand(1, 80) * 5
    row_scale = torch.rand(181) + 0.5
    q_CQ, scale = fp8_cast.quantize_columns(x, ends, row_scale_Q=row_scale, out_dtype=torch.float32)
    assert q_CQ.shape == (80, 181) and q_CQ.stride(0) % 16 == 0
    scaled_x = x * row_scale[:, None]
    for g, (start, end) in enumerate(group_bounds(ends)):
        amax = scaled_x[start:end].abs().amax(0) if end > start else torch.zeros(80)
        expected = amax.clamp(min=MIN_AMAX) * INV_E4M3_MAX
        assert torch.equal(scale[g * 80:(g + 1) * 80], expected), g
        assert torch.equal(q_CQ[:, start:end], _scaled(scaled_x[start:end], expected).t()), g


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
def test_interpreter_transpose_writes_rows_16_aligned():
    from te_mixtral.experts.quant import fp8_cast

    q = torch.randn(150, 37)  # neither dim a multiple of the tiles or of 16
    t = fp8_cast.transpose(q)
    assert t.shape == (37, 150) and t.stride() == (160, 1) and torch.equal(t, q.t())
    assert t.as_strided((37, 10), (160, 1), 150).eq(0).all()  # the slack holds zeros


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("amax_walk", [None, ((16, 16, 4), 32)])  # shipped; several row blocks and walks
def test_interpreter_quantize_weight_gives_both_orientations(monkeypatch, amax_walk):
    from te_mixtral.experts.quant import fp8_cast

    if amax_walk:
        monkeypatch.setattr(fp8_cast, "WEIGHT_AMAX_TILE", amax_walk[0])
        monkeypatch.setattr(fp8_cast, "WEIGHT_AMAX_COLUMNS", amax_walk[1])
    w = torch.randn(3, 80, 48) * torch.rand(3, 1, 48)  # dims not multiples of the 64-wide tiles
    w[1, :, 5] = 0
    (q_GNI, scale_GN), (q_GIN, scale_GI) = fp8_cast.quantize_weight(w, out_dtype=torch.float32)
    ref_scale_GN, ref_scale_GI = quantize_rowwise(w)[1], quantize_rowwise(w.transpose(-2, -1))[1]
    assert torch.equal(scale_GN, ref_scale_GN) and torch.equal(scale_GI, ref_scale_GI)
    assert torch.equal(q_GNI, _scaled(w, ref_scale_GN[..., None]))
    assert torch.equal(q_GIN, _scaled(w.transpose(-2, -1), ref_scale_GI[..., None]))


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("row_block", [None, 16])  # one block per row; rows of several blocks
def test_interpreter_swiglu_casts_match_swiglu_then_reference(monkeypatch, row_block):
    from te_mixtral.experts.quant import fp8_cast

    if row_block:
        monkeypatch.setattr(fp8_cast, "_MAX_ROW_BLOCK", row_block)

    # One program a row, each row alike: a few rows take every path.
    gu = torch.randn(12, 2 * 40) * 2
    h = swiglu(gu)
    q, scale = fp8_cast.quantize_rows(gu, swiglu=True, out_dtype=torch.float32)
    ref_scale = quantize_rowwise(h)[1]
    assert torch.allclose(scale, ref_scale, rtol=1e-6) and torch.allclose(q, _scaled(h, scale[:, None]), rtol=1e-6)
    act = torch.full_like(h, float("nan"))  # the SwiGLU output itself, written by the same pass
    again = fp8_cast.quantize_rows(gu, swiglu=True, out_dtype=torch.float32, values_out=act)
    assert torch.allclose(act, h, rtol=1e-6, atol=1e-7) and all(map(torch.equal, again, (q, scale)))
    with pytest.raises(ValueError, match="values_out must be contiguous of shape"):
        fp8_cast.quantize_rows(gu, swiglu=True, out_dtype=torch.float32, values_out=torch.empty(12, 80))

    dh = torch.randn(12, 40)
    dgu_q, dgu_scale = fp8_cast.swiglu_backward_rows(dh, gu, out_dtype=torch.float32)
    gu_leaf = gu.clone().requires_grad_()
    (expected,) = torch.autograd.grad(swiglu(gu_leaf), gu_leaf, dh)
    assert torch.allclose(dgu_scale, quantize_rowwise(expected)[1], rtol=1e-5)
    assert torch.allclose(dgu_q, _scaled(expected, dgu_scale[:, None]), rtol=1e-5, atol=1e-4)
    grad = torch.full_like(gu, float("nan"))  # d(gate_up) itself, written by the same pass
    again = fp8_cast.swiglu_backward_rows(dh, gu, out_dtype=torch.float32, grad_out_Q2F=grad)
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(again, (dgu_q, dgu_scale)))


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
def test_interpreter_triton_scaled_grouped_mm_computes_the_documented_product():
    """kernels/scaled_grouped_mm.py on float32 values, both cases, against the float64
    stand-in and a per-group loop: an empty group, groups that start and end mid-tile, and
    widths that leave a partial tile along every dim (float32 values run 64 x 64 x 32
    tiles). The wgrad operands are laid out as quantize_columns writes them, rows 16
    aligned, with NaN in the slack: a read past a group's rows would show."""
    gen = torch.Generator().manual_seed(5)
    offs = torch.tensor([5, 5, 61, 107], dtype=torch.int32)
    rows, k, n = 107, 48, 80
    a, w = torch.randn(rows, k, generator=gen), torch.randn(len(offs), n, k, generator=gen)
    scale_a, scale_b = torch.rand(rows, generator=gen) + 0.5, torch.rand(len(offs), n, generator=gen) + 0.5
    got = triton_scaled_grouped_mm(a, w.transpose(-2, -1), scale_a, scale_b, offs, out_dtype=torch.float32)
    expected = scaled_grouped_mm_stand_in(a, w.transpose(-2, -1), scale_a, scale_b, offs, out_dtype=torch.float32)
    assert rel_err(got, expected) < 1e-6
    add = torch.randn(rows, n, generator=gen)  # LoRA's delta, added in the epilogue after the scales
    got = triton_scaled_grouped_mm(a, w.transpose(-2, -1), scale_a, scale_b, offs, out_dtype=torch.float32, add=add)
    assert rel_err(got, expected + add) < 1e-6

    dy, x = torch.randn(rows, n, generator=gen), torch.randn(rows, k, generator=gen)
    scale_dy, scale_x = torch.rand(len(offs) * n, generator=gen) + 0.5, torch.rand(len(offs) * k, generator=gen) + 0.5
    got = triton_scaled_grouped_mm(_rows_16_aligned(dy.t()), _rows_16_aligned(x.t()).t(), scale_dy, scale_x, offs,
                                   out_dtype=torch.float32)
    for g, (start, end) in enumerate(group_bounds(offs)):
        expected = (dy[start:end].double().t() @ x[start:end].double()
                    * scale_dy[g * n:(g + 1) * n, None].double() * scale_x[g * k:(g + 1) * k].double())
        assert rel_err(got[g], expected) < 1e-6 if end > start else torch.equal(got[g], torch.zeros(n, k)), g


def _rows_16_aligned(t_CQ):
    out = torch.full((t_CQ.shape[0], -(-t_CQ.shape[1] // 16) * 16), float("nan"))
    out[:, :t_CQ.shape[1]] = t_CQ
    return out[:, :t_CQ.shape[1]]


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("counts", [[5, 0, 37, 20], [0, 0, 40, 0]])
@pytest.mark.parametrize("gemms", some_slow(["triton", "stand-in"], ["stand-in"]))
def test_interpreter_fused_fp8_mlp_data_flow_equals_the_unquantised_mlp(counts, gemms):
    """The fused FP8 MLP with every FP8 value left unrounded (float32) computes exactly the
    MLP: forward and all three gradients against the loop tier, to float32 rounding, with
    the tier's Triton GEMMs and with the float64 stand-in for torch._scaled_grouped_mm."""
    gen = torch.Generator().manual_seed(11)
    counts = torch.tensor(counts)
    _, _, gate_up, down = mlp_inputs(gen, d=32, f=48)
    x_RD = torch.randn(int(counts.sum()), 32, generator=gen, requires_grad=True)
    experts = FP8SwiGLUExperts(None if gemms == "triton" else scaled_grouped_mm_stand_in,
                               value_dtype=torch.float32, out_dtype=torch.float32)
    padded = padded_rows(counts, x_RD.shape[0], experts.row_align, experts.min_rows)  # none: rows as they come
    y = unpad_rows(experts.mlp(pad_rows(x_RD, padded), padded, gate_up, down), padded)
    y_ref = LoopTier()(x_RD, counts, gate_up, down)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (x_RD, gate_up, down), dy)
    grads_ref = torch.autograd.grad(y_ref, (x_RD, gate_up, down), dy)
    assert rel_err(y, y_ref) < 1e-5
    for name, grad, grad_ref in zip(("dx", "d_gate_up", "d_down"), grads, grads_ref):
        assert grad.dtype == grad_ref.dtype and rel_err(grad, grad_ref) < 1e-5, name


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
def test_interpreter_fused_fp8_mlp_micro_batches_add_into_grad(monkeypatch):
    """The fused FP8 MLP's weight gradients, float32 values, added into .grad by its wgrad
    kernel across micro-batches (expert_reference.check_micro_batches_add_into_grad)."""
    from expert_reference import check_micro_batches_add_into_grad

    gen = torch.Generator().manual_seed(13)
    experts = FP8SwiGLUExperts(value_dtype=torch.float32, out_dtype=torch.float32)

    def op(x_RD, counts, gate_up, down):
        padded = padded_rows(counts, x_RD.shape[0], experts.row_align, experts.min_rows)
        return unpad_rows(experts.mlp(pad_rows(x_RD, padded), padded, gate_up, down), padded)

    batches = []
    for counts in ([5, 0, 37, 20], [0, 0, 40, 0], [0, 0, 0, 0]):
        rows = sum(counts)
        batches.append((torch.randn(rows, 32, generator=gen), torch.tensor(counts), torch.randn(rows, 32, generator=gen)))
    _, _, gate_up, down = mlp_inputs(gen, d=32, f=48)
    check_micro_batches_add_into_grad(op, batches, gate_up, down, monkeypatch)


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
def test_interpreter_requantize_transposed_equals_casting_the_dequantised_weight():
    """The dgrad copy of a weight held in FP8 alone: q * scale cast along N, as quantize_weight
    casts a BF16 weight (float32 values, so the scaling is what is compared)."""
    from te_mixtral.experts.quant import fp8_cast

    gen = torch.Generator().manual_seed(21)
    w = torch.randn(3, 40, 24, generator=gen) * torch.rand(3, 40, 1, generator=gen)
    q, scale = quantize_rowwise(w, value_dtype=torch.float32)
    qt, scale_t = fp8_cast.requantize_transposed(q, scale, out_dtype=torch.float32)
    want_qt, want_scale = quantize_rowwise((q * scale[..., None]).transpose(-2, -1), value_dtype=torch.float32)
    assert torch.allclose(scale_t, want_scale, rtol=1e-6) and rel_err(qt, want_qt) < 1e-6
    assert rel_err(qt * scale_t[..., None], w.transpose(-2, -1)) < 1e-6
    again = fp8_cast.requantize_transposed(q, scale, out_dtype=torch.float32, scale_GI=scale_t)
    assert torch.equal(again[0], qt) and again[1] is scale_t  # given its scales, the same cast


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
def test_interpreter_a_frozen_weight_keeps_its_dgrad_scales_until_its_values_change():
    """FrozenFP8Weight finds the dgrad copy's scales once; a load into its rows (or any
    in-place write) makes it find them again, so the copy always matches the values."""
    from te_mixtral.experts.quant import fp8_cast

    gen = torch.Generator().manual_seed(22)
    weight = FrozenFP8Weight((2, 24, 40), value_dtype=torch.float32).copy_(torch.randn(2, 24, 40, generator=gen))
    given = []

    def requantize(q, scale, out_dtype, scale_GI=None):
        given.append(scale_GI)
        return fp8_cast.requantize_transposed(q, scale, out_dtype=out_dtype, scale_GI=scale_GI)

    def fresh():
        return fp8_cast.requantize_transposed(weight.values, weight.scale, out_dtype=torch.float32)

    first, second = (weight.dgrad_operand(requantize)[1] for _ in range(2))
    assert given[0] is None and given[1] is first[1]
    assert all(map(torch.equal, second, fresh()))
    weight[1, 3:9].copy_(torch.randn(6, 40, generator=gen) * 50)  # a larger amax in some columns
    third = weight.dgrad_operand(requantize)[1]
    assert given[2] is None and not torch.equal(third[1], first[1])
    assert all(map(torch.equal, third, fresh()))


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("targets", some_slow([("gate_up", "down"), ("gate_up",), ("down",), ()],
                                               [("gate_up",), ("down",), ()]), ids=["both", "gate_up", "down", "none"])
@pytest.mark.parametrize("splits", [[5, 0, 37, 20], [0, 0, 0, 0]], ids=["uneven", "no-rows"])
@pytest.mark.parametrize("keep_hidden", some_slow([True, False], [False]), ids=["kept", "recomputed"])
def test_interpreter_frozen_fp8_base_data_flow_equals_float64_lora(targets, splits, keep_hidden):
    """The MLP over a frozen FP8 base (LoRA), every FP8 value left unrounded (float32), its
    hidden rows kept or made again in the backward (selective recompute): y and the gradients
    of x and of every adapter A and B equal a float64 loop over experts, to float32 rounding,
    and the base takes no gradient."""
    gen = torch.Generator().manual_seed(len(targets) + sum(splits))
    d, f, counts = 32, 48, torch.tensor(splits)
    _, _, gate_up, down = (t.detach() for t in mlp_inputs(gen, d=d, f=f))
    x_RD = torch.randn(sum(splits), d, generator=gen, requires_grad=True)
    dy = torch.randn(x_RD.shape, generator=gen)
    pairs = random_adapters(splits, d, f, rank=3, seed=9, targets=targets)
    leaves = {name: tuple(t.clone().requires_grad_() for t in pair) for name, pair in pairs.items()}
    adapters = ExpertAdapters(leaves.get("gate_up"), leaves.get("down"), 1.7, 0.0) if leaves else None
    frozen = [FrozenFP8Weight(w.shape, value_dtype=torch.float32).copy_(w) for w in (gate_up, down)]
    experts = FP8SwiGLUExperts(value_dtype=torch.float32, out_dtype=torch.float32)
    padded = padded_rows(counts, x_RD.shape[0], experts.row_align, experts.min_rows)
    y = unpad_rows(experts.frozen_mlp(pad_rows(x_RD, padded), padded, *frozen, adapters, keep_hidden), padded)
    flat = [t for pair in leaves.values() for t in pair]
    got = (y, *torch.autograd.grad(y, [x_RD, *flat], dy))
    want = reference_lora_f64(x_RD, splits, gate_up, down, pairs, 1.7, dy)
    assert len(got) == len(want)
    for i, (out, ref) in enumerate(zip(got, want)):
        assert out.shape == ref.shape and (out.double() - ref).norm() <= 1e-5 * ref.norm() + 1e-30, i
    assert all(not b.requires_grad for w in frozen for b in w.buffers())


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("recompute", some_slow(["none", "selective"], ["selective"]))
def test_interpreter_model_over_a_frozen_fp8_base_equals_the_loop_tier(recompute):
    """The whole model with LoRA over device_mxfp8's frozen base (as on a Hopper GPU, the FP8
    values kept unrounded), built and initialised as a run does: its logits and every
    adapter's gradient equal the same model over the loop tier, the seeded base being one."""
    from model.test_hf_parity import random_packed_batch

    from te_mixtral.config import LoRAConfig, ModelConfig
    from te_mixtral.distributed.layout import Layout
    from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
    from te_mixtral.model.layers import TORCH
    from te_mixtral.model.lora import add_adapters
    from te_mixtral.model.mixtral import MixtralForCausalLM, causal_lm_loss, init_weights

    single = Layout(0, 1, 1, None, None)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)
    fp8 = DeviceMXFP8Tier("fp8-hopper")
    fp8.mode, fp8._device = "fp8-hopper", torch.device("cpu")
    fp8._runner = FP8SwiGLUExperts(value_dtype=torch.float32, out_dtype=torch.float32)
    torch.manual_seed(0)
    batch = random_packed_batch(cfg.vocab_size)
    results = {}
    for name, tier in (("loop", LoopTier()), ("fp8", fp8)):
        model = MixtralForCausalLM(cfg, TORCH, single, tier, recompute, frozen_base=True)
        init_weights(model, 5, single)
        add_adapters(model, LoRAConfig(rank=4, alpha=8.0, targets="q_proj,v_proj,gate_up_proj,down_proj"), 6, single)
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if param_name.endswith(".B"):
                    p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(param_name)))
        logits = model(batch.input_ids, batch.packed)
        causal_lm_loss(logits, batch.labels, (batch.labels != -100).sum()).backward()
        results[name] = logits, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, FrozenFP8Weight)
    # Selective recompute runs inside the op (its backward makes gu again): one call per layer.
    assert fp8.calls() == {"fp8-hopper, frozen FP8 base": 2}
    assert rel_err(results["fp8"][0], results["loop"][0]) < 1e-5
    assert results["fp8"][1].keys() == results["loop"][1].keys()
    for n, grad in results["loop"][1].items():
        assert rel_err(results["fp8"][1][n], grad) < 1e-4, n
