"""A grouped linear layer, and the expert SwiGLU MLP built from two, whose GEMMs come from a
low-precision recipe.

Shape suffixes: see te_mixtral/__init__.py. G groups are the L local experts.

A linear layer's training step is three GEMMs, and each reduces over a different dim:

    fprop   y_QN   = x_QI  @ w_GNI^T    per group, over I
    dgrad   dx_QI  = dy_QN @ w_GNI      per group, over N
    wgrad   dw_GNI = dy_QN^T @ x_QI     per group, over the group's rows

Scaled low-precision formats attach their scales along the reduction dim, so each GEMM
quantises its own operands: x is quantised along I for fprop and along rows for wgrad, w
along I for fprop and along N for dgrad, dy along N for dgrad and along rows for wgrad.
That is why a recipe is a set of three GEMMs (`GroupedGemms`) rather than one quantise
function, and why this is a custom autograd Function: autograd of a quantise-then-matmul
graph would reuse the forward's quantised operands in backward, scaled along the wrong dim.

The gradient is straight-through: backward treats the quantisation as the identity and
returns the gradient of the unquantised product, computed with the recipe's dgrad and
wgrad GEMMs. The weight reaches fprop and dgrad in the form `gemms.weight(w)` returns,
made in the forward and kept for the backward (a recipe may quantise it there, once per
optimizer step); forward saves x in its own precision and backward quantises it again
along its rows for wgrad.

The recipes: `mxfp8.MXFP8EmulatedGemms` (MXFP8 numerics on any device) and
`fp8_hopper.FP8HopperGemms` (FP8 tensor cores on sm_90).
"""

from typing import Any, Protocol

import torch

from te_mixtral.experts.base import swiglu


class GroupedGemms(Protocol):
    """The three GEMMs of a grouped linear layer in one precision recipe.

    `offsets_G` is int32, the running end of each group's rows (`torch.nn.functional.
    grouped_mm`'s `offs`); every group's row count is a multiple of `row_align` and at
    least `min_rows`.
    """

    recipe: str
    kernel: str
    row_align: int
    min_rows: int

    def weight(self, w_GNI: torch.Tensor) -> Any:
        """The weight as fprop and dgrad take it (the recipe's own form, e.g. quantised)."""

    def fprop(self, x_QI: torch.Tensor, weight: Any, offsets_G: torch.Tensor) -> torch.Tensor: ...

    def dgrad(self, dy_QN: torch.Tensor, weight: Any, offsets_G: torch.Tensor) -> torch.Tensor: ...

    def wgrad(self, dy_QN: torch.Tensor, x_QI: torch.Tensor, offsets_G: torch.Tensor) -> torch.Tensor: ...


class _ScaledGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_QI, w_GNI, offsets_G, gemms):
        # The recipe picks every operand's precision itself; an outer autocast must not
        # recast them. Grad mode is off in here: the recipe's tensors need no graph.
        with torch.autocast(x_QI.device.type, enabled=False):
            weight = gemms.weight(w_GNI)
            y_QN = gemms.fprop(x_QI.detach(), weight, offsets_G).to(x_QI.dtype)
        ctx.save_for_backward(x_QI, offsets_G)
        ctx.gemms, ctx.weight, ctx.w_dtype = gemms, weight, w_GNI.dtype
        return y_QN

    @staticmethod
    def backward(ctx, dy_QN):
        x_QI, offsets_G = (t.detach() for t in ctx.saved_tensors)
        dy_QN = dy_QN.contiguous()  # autograd may hand over a broadcast view
        dx_QI = dw_GNI = None
        with torch.autocast(dy_QN.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx_QI = ctx.gemms.dgrad(dy_QN, ctx.weight, offsets_G).to(x_QI.dtype)
            if ctx.needs_input_grad[1]:
                dw_GNI = ctx.gemms.wgrad(dy_QN, x_QI, offsets_G).to(ctx.w_dtype)
        return dx_QI, dw_GNI, None, None


def scaled_grouped_linear(x_QI, w_GNI, offsets_G, gemms: GroupedGemms) -> torch.Tensor:
    """y_QN = x_QI @ w_GNI[g]^T for each group g's rows, every GEMM in `gemms`' recipe."""
    return _ScaledGroupedLinear.apply(x_QI, w_GNI, offsets_G, gemms)


def scaled_grouped_swiglu(x_QD, offsets_L, gate_up_L2FD, down_LDF, gemms: GroupedGemms) -> torch.Tensor:
    """The expert MLP of `experts/base.py` on padded rows: both projections low precision,
    the SwiGLU between them in the activations' dtype."""
    h_QF = swiglu(scaled_grouped_linear(x_QD, gate_up_L2FD, offsets_L, gemms))
    return scaled_grouped_linear(h_QF, down_LDF, offsets_L, gemms)
