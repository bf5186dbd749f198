"""What a tier receives of LoRA: the low-rank adapters of this rank's experts.

Shape suffixes: see te_mixtral/__init__.py; r is the adapter rank.

With adapters, each expert's two projections become

    h_R2F = x_RD @ gate_up_L2FD[e].T + s * (x_RD @ A_gu[e].T) @ B_gu[e].T
    y_RD  = act_RF @ down_LDF[e].T  + s * (act_RF @ A_d[e].T) @ B_d[e].T

with A_gu [L, r, D], B_gu [L, 2F, r], A_d [L, r, F], B_d [L, D, r] (PEFT's layout of one
adapter per expert on a stacked weight; te_mixtral/model/lora.py holds them). A tier adds
each delta where its own GEMM produces the base term, and computes the delta with its own
grouped GEMM (`matmul` below: per expert, over that expert's rows), so the adapters run in
the same grouped calls as the base, never in a Python loop over experts on the GPU path
(the `loop` tier excepted: it is the reference).

The base weights are frozen (`requires_grad` False), so a tier must not spend a GEMM on
their gradients: the backward of a frozen stack is dgrad only.
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from te_mixtral.experts.grouped_mm import grouped_matmul

# (x_RI, w_LNI) -> y_RN = x_RI @ w_LNI[e].T over each expert e's rows.
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertAdapters:
    """The adapters of one MoE layer's local experts, for one call of a tier."""

    gate_up: tuple[torch.Tensor, torch.Tensor] | None  # (A_LrD, B_L2Fr), or None: not adapted
    down: tuple[torch.Tensor, torch.Tensor] | None  # (A_LrF, B_LDr), or None
    scale: float  # alpha / r (alpha / sqrt(r) with rsLoRA)
    dropout: float  # on the adapter's input, while training; 0 otherwise

    def tensors(self) -> list[torch.Tensor]:
        return [w for pair in (self.gate_up, self.down) if pair is not None for w in pair]

    def factors(self, projection: str, x_RI: torch.Tensor, matmul: GroupedMatmul):
        """(t_Rr, B_LNr): t = dropout(x) @ A[e].T per expert and B, both in x's dtype, whose
        product the delta scales; None where `projection` ("gate_up" or "down") has no adapter."""
        pair = getattr(self, projection)
        if pair is None:
            return None
        a_LrI, b_LNr = (w.to(x_RI.dtype) for w in pair)
        if self.dropout:
            x_RI = F.dropout(x_RI, self.dropout)
        return matmul(x_RI, a_LrI), b_LNr

    def delta(self, projection: str, x_RI: torch.Tensor, matmul: GroupedMatmul) -> torch.Tensor | None:
        """s * (dropout(x) @ A[e].T) @ B[e].T per expert, in x's dtype; None where `projection`
        has no adapter."""
        factors = self.factors(projection, x_RI, matmul)
        return None if factors is None else matmul(*factors) * self.scale


def with_adapter(base_RN: torch.Tensor, adapters: ExpertAdapters | None, projection: str, x_RI: torch.Tensor,
                 matmul: GroupedMatmul) -> torch.Tensor:
    """`base_RN`, the projection's base output for the rows `x_RI`, plus its adapter's delta
    where it has one."""
    delta = None if adapters is None else adapters.delta(projection, x_RI, matmul)
    return base_RN if delta is None else base_RN + delta


def with_fused_adapters(op: Callable, x_RD: torch.Tensor, offs_L: torch.Tensor, adapters: ExpertAdapters,
                        recompute: bool = False):
    """The expert FFN of a fused op that takes LoRA's adapters inside, with their deltas.

    `op(h_add_R2F=..., a_down_LrF=...)` adds `h_add_R2F`, the gate_up adapter's delta, to the
    pre-activations, and given the down adapter's A (in x's dtype) returns (y_RD, u_Rr) with
    u = act @ A[e].T, act being the SwiGLU output that only exists inside the op; B's product
    is added here. The small GEMMs are grouped over the experts' rows (`offs_L`, grouped_mm's
    offsets). With `recompute` (an op that keeps no hidden rows) the op also gets the delta's
    rank-r factors and scale (`h_add_factors`), to make the delta again in its backward
    rather than keep it."""
    matmul = partial(grouped_matmul, offs_L=offs_L)
    options = {}
    factors = adapters.factors("gate_up", x_RD, matmul)
    if factors is not None:
        options["h_add_R2F"] = matmul(*factors) * adapters.scale
        if recompute:
            options["h_add_factors"] = (*(t.detach() for t in factors), adapters.scale)
    if adapters.down is None:
        return op(**options)
    a_LrF, b_LDr = (w.to(x_RD.dtype) for w in adapters.down)
    y_RD, u_Rr = op(**options, a_down_LrF=a_LrF)
    return y_RD + matmul(u_Rr, b_LDr) * adapters.scale
