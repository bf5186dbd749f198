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

import torch
import torch.nn.functional as F

from te_mixtral.errors import TierUnavailable
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

    def __call__(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF):
        if not x_RD.is_cuda:
            return grouped_mm_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF)
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


def grouped_mm_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF):
    """The expert FFN through `F.grouped_mm` (CPU or CUDA), differentiable by autograd.

    grouped_mm wants int32 cumulative row ends as offsets and 16-byte aligned row strides;
    odd D or F are zero-padded (padding that contributes exactly zero), a no-op for real
    model shapes.
    """
    if x_RD.shape[0] == 0:
        # grouped_mm's backward rejects zero rows; zeros that still reach every input give
        # the right (zero) gradients.
        return x_RD * 0 + 0 * (gate_up_L2FD.sum() + down_LDF.sum()).to(x_RD.dtype)
    dtype = x_RD.dtype
    D, F2 = x_RD.shape[1], gate_up_L2FD.shape[1]
    align = max(1, 16 // x_RD.element_size())
    pad_d, pad_f = -D % align, -(F2 // 2) % align
    offs_L = torch.cumsum(tokens_per_expert_L, 0, dtype=torch.int32)

    w1_L2FD, w2_LDF = gate_up_L2FD.to(dtype), down_LDF.to(dtype)
    if pad_d or pad_f:
        gate_LFD, up_LFD = w1_L2FD.chunk(2, dim=1)
        w1_L2FD = torch.cat([F.pad(gate_LFD, (0, pad_d, 0, pad_f)),
                             F.pad(up_LFD, (0, pad_d, 0, pad_f))], dim=1)
        w2_LDF = F.pad(w2_LDF, (0, pad_f, 0, pad_d))
        x_RD = F.pad(x_RD, (0, pad_d))

    act_RF = swiglu(F.grouped_mm(x_RD, w1_L2FD.transpose(-2, -1), offs=offs_L))
    y_RD = F.grouped_mm(act_RF, w2_LDF.transpose(-2, -1), offs=offs_L)
    return _ContiguousGrad.apply(y_RD[:, :D] if pad_d else y_RD)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's CPU
    backward rejects the stride-0 gradient that, e.g., `y.sum().backward()` produces."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy.contiguous()
