"""The `custom_grouped` tier: the whole expert FFN as one fused autograd op.

Shape suffixes: see te_mixtral/__init__.py.

On CUDA it runs `te_mixtral.experts.kernels.grouped_swiglu`: Triton kernels that schedule their
tiles from `tokens_per_expert_L` on the device, fuse SwiGLU into the GEMM epilogues and
never synchronise with the host (read that module's docstring for the design). Without
CUDA it runs the same function through `torch.nn.functional.grouped_mm`, so CPU runs and
CI exercise the tier's interface; that path is also the reference the GPU path is
measured against in `benchmarks/custom_grouped_bench.py`.

Under `torch.autocast` on CUDA the activations are cast to the autocast dtype and the
(fp32 master) weights are cast inside the op; gradients come back in each input's dtype.

With LoRA and `lora.base nf4` the frozen expert weights are held in NF4 alone
(quant/frozen_nf4.py) and multiplied in BF16 on tensor cores: any GPU from Ampere (sm_80) on,
so the whole Mixtral-8x7B fits on the GPUs most people rent. With few rows per expert the
kernels dequantise each weight tile as they read it; with many, each weight is dequantised
whole into a transient BF16 copy before each GEMM that reads it (`dequantizes_whole`).
Elsewhere the grouped_mm path dequantises the weights whole first.
"""

import importlib.util
from dataclasses import replace
from functools import partial

import torch

from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.adapters import with_adapter, with_fused_adapters
from te_mixtral.experts.base import ExpertLoad, ExpertMemory, ExpertTier, swiglu
from te_mixtral.experts.grouped_mm import grouped_matmul, offsets
from te_mixtral.experts.quant.frozen_nf4 import FrozenNF4Weight

AMPERE = (8, 0)  # BF16 tensor cores: what the NF4 base is dequantised into
# An NF4 base is dequantised whole, one transient BF16 copy a GEMM, above this many rows per
# local expert (R / L, known on the host; kernels/nf4_decode.py says what each way costs). Up
# to it one row tile of the tables (128 rows, or a few-rows tile) holds an expert's rows, so
# the kernels decode each weight once per GEMM either way, and a whole copy only adds traffic
# (0.56 + 2 + 2 bytes a weight read or written, against 0.56). Above it they decode each
# weight again in every row tile, and that decoding, not the tensor cores, bounds them (the
# NF4 base's step at 2048 rows per expert: docs/results/2026-11-28-h200-lora-peers-nf4.md),
# where the whole pass is bound by memory bandwidth. Chosen by that reasoning; the boundary
# itself is not yet timed.
NF4_TILE_BY_TILE_UP_TO = 128

# The CUDA kernels keep SwiGLU's output inside the op, where the down adapter reads it.
DOWN_DROPOUT = ("tier custom_grouped's kernels apply no dropout to the down adapter's input (SwiGLU's output never "
                "leaves them): set lora.dropout 0, or leave down_proj out of lora.targets")


