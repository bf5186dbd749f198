"""The expert SwiGLU MLP in FP8 on Hopper, with the SwiGLU fused into the FP8 casts: what
the `device_mxfp8` tier runs in mode `fp8-hopper`.

Shape suffixes: see te_mixtral/__init__.py (Q the rows as the tier passes them, here
unpadded with the package's kernels: see `row_align` below).

The same six GEMMs as `scaled_grouped.scaled_grouped_swiglu` with `FP8HopperGemms` (that
composition stays as the readable reference, and the CPU tests run it), with fewer passes
over the [Q, F] and [Q, 2F] tensors:

    forward   gu = x @ gate_up^T           x cast row-wise; gate_up's FP8 copies cached
                                           (unless fp8.weight_cache is off)
              y  = silu(gate) * up @ down^T the SwiGLU computed inside the row-wise cast
                                           of its output (fp8_cast, swiglu=True): h is
                                           never written in bf16, its FP8 copy h_q is kept
    backward  dh = dy @ down                dy cast row-wise
              d(down) = dy^T @ h per expert h_q transposed, dy cast column-wise
              d(gu) from dh and gu          one kernel writes only d(gu)'s row-wise cast
              dx = d(gu) @ gate_up
              d(gate_up) = d(gu)^T @ x      d(gu)'s cast transposed, x cast column-wise

The weight gradients reuse the row-wise FP8 copies that the forward and dx already made
(transposed, one byte read and written per element) instead of casting h and d(gu)
column-wise (two reads of two bytes each). A row-wise copy carries one scale per row q,
which is the weight gradient's reduction dim, so it cannot go into the GEMM's epilogue;
it moves onto the other operand instead, exactly: sum_q a[q] b[q] = sum_q (a[q] s[q])
(b[q] / s[q]), and dy, x are cast column-wise after their rows are multiplied by s.
So here h and d(gu) are quantised along their rows in the weight gradients too, where
the reference quantises them along each expert's rows (columns): the same E4M3 rounding
with other scales, and the errors beside TE's recipes are in docs/precision.md.

Saved for the backward: x and gu (in their own dtypes), h_q with its row scales (one byte
per element of h), and the weights' FP8 copies in their dgrad orientation, where autograd
through the unfused composition keeps h, silu(gate) and the SwiGLU's inputs.

Over a frozen base (LoRA: `frozen_mlp`, the weights in FP8 alone, frozen_fp8.py) the same
forward runs with the adapters' deltas entering as they do in custom_grouped's op
(te_mixtral/experts/adapters.py): the gate_up adapter's delta is added to gu before the
SwiGLU cast (in the GEMM's epilogue), the down adapter reads act, which the SwiGLU cast
writes beside h_q. The backward is dgrad only: dy cast row-wise, dh with the down adapter's
share of d(act) added in the GEMM's epilogue, d(gu)'s row-wise cast as above, dx. Saved: gu,
and act where the down projection has an adapter (under selective recompute neither: x and the
delta's rank-r factors, gu and act made again, the down GEMM not); d(gu) reaches the gate_up
adapter unquantised, in x's dtype, written by the pass that casts it for the base's dgrad.
"""

from functools import partial

import torch

from te_mixtral.experts.adapters import ExpertAdapters, with_fused_adapters
from te_mixtral.experts.grouped_mm import grouped_matmul, grouped_wgrad
from te_mixtral.experts.kernels import scaled_grouped_mm as triton_gemms
from te_mixtral.experts.kernels.grad_accumulation import accumulation_target, hand_over
from te_mixtral.experts.quant import fp8_cast
from te_mixtral.experts.quant.fp8_hopper import FP8HopperGemms
from te_mixtral.experts.quant.frozen_fp8 import FrozenFP8Weight


