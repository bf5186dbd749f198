"""`custom_grouped` on a CUDA GPU: accuracy against float64 and against grouped_mm, no
host synchronisation, CUDA-graph replay at new split sizes, and the edge shapes.

Errors are relative Frobenius errors ||out - ref|| / ||ref|| against float64 computed
from the same bf16 values, one expert at a time. Two bars, both named:

- BF16_REL_TOL: bf16 operands with fp32 accumulation land between 1e-3 and 1e-2; a wrong
  index or an unwritten tile lands far above.
- GMM_ERROR_FACTOR: no worse than 1.5x the error of `torch grouped_mm` in bf16 on the
  same inputs (the grouped_mm path of the tier computes it), one of the kernel's targets
  (docs/kernels.md).

Memory freed just before each call is filled with NaN, so an output element the kernels
fail to write reads as NaN, and NaN never passes.
"""

import pytest
import torch
from expert_reference import (
    GPU_SPLITS,
    accumulated_and_summed_grads,
    random_expert_inputs,
    reference_f64,
    rel_err,
    run_tier,
)

from te_mixtral.experts.custom_grouped import CustomGroupedTier, grouped_mm_swiglu

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16_REL_TOL = 1e-2
GMM_ERROR_FACTOR = 1.5
FP32_REL_TOL = 1e-4  # fp32 inputs run tf32x3 dots: about fp32 error
NAMES = ("y", "dx", "d_gate_up", "d_down")

D, F_, E = 256, 384, 4  # small, every dim a multiple of 16 like real models
SPLITS = GPU_SPLITS


def check(got, ref, splits, what, gmm=None, tol=BF16_REL_TOL):
    for i, name in enumerate(NAMES):
        assert got[i].shape == ref[i].shape, f"{what} {name}: shape {tuple(got[i].shape)}"
        err = rel_err(got[i], ref[i])
        assert err <= tol, f"{what} {name}: error {err:.2e}"
        if gmm is not None:
            gmm_err = rel_err(gmm[i], ref[i])
            assert err <= GMM_ERROR_FACTOR * gmm_err, (
                f"{what} {name}: error {err:.2e}, grouped_mm's {gmm_err:.2e}")
    for e, n in enumerate(splits):  # per expert: a small expert cannot hide in the total
        if n == 0:
            assert torch.equal(got[2][e], torch.zeros_like(got[2][e])), f"{what} expert {e}"
            assert torch.equal(got[3][e], torch.zeros_like(got[3][e])), f"{what} expert {e}"
        else:
            assert rel_err(got[2][e], ref[2][e]) <= tol, f"{what} d_gate_up[{e}]"
            assert rel_err(got[3][e], ref[3][e]) <= tol, f"{what} d_down[{e}]"


def test_available_here():
    CustomGroupedTier().check_available(torch.device("cuda"))


@pytest.mark.parametrize("case", SPLITS)
def test_bf16_at_least_as_accurate_as_grouped_mm(case):
    splits = SPLITS[case]
    inputs = random_expert_inputs(splits, D, F_, seed=list(SPLITS).index(case))
    ref = reference_f64(inputs[0], splits, *inputs[2:])
    got = run_tier(CustomGroupedTier(), *inputs)
    assert got[0].dtype == torch.bfloat16
    check(got, ref, splits, case, gmm=run_tier(grouped_mm_swiglu, *inputs))


@pytest.mark.parametrize("model,D_,Fh,splits", [
    ("8x7B", 4096, 14336, [0, 100, 64, 92]),
    ("8x22B", 6144, 16384, [17, 0, 40]),
    # The few-rows tables (16, 32 and 64 rows a tile) and medium few rows, each streaming
    # the last round of its row GEMMs over all the SMs; two row tiles, streaming nothing.
    ("8x7B_few_rows_one_expert", 4096, 14336, [16]),
    ("8x7B_few_rows_two_experts", 4096, 14336, [21, 0]),
    ("8x7B_few_rows_64_one_expert", 4096, 14336, [64]),
    ("8x7B_few_rows_128_one_expert", 4096, 14336, [128]),
    ("8x22B_two_row_tiles_two_experts", 6144, 16384, [128, 90]),
    ("8x7B_medium_few_rows_one_expert", 4096, 14336, [256]),
])
def test_model_shapes_at_small_token_counts(model, D_, Fh, splits):
    inputs = random_expert_inputs(splits, D_, Fh, seed=1)
    ref = reference_f64(inputs[0], splits, *inputs[2:])
    got = run_tier(CustomGroupedTier(), *inputs)
    check(got, ref, splits, model, gmm=run_tier(grouped_mm_swiglu, *inputs))


@pytest.mark.parametrize("case,splits,D_,Fh", [
    ("one_local_expert", [300], 256, 384),
    ("64_local_experts", [0, 3, 1, 17, 0, 9, 2, 30] * 8, 128, 256),
    ("32768_rows_on_one", [32768, 0, 5], 128, 128),
    ("unaligned_dims_no_tma", [7, 0, 50, 3], 100, 150),
])
def test_edge_shapes(case, splits, D_, Fh):
    inputs = random_expert_inputs(splits, D_, Fh, seed=3)
    check(run_tier(CustomGroupedTier(), *inputs), reference_f64(inputs[0], splits, *inputs[2:]),
          splits, case)


