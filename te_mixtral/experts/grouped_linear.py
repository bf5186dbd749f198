"""The `grouped_linear` tier: every local expert's GEMMs in one call to Transformer Engine.

Shape suffixes: see te_mixtral/__init__.py. In `_GroupedMatmul`, a GEMM that does
not know what it multiplies, N and I are its output and input width.

The expert FFN is two grouped GEMMs with SwiGLU between:

    h_R2F = x_RD @ gate_up_L2FD[e].T   for each expert e's rows   (grouped GEMM 1)
    a_RF  = silu(h_R2F[:, :F]) * h_R2F[:, F:]                      (plain PyTorch)
    y_RD  = a_RF @ down_LDF[e].T       for each expert e's rows   (grouped GEMM 2)

Each grouped GEMM, forward and backward, is one call into TE instead of L calls from a
Python loop: y_i = x_i w_i^T forward, dx_i = dy_i w_i and dw_i = dy_i^T x_i backward.

Why an autograd Function around `general_grouped_gemm`, and not `te.GroupedLinear`
-------------------------------------------------------------------------------------
The expert weights are parameters of the model, stacked [L, N, I], shared by every tier so
that a checkpoint trained with one tier loads into any other. `te.GroupedLinear` (and the
fusible `te.ops.GroupedLinear`) create and own their weights: L parameters `weight0..`, or
with `single_grouped_weight=True` one TE `GroupedTensor`. Running them over the model's
tensors would mean reaching into the module: popping its `_parameters`, or assigning
`.data`, which silently detaches the model's weights from autograd (the pitfall TE's own
Mixtral tutorial warns about). Instead this module calls the function those modules call
for BF16 themselves, `transformer_engine.pytorch.cpp_extensions.general_grouped_gemm`,
which takes the weights as arguments, and owns the backward in a small autograd Function
with the same three GEMM layouts TE's `GroupedLinear` uses (TN forward, NN dgrad, NT
wgrad). Autograd sees ordinary tensors in and out, so the model's parameters get ordinary
`.grad`s.

The cost of this choice: `general_grouped_gemm` is exported by TE's `cpp_extensions`
module but is not part of TE's documented API, and its signature has changed before (TE
2.11 added `quantization_params`; releases up to 2.8 also took `workspaces`). Hence the
version floor below, and `tests/gpu/test_grouped_linear_gpu.py` to catch the next change.

What runs on the GPU: on Hopper with cuBLASLt older than 13.4, this is TE's multi-stream
cuBLAS grouped GEMM (one cuBLAS GEMM per expert, spread over several streams), the same
kernels `te.GroupedLinear` runs for BF16 on such a machine: over the same weights and
splits, outputs and all gradients came out bitwise equal to `te.GroupedLinear`'s, and no
slower (a one-off check on an H100, docs/results/2026-11-21-checks-behind-tolerances.md).

Precision: the training loop runs the forward under `torch.autocast("cuda", bfloat16)` with
fp32 master weights. Autocast does not reach into TE, so this tier casts x and both stacked
weights to the autocast dtype itself, with ordinary `.to()` calls outside the Function:
autograd then casts the bf16 weight gradients back to fp32 on the way to the parameters,
exactly as autocast does for `F.linear`. Without autocast, everything runs in x's dtype.
Only unquantized GEMMs (BF16, FP16, FP32) are done here; FP8 recipes belong to other tiers.

Host sync: TE's grouped GEMM needs the split sizes as Python ints (given a CUDA tensor, TE
copies it to the host itself on Hopper with cuBLASLt < 13.4), so each call does
`tokens_per_expert_L.tolist()` once, one device-to-host sync per layer forward, and both
GEMMs and the backward reuse that list.
"""

import functools

import torch

from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.adapters import with_adapter
from te_mixtral.experts.base import ExpertTier, swiglu
from te_mixtral.te_support import TEUnavailable, require_te

# `general_grouped_gemm(A, B, out, quantization_params, out_dtype, layout=..., m_splits=...,
# grad=..., single_output=...)` has had this signature since TE 2.11 (read in the 2.11, 2.12 and
# 2.20.2 wheels); 2.10 has no `quantization_params`, 2.4 to 2.8 also take `workspaces`.
# Tested on 2.20.2.
MIN_TE_VERSION = "2.11"


@functools.cache
def _general_grouped_gemm():
    require_te(MIN_TE_VERSION)
    from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm

    return general_grouped_gemm


