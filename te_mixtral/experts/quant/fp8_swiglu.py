"""The expert SwiGLU MLP in FP8 on Hopper, with the SwiGLU fused into the FP8 casts: what
the `device_mxfp8` tier runs in mode `fp8-hopper`.

Shape suffixes: see te_mixtral/experts/base.py (Q the rows as the tier passes them, here
unpadded with the package's kernels: see `row_align` below).

The same six GEMMs as `scaled_grouped.scaled_grouped_swiglu` with `FP8HopperGemms` (that
composition stays as the readable reference, and the CPU tests run it), with these
differences, each one fewer pass over a [Q, F] or [Q, 2F] tensor:

    forward   gu = x @ gate_up^T           x cast row-wise; gate_up's FP8 copies cached
              y  = silu(gate) * up @ down^T the SwiGLU computed inside the row-wise cast
                                           of its output (fp8_cast, swiglu=True): h is
                                           never written
    backward  dh = dy @ down                dy cast row-wise
              d(down) = dy^T @ h per expert h re-created inside its column-wise cast
              d(gu) from dh and gu          one kernel writes d(gu) and its row-wise cast
              dx = d(gu) @ gate_up
              d(gate_up) = d(gu)^T @ x per expert

Saved for the backward: x and gu (in their own dtypes) and the weights' FP8 copies, where
autograd through the unfused composition also keeps h, silu(gate) and the SwiGLU's inputs.
"""

from functools import partial

import torch

from te_mixtral.experts.kernels import scaled_grouped_mm as triton_gemms
from te_mixtral.experts.quant import fp8_cast
from te_mixtral.experts.quant.fp8_hopper import FP8HopperGemms


class FP8SwiGLUExperts:
    """The `fp8-hopper` runner: `mlp` on the tier's rows, and what the tier reports.

    The GEMMs are `kernels/scaled_grouped_mm.py`'s unless `scaled_grouped_mm` names another
    function with its arguments (a test's float64 stand-in). `value_dtype` float32 (with a
    float32 `out_dtype`) runs the same kernels and data flow with unrounded values, so a CPU
    test can check the wiring against the unquantised MLP to float32 rounding.
    """

    def __init__(self, scaled_grouped_mm=None, value_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16):
        self.rows = partial(fp8_cast.quantize_rows, out_dtype=value_dtype)
        self.columns = partial(fp8_cast.quantize_columns, out_dtype=value_dtype)
        self.swiglu_backward_rows = partial(fp8_cast.swiglu_backward_rows, out_dtype=value_dtype)
        weight = partial(fp8_cast.quantize_weight, out_dtype=value_dtype)
        self.gemms = FP8HopperGemms(scaled_grouped_mm or triton_gemms.scaled_grouped_mm,
                                    (self.rows, self.columns, weight), out_dtype,
                                    kernel=None if scaled_grouped_mm else triton_gemms.KERNEL)
        self.recipe = self.gemms.recipe
        # Our kernels take any split (an expert's rows may start anywhere, or be none), so the
        # tier pads nothing for them; another kernel gets torch._scaled_grouped_mm's padding.
        self.row_align, self.min_rows = (self.gemms.row_align, self.gemms.min_rows) if scaled_grouped_mm else (1, 0)

    @property
    def kernel(self) -> str:
        return f"{self.gemms.kernel}; SwiGLU fused into the FP8 casts (Triton)"

    def mlp(self, x_QD, padded, gate_up_L2FD, down_LDF):
        return _FP8SwiGLU.apply(x_QD, gate_up_L2FD, down_LDF, padded.offsets_L, self)


class _FP8SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_QD, gate_up_L2FD, down_LDF, offsets_L, experts):
        gemms = experts.gemms
        with torch.autocast(x_QD.device.type, enabled=False):  # the recipe picks every precision
            gate_up, down = gemms.weight(gate_up_L2FD), gemms.weight(down_LDF)
            gu_Q2F = gemms.fprop(x_QD.detach(), gate_up, offsets_L)
            y_QD = gemms.fprop_quantised(*experts.rows(gu_Q2F, swiglu=True), down, offsets_L)
        ctx.save_for_backward(x_QD, gu_Q2F, offsets_L)
        ctx.experts, ctx.weights = experts, (gate_up, down)
        ctx.dtypes = (x_QD.dtype, gate_up_L2FD.dtype, down_LDF.dtype)
        return y_QD.to(x_QD.dtype)

    @staticmethod
    def backward(ctx, dy_QD):
        x_QD, gu_Q2F, offsets_L = (t.detach() for t in ctx.saved_tensors)
        experts, (gate_up, down) = ctx.experts, ctx.weights
        gemms, (x_dtype, gate_up_dtype, down_dtype) = experts.gemms, ctx.dtypes
        dy_QD = dy_QD.contiguous()  # autograd may hand over a broadcast view
        dx = d_gate_up = d_down = None
        with torch.autocast(dy_QD.device.type, enabled=False):
            dh_QF = gemms.dgrad(dy_QD, down, offsets_L)
            if ctx.needs_input_grad[2]:
                d_down = gemms.wgrad_quantised(*experts.columns(dy_QD, offsets_L),
                                               *experts.columns(gu_Q2F, offsets_L, swiglu=True),
                                               offsets_L).to(down_dtype)
            dgu_Q2F, dgu_q, dgu_scale = experts.swiglu_backward_rows(dh_QF.contiguous(), gu_Q2F)
            del dh_QF  # freed before the weight gradient's casts, as is d(gu)'s row-wise copy
            if ctx.needs_input_grad[0]:
                dx = gemms.dgrad_quantised(dgu_q, dgu_scale, gate_up, offsets_L).to(x_dtype)
            del dgu_q
            if ctx.needs_input_grad[1]:
                d_gate_up = gemms.wgrad(dgu_Q2F, x_QD, offsets_L).to(gate_up_dtype)
        return dx, d_gate_up, d_down, None, None
