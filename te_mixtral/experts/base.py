"""The one interface every expert-FFN tier implements.

Shape legend: R rows (token copies routed to this rank, sorted by local expert),
D model dim, F expert hidden dim, E local experts.

A tier computes, for every local expert e and the rows routed to it,

    y = (silu(x @ gate_e.T) * (x @ up_e.T)) @ down_e.T

where `gate_up_E2FD[e]` stacks gate (first F rows) over up (last F rows), exactly as
Hugging Face transformers v5 stores `MixtralExperts.gate_up_proj`. All tiers read the same
two stacked parameters, so a checkpoint trained with one tier loads into any other.

Rows arrive sorted by expert: rows [0, n_0) belong to expert 0, the next n_1 to expert 1,
and so on, with `tokens_per_expert_E` = (n_0, ..., n_{E-1}) an int64 tensor on the rows'
device. Experts with zero rows, and R == 0, are valid inputs.
"""

from typing import Protocol

import torch
import torch.nn.functional as F


def swiglu(gate_up_RF2: torch.Tensor) -> torch.Tensor:
    """The activation every tier applies between its two GEMMs: silu(gate) * up."""
    gate_RF, up_RF = gate_up_RF2.chunk(2, dim=-1)
    return F.silu(gate_RF) * up_RF


class ExpertTier(Protocol):
    name: str

    def check_available(self, device: torch.device) -> None:
        """Raise `TierUnavailable` with a one-line reason if this tier cannot run here."""

    def __call__(
        self,
        x_RD: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        gate_up_E2FD: torch.Tensor,
        down_EDF: torch.Tensor,
    ) -> torch.Tensor:
        """Return y_RD, differentiable with respect to x and both weights."""
        ...