class _GroupedMatmul(torch.autograd.Function):
    """y_RN = x_RI @ w_LNI[e].T for each expert e's rows, forward and backward through TE."""

    @staticmethod
    def forward(ctx, x_RI: torch.Tensor, w_LNI: torch.Tensor, m_splits: list[int]):
        ctx.save_for_backward(x_RI, w_LNI)
        ctx.m_splits = m_splits
        num_experts, n, _ = w_LNI.shape
        y_RN = torch.empty(x_RI.shape[0], n, dtype=x_RI.dtype, device=x_RI.device)
        if x_RI.shape[0] > 0:  # TE is never asked for a grouped GEMM with no rows at all
            _general_grouped_gemm()(
                list(w_LNI.unbind(0)),
                list(x_RI.split(m_splits)),
                [y_RN],
                quantization_params=[None] * num_experts,
                out_dtype=x_RI.dtype,
                layout="TN",
                m_splits=m_splits,
                single_output=True,
            )
        return y_RN

    @staticmethod
    def backward(ctx, dy_RN: torch.Tensor):
        x_RI, w_LNI = ctx.saved_tensors
        m_splits = ctx.m_splits
        num_experts = w_LNI.shape[0]
        grouped_gemm = _general_grouped_gemm() if x_RI.shape[0] > 0 else None
        dy_splits = list(dy_RN.contiguous().split(m_splits))
        dx_RI = dw_LNI = None
        if ctx.needs_input_grad[0]:
            dx_RI = torch.empty_like(x_RI)
            if grouped_gemm is not None:
                grouped_gemm(
                    list(w_LNI.unbind(0)),
                    dy_splits,
                    [dx_RI],
                    quantization_params=[None] * num_experts,
                    out_dtype=x_RI.dtype,
                    layout="NN",
                    m_splits=m_splits,
                    grad=True,
                    single_output=True,
                )
        if ctx.needs_input_grad[1]:
            if grouped_gemm is None:
                dw_LNI = torch.zeros_like(w_LNI)
            else:
                # TE writes zeros for an expert with no rows (accumulate=False), so
                # `empty` is safe; tests/gpu checks those gradients are exactly zero.
                dw_LNI = torch.empty_like(w_LNI)
                grouped_gemm(
                    list(x_RI.split(m_splits)),
                    dy_splits,
                    list(dw_LNI.unbind(0)),
                    quantization_params=[None] * num_experts,
                    out_dtype=w_LNI.dtype,
                    layout="NT",
                    m_splits=m_splits,
                    grad=True,
                )
        return dx_RI, dw_LNI, None


class GroupedLinearTier(ExpertTier):
    name = "grouped_linear"

    def check_available(self, device: torch.device) -> None:
        device = torch.device(device)
        reason = None
        if device.type != "cuda":
            reason = f"the device is {device.type}"
        elif not torch.cuda.is_available():
            reason = f"CUDA is not available to torch {torch.__version__}"
        else:
            try:
                require_te(MIN_TE_VERSION)
            except TEUnavailable as error:
                reason = error.reason
        if reason is not None:
            raise TierUnavailable(
                f"tier '{self.name}' needs NVIDIA Transformer Engine on a CUDA GPU: {reason}"
            )

    takes_adapters = True

    def __call__(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
        m_splits = tokens_per_expert_L.tolist()  # the one host sync, see the module docstring
        if len(m_splits) != gate_up_L2FD.shape[0] or sum(m_splits) != x_RD.shape[0]:
            raise ValueError(
                f"tokens_per_expert_L {m_splits} does not match {gate_up_L2FD.shape[0]} "
                f"experts and {x_RD.shape[0]} rows"
            )
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x_RD.dtype
        x_RD = x_RD.to(dtype).contiguous()
        # Differentiable casts, outside the Function: fp32 master weights get fp32 grads.
        gate_up_L2FD = gate_up_L2FD.to(dtype).contiguous()
        down_LDF = down_LDF.to(dtype).contiguous()
        return te_grouped_swiglu(x_RD, m_splits, gate_up_L2FD, down_LDF, adapters)


def te_grouped_swiglu(x_RD, m_splits: list[int], gate_up_L2FD, down_LDF, adapters=None):
    """The expert FFN through TE's grouped GEMM, all inputs in one dtype, the split sizes
    already on the host: the tier's work after its sync (benchmarks call it directly). The
    adapters' GEMMs are TE grouped GEMMs over the same splits."""
    def matmul(x_RI, w_LNI):
        return _GroupedMatmul.apply(x_RI, w_LNI.contiguous(), m_splits)

    with torch.autocast("cuda", enabled=False):  # keep autocast from recasting the SwiGLU
        a_RF = swiglu(with_adapter(matmul(x_RD, gate_up_L2FD), adapters, "gate_up", x_RD, matmul))
        return with_adapter(matmul(a_RF, down_LDF), adapters, "down", a_RF, matmul)