class FP8SwiGLUExperts:
    """The `fp8-hopper` runner: `mlp` on the tier's rows, and what the tier reports.

    The GEMMs are `kernels/scaled_grouped_mm.py`'s unless `scaled_grouped_mm` names another
    function with its arguments (a test's float64 stand-in). `value_dtype` float32 (with a
    float32 `out_dtype`) runs the same kernels and data flow with unrounded values, so a CPU
    test can check the wiring against the unquantised MLP to float32 rounding.
    `cache_weights`: see `FP8HopperGemms.weight` (the config's `fp8.weight_cache`).
    """

    def __init__(self, scaled_grouped_mm=None, value_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16,
                 cache_weights=True):
        self.value_dtype = value_dtype  # also a frozen base's (device_mxfp8.expert_weight)
        self.rows = partial(fp8_cast.quantize_rows, out_dtype=value_dtype)
        self.columns = partial(fp8_cast.quantize_columns, out_dtype=value_dtype)
        self.swiglu_backward_rows = partial(fp8_cast.swiglu_backward_rows, out_dtype=value_dtype)
        self.transpose = fp8_cast.transpose
        self.requantize_transposed = fp8_cast.requantize_transposed
        weight = partial(fp8_cast.quantize_weight, out_dtype=value_dtype)
        self.gemms = FP8HopperGemms(scaled_grouped_mm or triton_gemms.scaled_grouped_mm,
                                    (self.rows, self.columns, weight), out_dtype,
                                    kernel=None if scaled_grouped_mm else triton_gemms.KERNEL,
                                    cache_weights=cache_weights, fuses_add=scaled_grouped_mm is None)
        self.recipe = self.gemms.recipe
        # Our kernels take any split (an expert's rows may start anywhere, or be none), so the
        # tier pads nothing for them; another kernel gets torch._scaled_grouped_mm's padding.
        self.row_align, self.min_rows = (self.gemms.row_align, self.gemms.min_rows) if scaled_grouped_mm else (1, 0)
        # Our wgrad kernel can add into a weight's .grad (kernels/grad_accumulation.py).
        self.adds_into_grad = scaled_grouped_mm is None

    @property
    def kernel(self) -> str:
        return f"{self.gemms.kernel}; SwiGLU fused into the FP8 casts (Triton)"

    @property
    def frozen_kernel(self) -> str:
        """`kernel` of `frozen_mlp`."""
        return (f"{self.gemms.gemm_kernel}; E4M3 in fprop and dgrad over a frozen base (LoRA): expert weights in FP8 "
                "alone, quantised once at load, every call in FP8, no weight gradient; SwiGLU fused into the FP8 "
                "casts (Triton)")

    def mlp(self, x_QD, padded, gate_up_L2FD, down_LDF):
        return _FP8SwiGLU.apply(x_QD, gate_up_L2FD, down_LDF, padded.offsets_L, self)

    def frozen_mlp(self, x_QD, padded, gate_up: FrozenFP8Weight, down: FrozenFP8Weight,
                   adapters: ExpertAdapters | None, keep_hidden: bool = True):
        """The MLP over a frozen FP8 base, with LoRA's adapters (if any). `keep_hidden=False`
        (selective recompute) keeps only x and the gate_up delta's rank-r factors: the
        backward makes gu (and act) again, but not y."""
        def op(h_add_R2F=None, a_down_LrF=None, h_add_factors=None):  # with_fused_adapters' names; rows here are Q
            return _FrozenFP8SwiGLU.apply(x_QD, h_add_R2F, a_down_LrF, padded.offsets_L, gate_up, down, self,
                                          keep_hidden, h_add_factors)
        if adapters is None:
            return op()
        return with_fused_adapters(op, x_QD, padded.offsets_L, adapters, recompute=not keep_hidden)