class CustomGroupedTier(ExpertTier):
    name = "custom_grouped"
    takes_adapters = True
    takes_padded_rows = True  # its kernels read the split sizes on the device and go no further
    frozen_bases = ("nf4",)

    def __init__(self, frozen_format: str = "default"):
        """`frozen_format` (the config's `lora.base`): how this tier holds expert weights the
        model asks for frozen (`expert_weight`): "default" as parameters, "nf4" in NF4."""
        self.frozen_format = frozen_format
        self.nf4_base = False  # whether the model's expert weights are this tier's frozen NF4 ones

    @classmethod
    def from_config(cls, cfg) -> "CustomGroupedTier":
        return cls(cfg.lora.base)

    @classmethod
    def check(cls, cfg) -> None:
        # Said when the config loads; the call itself refuses such adapters too (`_kernels`).
        if cfg.lora.dropout and "down_proj" in cfg.lora.expert_targets() and cfg.resolved_device() == "cuda":
            raise TierUnavailable(DOWN_DROPOUT)

    @classmethod
    def memory(cls, cfg, load: ExpertLoad) -> ExpertMemory:
        # The CUDA kernels keep gate_up's output alone and recompute the rest in the backward
        # (`recomputes_hidden`); the grouped_mm path elsewhere keeps what autograd keeps. An NF4
        # base is dequantised tile by tile inside the GEMMs, or with many rows per expert whole
        # into a transient copy (`dequantizes_whole`).
        memory = ExpertMemory.autograd(cfg.model.intermediate_size, load, fused=load.device == "cuda")
        if not (cfg.lora.enabled and cfg.lora.base == "nf4"):
            return memory
        D, F = cfg.model.hidden_size, cfg.model.intermediate_size
        if load.device == "cuda" and dequantizes_whole(load.rows, load.local_experts):
            # One transient copy at a time, made while a layer runs and never saved: gate_up's
            # [L, 2F, D], the larger, in the activations' dtype.
            memory = replace(memory, weight_copies=load.activation_bytes * load.local_experts * 2 * F * D)
        return memory.held_in(FrozenNF4Weight, load, D, F)

    def expert_weight(self, shape, frozen=False):
        if not (frozen and self.frozen_format == "nf4"):
            return super().expert_weight(shape)
        self.nf4_base = True
        return FrozenNF4Weight(shape)

    def describe(self) -> dict:
        return {"frozen_base": "nf4, dequantised in the grouped GEMMs"} if self.nf4_base else {}

    def sync_free(self) -> bool:
        return True  # the kernels read the split sizes on the device (kernels/grouped_swiglu.py)

    def check_available(self, device: torch.device) -> None:
        if torch.device(device).type != "cuda":
            return  # the grouped_mm path runs anywhere
        if importlib.util.find_spec("triton") is None:
            raise TierUnavailable(
                "tier custom_grouped needs Triton on CUDA; pip install triton, "
                "or choose tier grouped_linear or loop"
            )
        capability = torch.cuda.get_device_capability(device) if self.frozen_format == "nf4" else AMPERE
        if tuple(capability) < AMPERE:
            raise TierUnavailable(f"lora.base nf4 dequantises into BF16 tensor cores, which need an Ampere GPU "
                                  f"(sm_80) or later; this one is sm_{capability[0]}{capability[1]}")

    def __call__(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
        if not x_RD.is_cuda:
            return grouped_mm_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters)
        return self._kernels(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, True, adapters)

    def recomputes_hidden(self, x_RD) -> bool:
        return x_RD.is_cuda

    def recompute_hidden(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
        """Selective recompute inside the op: its backward runs the gate_up GEMM again, not
        the down projection, whose output the backward does not need (a checkpoint of the
        whole op would run both). With adapters, the gate_up adapter's delta is made again
        from its rank-r factors (`with_fused_adapters`)."""
        return self._kernels(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, False, adapters)

    @staticmethod
    def _kernels(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, keep_hidden, adapters):
        if adapters is not None and adapters.down is not None and adapters.dropout:
            raise TierUnavailable(DOWN_DROPOUT)
        if torch.is_autocast_enabled("cuda"):
            x_RD = x_RD.to(torch.get_autocast_dtype("cuda"))
        whole = dequantizes_whole(x_RD.shape[0], tokens_per_expert_L.shape[0])
        return kernels_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters, keep_hidden, whole)


def dequantizes_whole(rows: int, local_experts: int) -> bool:
    """Whether the kernels dequantise an NF4 base whole before each GEMM (else tile by tile in
    their K loop): above `NF4_TILE_BY_TILE_UP_TO` rows per local expert on average. The
    memory estimate asks the same."""
    return rows > NF4_TILE_BY_TILE_UP_TO * max(local_experts, 1)


def kernels_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None, keep_hidden=True,
                   dequantize_whole=False):
    """The expert FFN through the Triton op (te_mixtral/experts/kernels/grouped_swiglu.py), with
    LoRA's adapters: the gate_up delta enters the first GEMM's epilogue, the down adapter's A
    is applied to act inside the op, and its B product is added here. Their small GEMMs are
    `F.grouped_mm` calls over the same device-side splits. `dequantize_whole`: an NF4 base's
    way (`dequantizes_whole`)."""
    from te_mixtral.experts.kernels.grouped_swiglu import grouped_swiglu

    op = partial(grouped_swiglu, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, keep_hidden=keep_hidden,
                 dequantize_whole=dequantize_whole)
    if adapters is None:
        return op()
    return with_fused_adapters(op, x_RD, offsets(tokens_per_expert_L), adapters, recompute=not keep_hidden)


def grouped_mm_swiglu(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
    """The expert FFN through `F.grouped_mm` (CPU or CUDA), differentiable by autograd, its
    adapters (if any) through the same grouped GEMM; a frozen NF4 base dequantised first."""
    if x_RD.shape[0] == 0:
        # grouped_mm's backward rejects zero rows; zeros that still reach every input give
        # the right (zero) gradients.
        weights = [gate_up_L2FD, down_LDF, *(adapters.tensors() if adapters else ())]
        return x_RD * 0 + 0 * sum(w.sum() for w in weights if isinstance(w, torch.Tensor)).to(x_RD.dtype)
    matmul = partial(grouped_matmul, offs_L=offsets(tokens_per_expert_L))
    dtype = x_RD.dtype
    act_RF = swiglu(with_adapter(matmul(x_RD, dense(gate_up_L2FD, dtype)), adapters, "gate_up", x_RD, matmul))
    y_RD = with_adapter(matmul(act_RF, dense(down_LDF, dtype)), adapters, "down", act_RF, matmul)
    return _ContiguousGrad.apply(y_RD)


def dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A stacked expert weight as a tensor in `dtype`: a frozen quantised base (an NF4 one)
    dequantised whole, as its kernels dequantise it tile by tile (the same numbers)."""
    return w.to(dtype) if isinstance(w, torch.Tensor) else w.dequantized(dtype)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's CPU
    backward rejects the stride-0 gradient that, e.g., `y.sum().backward()` produces."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy.contiguous()