def test_fp32_inputs():
    splits = SPLITS["zero_middle"]
    inputs = random_expert_inputs(splits, D, F_, seed=4, dtype=torch.float32)
    got = run_tier(CustomGroupedTier(), *inputs)
    check(got, reference_f64(inputs[0], splits, *inputs[2:]), splits, "fp32", tol=FP32_REL_TOL)


def test_fp32_master_weights_under_autocast():
    # The training setup: fp32 parameters, bf16 autocast. The op casts the weights inside
    # and writes weight gradients in fp32 straight from its fp32 accumulators.
    splits = SPLITS["zero_middle"]
    x, counts, gate_up, down, dy = random_expert_inputs(splits, D, F_, seed=11, dtype=torch.float32)
    ref = reference_f64(x, splits, gate_up, down, dy)
    got = run_tier(CustomGroupedTier(), x, counts, gate_up, down, dy.bfloat16(), autocast=True)
    assert got[0].dtype == torch.bfloat16
    assert got[1].dtype == got[2].dtype == got[3].dtype == torch.float32
    gmm = run_tier(grouped_mm_swiglu, x.bfloat16(), counts, gate_up, down, dy.bfloat16())
    check(got, ref, splits, "autocast", gmm=gmm)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_micro_batches_add_into_grad(param_dtype):
    # Gradient accumulation as training runs it: from the second micro-batch the weight
    # gradients are added into .grad by the kernel. Against the micro-batches' gradients
    # summed apart, the only difference is one rounding to the parameters' dtype per addition.
    batches = [random_expert_inputs(splits, D, F_, seed=20 + n, param_dtype=param_dtype)
               for n, splits in enumerate((SPLITS["uneven"], SPLITS["zero_first"], [0] * E, SPLITS["one_expert"]))]
    grads, summed = accumulated_and_summed_grads(
        CustomGroupedTier(), [(x, counts, dy) for x, counts, _, _, dy in batches], *batches[0][2:4])
    for name, grad, total in zip(("d_gate_up", "d_down"), grads, summed):
        assert grad.dtype == param_dtype
        assert rel_err(grad, total) <= (1e-2 if param_dtype == torch.bfloat16 else 1e-6), name


def test_same_inputs_same_bits():
    # No atomics, a fixed reduction order: a result that moves between runs is a race.
    inputs = random_expert_inputs(SPLITS["uneven"], D, F_, seed=7)
    first, second = run_tier(CustomGroupedTier(), *inputs), run_tier(CustomGroupedTier(), *inputs)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def test_no_rows_at_all():
    y, dx, d_gate_up, d_down = run_tier(CustomGroupedTier(), *random_expert_inputs([0] * E, D, F_, seed=3))
    assert y.shape == (0, D) and dx.shape == (0, D)
    assert torch.equal(d_gate_up, torch.zeros_like(d_gate_up))
    assert torch.equal(d_down, torch.zeros_like(d_down))


def test_backward_twice_raises():
    x, counts, gate_up, down, dy = random_expert_inputs([5, 3], D, F_, seed=2)
    gate_up.requires_grad_()
    y = CustomGroupedTier()(x, counts, gate_up, down)
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        y.backward(dy)


def test_no_host_synchronisation():
    tier = CustomGroupedTier()
    x, counts, gate_up, down, dy = random_expert_inputs(SPLITS["zero_middle"], D, F_, seed=5)
    leaves = [t.requires_grad_() for t in (x, gate_up, down)]
    torch.autograd.grad(tier(x, counts, gate_up, down), leaves, dy)  # compile outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(tier(x, counts, gate_up, down), leaves, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replays_at_new_splits():
    """Capture forward+backward once, then replay with other split sizes (same total) and
    fresh data: each replay must match float64, and equal the eager op bit for bit."""
    tier = CustomGroupedTier()
    first, *later = [[40, 0, 100, 116], [0, 0, 256, 0], [1, 85, 85, 85], [128, 128, 0, 0]]
    x, counts, gate_up, down, dy = random_expert_inputs(first, D, F_, seed=8)
    leaves = [t.requires_grad_() for t in (x, gate_up, down)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and compile) off the capture
        for _ in range(2):
            torch.autograd.grad(tier(x, counts, gate_up, down), leaves, dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tier(x, counts, gate_up, down)
        grads = torch.autograd.grad(y, leaves, dy)

    for seed, splits in enumerate(later):
        fresh = random_expert_inputs(splits, D, F_, seed=100 + seed)
        with torch.no_grad():
            for static, new in zip((x, counts, gate_up, down, dy), fresh):
                static.copy_(new)
        graph.replay()
        replayed = [t.clone() for t in (y, *grads)]
        check(replayed, reference_f64(fresh[0], splits, *fresh[2:]), splits, f"replay {splits}")
        eager = run_tier(tier, *fresh)
        for name, a, b in zip(NAMES, replayed, eager):
            assert torch.equal(a, b), f"replay {splits} {name} differs from eager"