class _FP8SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_QD, gate_up_L2FD, down_LDF, offsets_L, experts):
        gemms = experts.gemms
        with torch.autocast(x_QD.device.type, enabled=False):  # the recipe picks every precision
            gate_up, down = gemms.weight(gate_up_L2FD), gemms.weight(down_LDF)
            gu_Q2F = gemms.fprop(x_QD.detach(), gate_up, offsets_L)
            h_q, h_scale_Q = experts.rows(gu_Q2F, swiglu=True)
            y_QD = gemms.fprop_quantised(h_q, h_scale_Q, down, offsets_L)
        # The backward reads each weight in its dgrad orientation only. Saved as tensors, not
        # on ctx, so that a recompute (torch's checkpoint) drops them with the rest and makes
        # them again: without the weight cache only the layer in flight holds them.
        ctx.save_for_backward(x_QD, gu_Q2F, h_q, h_scale_Q, offsets_L, *gate_up[1], *down[1])
        ctx.experts, ctx.parameters, ctx.x_dtype = experts, (gate_up_L2FD, down_LDF), x_QD.dtype
        return y_QD.to(x_QD.dtype)

    @staticmethod
    def backward(ctx, dy_QD):
        x_QD, gu_Q2F, h_q, h_scale_Q, offsets_L, *dgrad_weights = (t.detach() for t in ctx.saved_tensors)
        gate_up, down = (None, tuple(dgrad_weights[:2])), (None, tuple(dgrad_weights[2:]))
        experts, gemms = ctx.experts, ctx.experts.gemms
        dy_QD = dy_QD.contiguous()  # autograd may hand over a broadcast view
        dx = d_gate_up = d_down = None
        with torch.autocast(dy_QD.device.type, enabled=False):
            dh_QF = gemms.dgrad(dy_QD, down, offsets_L)
            if ctx.needs_input_grad[2]:
                d_down = _wgrad_from_rows(experts, ctx.parameters[1], dy_QD, h_q, h_scale_Q, offsets_L,
                                          rows_first=False)
            dgu_q, dgu_scale_Q = experts.swiglu_backward_rows(dh_QF.contiguous(), gu_Q2F)
            del dh_QF  # freed before dx's GEMM and the weight gradient's casts
            if ctx.needs_input_grad[0]:
                dx = gemms.dgrad_quantised(dgu_q, dgu_scale_Q, gate_up, offsets_L).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                d_gate_up = _wgrad_from_rows(experts, ctx.parameters[0], x_QD, dgu_q, dgu_scale_Q, offsets_L,
                                             rows_first=True)
        return dx, d_gate_up, d_down, None, None


