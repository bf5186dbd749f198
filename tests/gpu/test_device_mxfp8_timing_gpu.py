"""Timing of `device_mxfp8`'s `fp8-hopper` mode against bf16 `grouped_mm` at Mixtral-8x7B
expert shapes, printed, not asserted (see docs/results/2026-11-21-fp8-hopper-notes.md for the
numbers):

    TE_MIXTRAL_BENCH=1 pytest -s tests/gpu/test_device_mxfp8_timing_gpu.py
"""

import os
import statistics

import pytest
import torch

from te_mixtral.experts.custom_grouped import CustomGroupedTier, grouped_mm_swiglu
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier, _GemmsMLP
from te_mixtral.experts.quant.fp8_hopper import FP8HopperGemms
from te_mixtral.experts.quant.fp8_swiglu import FP8SwiGLUExperts
from te_mixtral.experts.quant.padding import pad_rows, padded_rows

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs a Hopper GPU (sm_90)"),
    pytest.mark.skipif(os.environ.get("TE_MIXTRAL_BENCH") != "1", reason="timing: set TE_MIXTRAL_BENCH=1"),
]

MIXTRAL_D, MIXTRAL_F, BENCH_EXPERTS = 4096, 14336, 4


def _median_ms(step, iters=10, warmup=3) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fp8_gemms_only(gemms, x, gate_up, down, counts):
    """The six FP8 GEMMs of one step on operands quantised beforehand: the floor."""
    padded = padded_rows(counts, x.shape[0], gemms.row_align, gemms.min_rows)
    x_QD, offs = pad_rows(x, padded), padded.offsets_L
    rows, cols = gemms.rows, gemms.columns
    h = torch.randn(padded.rows_Q, MIXTRAL_F, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(padded.rows_Q, 2 * MIXTRAL_F, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(padded.rows_Q, MIXTRAL_D, device="cuda", dtype=torch.bfloat16)
    calls = []
    for a, w in ((x_QD, gate_up), (h, down), (dy, down.transpose(-2, -1)), (dh, gate_up.transpose(-2, -1))):
        (a_q, a_s), (w_q, w_s) = rows(a), rows(w.contiguous())  # fprop and dgrad: 2-D x 3-D
        calls.append((a_q, w_q.transpose(-2, -1), a_s, w_s))
    for g, a in ((dy, h), (dh, x_QD)):  # wgrad: 2-D x 2-D
        (g_q, g_s), (a_q, a_s) = cols(g, offs), cols(a, offs)
        calls.append((g_q, a_q.t(), g_s, a_s))

    def step():
        for a, b, scale_a, scale_b in calls:
            gemms.gemm(a, b, scale_a, scale_b, offs)

    return step


@pytest.mark.parametrize("tokens_per_expert", [64, 512, 2048, 4096, 8192])
def test_timing_fp8_hopper_vs_bf16_grouped_mm(tokens_per_expert):
    """Forward + backward of the expert MLP at Mixtral-8x7B shapes, 4 local experts, equal
    splits, bf16 weights. 'bf16 grouped_mm' is the project's grouped_mm reference
    (`custom_grouped.grouped_mm_swiglu`). The fp8 rows include padding where the variant
    pads (the unfused ones, on torch._scaled_grouped_mm's terms), all quantisation
    (the weights' once per step, as with one micro-batch per step; 'later micro-batch'
    reuses them) and the SwiGLU; 'fp8 GEMMs only' is the six FP8 GEMMs on operands
    quantised beforehand."""
    torch.manual_seed(0)
    rows = BENCH_EXPERTS * tokens_per_expert
    x = torch.randn(rows, MIXTRAL_D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate_up = (torch.randn(BENCH_EXPERTS, 2 * MIXTRAL_F, MIXTRAL_D, device="cuda") * MIXTRAL_D**-0.5).bfloat16()
    down = (torch.randn(BENCH_EXPERTS, MIXTRAL_D, MIXTRAL_F, device="cuda") * MIXTRAL_F**-0.5).bfloat16()
    gate_up.requires_grad_(), down.requires_grad_()
    counts = torch.full((BENCH_EXPERTS,), tokens_per_expert, device="cuda", dtype=torch.int64)
    dy = torch.randn(rows, MIXTRAL_D, device="cuda", dtype=torch.bfloat16)

    step_optimizer = torch.optim.SGD([torch.zeros(1, device="cuda", requires_grad=True)], lr=0.0)

    def train_step(mlp, optimizer_step=True):
        """One micro-batch; `optimizer_step` ends it with an (empty) optimizer step, which
        makes the FP8 weights be quantised again, as they are once per training step."""
        def step():
            x.grad = gate_up.grad = down.grad = None
            mlp().backward(dy)
            if optimizer_step:
                step_optimizer.step()
        return step

    def tier(runner=None):
        tier = DeviceMXFP8Tier("fp8-hopper")
        tier.check_available(torch.device("cuda"))
        if runner is not None:
            tier._runner = runner
        return lambda: tier(x, counts, gate_up, down)

    triton_casts = FP8SwiGLUExperts().gemms  # the Triton casts, without the fused SwiGLU
    triton_casts = (triton_casts.rows, triton_casts.columns, triton_casts._quantize_weight)
    variants = {  # name -> a function that builds the step, so each holds memory only while timed
        "bf16 grouped_mm": lambda: train_step(lambda: grouped_mm_swiglu(x, counts, gate_up, down)),
        "custom_grouped (bf16)": lambda: train_step(lambda: CustomGroupedTier()(x, counts, gate_up, down)),
        "fp8-hopper tier": lambda: train_step(tier()),
        "fp8-hopper tier, later micro-batch": lambda: train_step(tier(), optimizer_step=False),
        "fp8 unfused SwiGLU": lambda: train_step(tier(_GemmsMLP(FP8HopperGemms(quantizers=triton_casts)))),
        "fp8 unfused, PyTorch casts": lambda: train_step(tier(_GemmsMLP(FP8HopperGemms()))),
        "fp8 GEMMs only": lambda: _fp8_gemms_only(
            FP8HopperGemms(quantizers=triton_casts), x.detach(), gate_up.detach(), down.detach(), counts
        ),
    }
    flops = 18 * rows * MIXTRAL_D * MIXTRAL_F  # 3 GEMMs per projection, 2 projections of 3RDF
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {BENCH_EXPERTS} experts x "
          f"{tokens_per_expert} tokens, D={MIXTRAL_D}, F={MIXTRAL_F}, fwd+bwd, median of 10")
    for name, build in variants.items():
        step = build()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = _median_ms(step)
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        print(f"  {name:30s} {ms:8.2f} ms  {flops / ms / 1e9:7.0f} TFLOP/s  peak {peak_gib:5.1f} GiB")
        del step
        torch.cuda.empty_cache()
