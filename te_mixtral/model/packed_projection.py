"""Several projections of the same rows in one GEMM each way, their weights kept apart.

Shape suffixes: see te_mixtral/__init__.py; N the projections' summed output features.

Attention's q, k and v read the same normalised rows. Three `Linear`s run three GEMMs in
the forward, three dgrads and three wgrads in the backward, and autograd adds the three
dgrads into the rows' gradient with two more passes over [T, D]. TE's example (its
`MultiheadAttention(fuse_qkv_params=True)`) runs one GEMM of the concatenated weight
instead, which with grouped-query attention also spares the thin k and v GEMMs (N = 1024 at
Mixtral's shapes). `packed_linear` does the same while every weight stays its own
parameter, under the name a Hugging Face checkpoint gives it (`q_proj.weight`, ...):

    forward   y_TN = x_TD @ cat(W_0, W_1, ...).T             one GEMM
    backward  dx_TD = dy_TN @ cat(W_0, W_1, ...)             one GEMM, nothing to add
              dW = dy_TN.T @ x_TD, split by rows into dW_0, dW_1, ...   one GEMM

and dx is rounded to the compute dtype once, where three dgrads and two adds round it five
times. What it costs in their place: the weights' concatenation in each direction (N x D),
and autograd's of the three outputs' gradients into dy (T x N), about the bytes the two adds
moved. The concatenated weight is a temporary, never kept between the two directions:
autograd through `F.linear(x, torch.cat(...))` would keep it for the backward, a copy of the
three weights per layer for the whole forward. TE's own route (its `Linear` with
`parameters_split`) would rename the parameters (`query_weight`, ...).

Under autocast the GEMMs run in the autocast dtype, as `F.linear`'s would; the weight
gradients come back in the parameters' own dtype (autograd casts them). A weight that needs
no gradient (LoRA's frozen base) gets no wgrad GEMM.
"""

import torch
import torch.nn.functional as F


class _PackedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, *weights)
        return F.linear(x_TD, torch.cat(weights))  # in the autocast dtype under autocast, as F.linear

    @staticmethod
    def backward(ctx, grad_y_TN: torch.Tensor):
        # In the output's dtype, which is the forward's compute dtype: the backward runs outside
        # autocast, and the weights and rows are kept as they came (fp32 weights under autocast).
        x_TD, *weights = ctx.saved_tensors
        dtype = grad_y_TN.dtype
        grad_x_TD = grad_y_TN @ torch.cat(weights).to(dtype) if ctx.needs_input_grad[0] else None
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[1:]):
            grad_w_ND = grad_y_TN.flatten(0, -2).t() @ x_TD.flatten(0, -2).to(dtype)
            grad_weights = list(grad_w_ND.split([w.shape[0] for w in weights]))
        return grad_x_TD, *grad_weights


def packed_linear(x: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
    """`F.linear(x, w)` for each weight (each [out_i, D]), computed by one GEMM each way:
    the outputs, views of one [..., sum(out_i)] tensor."""
    y = _PackedLinear.apply(x, *weights)
    return list(y.split([w.shape[0] for w in weights], dim=-1))