class _FrozenFP8SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_QD, h_add_Q2F, a_down_LrF, offsets_L, gate_up, down, experts, keep_hidden, h_add_factors):
        gemms = experts.gemms
        with torch.autocast(x_QD.device.type, enabled=False):
            gu_Q2F, act_QF, h_q, h_scale_Q = _frozen_hidden(experts, x_QD.detach(), h_add_Q2F, a_down_LrF,
                                                            offsets_L, gate_up, down)
            y_QD = gemms.fprop_quantised(h_q, h_scale_Q, down.fprop_operand(), offsets_L).to(x_QD.dtype)
            del h_q
            outputs = (y_QD,)
            if act_QF is not None:
                outputs += (grouped_matmul(act_QF, a_down_LrF, offsets_L),)
        if keep_hidden:  # act is kept for the down adapter's gradient: a pass over gu saved in the backward
            ctx.save_for_backward(gu_Q2F, act_QF, offsets_L, a_down_LrF)
        else:
            t_Qr, b_L2Fr, ctx.h_add_scale = h_add_factors or (None, None, None)
            ctx.save_for_backward(x_QD, offsets_L, a_down_LrF, t_Qr, b_L2Fr)
        ctx.experts, ctx.weights, ctx.x_dtype, ctx.keep_hidden = experts, (gate_up, down), x_QD.dtype, keep_hidden
        return outputs if len(outputs) > 1 else y_QD

    @staticmethod
    def backward(ctx, dy_QD, du_Qr=None):
        experts, gemms = ctx.experts, ctx.experts.gemms
        gate_up, down = ctx.weights
        dtype = ctx.x_dtype
        saved = [None if t is None else t.detach() for t in ctx.saved_tensors]
        if ctx.keep_hidden:
            gu_Q2F, act_QF, offsets_L, a_down_LrF = saved
        else:  # gu and act again, from x and the delta made again as the caller made it (same bits)
            x_QD, offsets_L, a_down_LrF, t_Qr, b_L2Fr = saved
            h_add_Q2F = None if t_Qr is None else grouped_matmul(t_Qr, b_L2Fr, offsets_L) * ctx.h_add_scale
            with torch.autocast(dy_QD.device.type, enabled=False):
                gu_Q2F, act_QF, _, _ = _frozen_hidden(experts, x_QD, h_add_Q2F, a_down_LrF, offsets_L, gate_up, down)
            del h_add_Q2F
        dy_QD = dy_QD.contiguous()
        dx = d_h_add = d_a_down = down_share = None
        with torch.autocast(dy_QD.device.type, enabled=False):
            if a_down_LrF is not None and du_Qr is not None:
                du_Qr = du_Qr.to(dtype).contiguous()
                d_a_down = (grouped_wgrad(du_Qr, act_QF, offsets_L) if gu_Q2F.shape[0]
                            else torch.zeros_like(a_down_LrF))
                # The down adapter's share of d(act), added in the dgrad GEMM's epilogue.
                down_share = grouped_matmul(du_Qr, a_down_LrF.transpose(1, 2), offsets_L).contiguous()
            dh_QF = gemms.dgrad(dy_QD, down.dgrad_operand(experts.requantize_transposed), offsets_L, add=down_share)
            del down_share
            # The gate_up adapter's gradient, d(gu), comes out of the same pass as its FP8 copy.
            d_h_add = torch.empty_like(gu_Q2F, dtype=dtype) if ctx.needs_input_grad[1] else None
            dgu_q, dgu_scale_Q = experts.swiglu_backward_rows(dh_QF.contiguous(), gu_Q2F, grad_out_Q2F=d_h_add)
            del dh_QF
            if ctx.needs_input_grad[0]:
                dgrad_weight = gate_up.dgrad_operand(experts.requantize_transposed)
                dx = gemms.dgrad_quantised(dgu_q, dgu_scale_Q, dgrad_weight, offsets_L).to(dtype)
        return dx, d_h_add, d_a_down, None, None, None, None, None, None


def _frozen_hidden(experts, x_QD, h_add_Q2F, a_down_LrF, offsets_L, gate_up, down):
    """(gu, act, h_q, h_scale) of the frozen op: gu = x @ gate_up^T + the gate_up adapter's
    delta (added in the GEMM's epilogue, before gu's rounding), and the row-wise FP8 cast of
    SwiGLU(gu), which also writes act in x's dtype where the down adapter reads it (else None)."""
    gu_Q2F = experts.gemms.fprop(x_QD, gate_up.fprop_operand(), offsets_L, add=h_add_Q2F)
    act_QF = None if a_down_LrF is None else gu_Q2F.new_empty(gu_Q2F.shape[0], down.shape[-1], dtype=x_QD.dtype)
    h_q, h_scale_Q = experts.rows(gu_Q2F, swiglu=True, values_out=act_QF)
    return gu_Q2F, act_QF, h_q, h_scale_Q


def _wgrad_from_rows(experts, weight, other_QC, rows_q, rows_scale_Q, offsets_L, rows_first):
    """The gradient to return for `weight`: per expert rows_q^T @ other (rows_first) or
    other^T @ rows_q, where rows_q is an FP8 copy with one scale per row: that scale moves
    onto `other`, which is cast column-wise. Added into weight.grad where that is safe."""
    other_q, other_scale = experts.columns(other_QC, offsets_L, row_scale_Q=rows_scale_Q)
    rows_t = experts.transpose(rows_q)
    ones = torch.ones(offsets_L.numel() * rows_t.shape[0], dtype=torch.float32, device=rows_t.device)
    operands = (rows_t, ones, other_q, other_scale) if rows_first else (other_q, other_scale, rows_t, ones)
    into = accumulation_target(weight) if experts.adds_into_grad else None
    if into is None:
        return experts.gemms.wgrad_quantised(*operands, offsets_L).to(weight.dtype)
    return hand_over(weight, experts.gemms.wgrad_quantised(*operands, offsets_L, add_into=into))
