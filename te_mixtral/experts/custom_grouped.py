"""The `custom_grouped` tier: the whole expert FFN as one fused autograd op.

Shape suffixes: see te_mixtral/experts/base.py.

On CUDA it runs `te_mixtral.experts.kernels.grouped_swiglu`: Triton kernels that schedule their
tiles from `tokens_per_expert_L` on the device, fuse SwiGLU into the GEMM epilogues and
never synchronise with the host (read that module's docstring for the design). Without
CUDA it runs the same function through `torch.nn.functional.grouped_mm`, so CPU runs and
CI exercise the tier's interface; that path is also the reference the GPU path is
measured against in `benchmarks/custom_grouped_bench.py`.

Under `torch.autocast` on CUDA the activations are cast to the autocast dtype and the
(fp32 master) weights are cast inside the op; gradients come back in each input's dtype.
"""

import importlib.util
from functools import partial

import torch
import torch.nn.functional as F

from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.adapters import with_adapter
from te_mixtral.experts.base import ExpertTier, swiglu


class CustomGroupedTier(ExpertTier):
    name = "custom_grouped"

    def check_available(self, device: torch.device) -> None:
        if torch.device(device).type != "cuda":
            return  # the grouped_mm path runs anywhere
        if importlib.util.find_spec("triton") is None:
            raise TierUnavailable(
                "tier custom_grouped needs Triton on CUDA; pip install triton, "
                "or choose tier grouped_linear or loop"
            )

    def __call__(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
        if not x_RD.is_cuda:
            return grouped_mm_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters)
        return self._kernels(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, keep_hidden=True)

    def recomputes_hidden(self, x_RD) -> bool:
        return x_RD.is_cuda

    def recompute_hidden(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF):
        """Selective recompute inside the op: its backward runs the gate_up GEMM again, not
        the down projection, whose output the backward does not need (a checkpoint of the
        whole op would run both)."""
        return self._kernels(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, keep_hidden=False)

    @staticmethod
    def _kernels(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, keep_hidden):
        from te_mixtral.experts.kernels.grouped_swiglu import grouped_swiglu

        if torch.is_autocast_enabled("cuda"):
            x_RD = x_RD.to(torch.get_autocast_dtype("cuda"))
        return grouped_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, keep_hidden=keep_hidden)


def grouped_mm_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
    """The expert FFN through `F.grouped_mm` (CPU or CUDA), differentiable by autograd, its
    adapters (if any) through the same grouped GEMM."""
    if x_RD.shape[0] == 0:
        # grouped_mm's backward rejects zero rows; zeros that still reach every input give
        # the right (zero) gradients.
        weights = [gate_up_L2FD, down_LDF, *(adapters.tensors() if adapters else ())]
        return x_RD * 0 + 0 * sum(w.sum() for w in weights).to(x_RD.dtype)
    matmul = partial(grouped_matmul, offs_L=torch.cumsum(tokens_per_expert_L, 0, dtype=torch.int32))
    dtype = x_RD.dtype
    act_RF = swiglu(with_adapter(matmul(x_RD, gate_up_L2FD.to(dtype)), adapters, "gate_up", x_RD, matmul))
    y_RD = with_adapter(matmul(act_RF, down_LDF.to(dtype)), adapters, "down", act_RF, matmul)
    return _ContiguousGrad.apply(y_RD)


def grouped_matmul(x_RI, w_LNI, offs_L):
    """x_RI @ w_LNI[e].T over each expert e's rows, by `F.grouped_mm`, which wants int32
    cumulative row ends as offsets and 16-byte aligned row strides: an odd I or N is
    zero-padded (padding that contributes exactly zero), a no-op for real model shapes."""
    align = max(1, 16 // x_RI.element_size())
    n = w_LNI.shape[1]
    pad_i, pad_n = -x_RI.shape[1] % align, -n % align
    if pad_i:
        x_RI, w_LNI = F.pad(x_RI, (0, pad_i)), F.pad(w_LNI, (0, pad_i))
    if pad_n:
        w_LNI = F.pad(w_LNI, (0, 0, 0, pad_n))
    y_RN = F.grouped_mm(x_RI, w_LNI.transpose(-2, -1), offs=offs_L)
    return y_RN[:, :n] if pad_n else y_RN


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's CPU
    backward rejects the stride-0 gradient that, e.g., `y.sum().backward()` produces."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy.contiguous()
