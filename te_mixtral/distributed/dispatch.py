"""Token dispatch: send each routed token copy to the rank that owns its expert, and back.

Shape suffixes: see te_mixtral/__init__.py (here L = E / P).

One MoE layer does

    permute  : the T*K token copies, sorted by global expert (so by destination rank)
    exchange : all_to_all_single with uneven splits; rows arrive grouped by source rank,
               then by local expert within each source
    regroup  : reorder the received rows by local expert, the row order every tier expects
    ... the expert tier runs on x_RD ...
    and the inverse of each step, then a weighted sum of each token's K expert outputs.

The only host synchronisation is the split sizes all_to_all_single needs on the host; a
single-rank group skips the exchange entirely and stays sync-free.

The permute and its inverse with the weighted sum (`LocalPermute`) come in two kinds that
give the same rows in the same order: `TorchPermute` in plain PyTorch (a stable argsort and
a gather; a scatter, an fp32 product and a sum back), and on the Transformer Engine
backend TE's fused `moe_permute` / `moe_unpermute` (te_permute.py), which undo the sort and
merge each token's K weighted rows in one kernel each way.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass
class DispatchOutput:
    x_RD: torch.Tensor  # rows for the local experts, sorted by local expert
    tokens_per_expert_L: torch.Tensor  # int64, on the rows' device
    # What `combine` needs to undo the dispatch:
    unsort: object  # the local permute's record of the sort (TorchPermute: the order of the copies)
    weights_TK: torch.Tensor  # routing weights, float32
    regroup_R: torch.Tensor | None  # received row order -> local-expert order (None: no exchange)
    send_splits: list[int] | None
    recv_splits: list[int] | None


class LocalPermute(Protocol):
    def sort(self, x_TD: torch.Tensor, experts_TK: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Each token's K copies sorted by global expert, stably (a token's copies in token
        order within each expert), [T*K, D]; and what `unsort` needs."""
        ...

    def unsort(self, y_sorted: torch.Tensor, unsort: object, weights_TK: torch.Tensor) -> torch.Tensor:
        """The inverse of `sort`, each token's K rows weighted (in float32) and summed: [T, D]."""
        ...


class TorchPermute:
    def sort(self, x_TD, experts_TK):
        # Stable sort keeps a token's copies in token order within each expert, so every
        # run routes rows identically (the same seed gives the same per-expert row order).
        order_TK = torch.argsort(experts_TK.flatten(), stable=True)
        return x_TD[order_TK // experts_TK.shape[1]], order_TK

    def unsort(self, y_sorted, order_TK, weights_TK):
        num_copies, top_k = weights_TK.numel(), weights_TK.shape[1]
        # Un-sort: row i of y_sorted is token copy order_TK[i].
        y_copies = torch.empty_like(y_sorted)
        y_copies[order_TK] = y_sorted
        # Weight in float32 like Hugging Face does, then sum each token's K copies.
        weighted = y_copies.float() * weights_TK.reshape(num_copies, 1)
        return weighted.view(num_copies // top_k, top_k, -1).sum(1).to(y_sorted.dtype)


class TokenDispatcher(Protocol):
    def dispatch(self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor) -> DispatchOutput: ...

    def combine(self, y_RD: torch.Tensor, state: DispatchOutput) -> torch.Tensor: ...


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        send_splits, recv_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(send_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), send_splits, recv_splits, group=ctx.group)
        return grad_in, None, None, None


class AllToAllDispatcher:
    """Expert-parallel dispatch over an EP group; with one rank it is a local permutation."""

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, group: dist.ProcessGroup | None,
                 permute: LocalPermute | None = None):
        self.permute = permute or TorchPermute()
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.experts_per_rank = num_experts // ep_size
        self.first_local_expert = ep_rank * self.experts_per_rank
        self.group = group

    def dispatch(self, x_TD, experts_TK, weights_TK) -> DispatchOutput:
        x_sorted, unsort = self.permute.sort(x_TD, experts_TK)
        tokens_per_expert_E = torch.bincount(experts_TK.flatten(), minlength=self.num_experts)
        if self.ep_size == 1:  # one rank holds every expert: L == E
            return DispatchOutput(x_sorted, tokens_per_expert_E, unsort, weights_TK, None, None, None)

        # Each rank learns how many rows it receives for each local expert from each source.
        recv_counts_PL = torch.empty_like(tokens_per_expert_E)
        dist.all_to_all_single(recv_counts_PL, tokens_per_expert_E, group=self.group)
        recv_counts_PL = recv_counts_PL.view(self.ep_size, self.experts_per_rank)
        send_splits = tokens_per_expert_E.view(self.ep_size, self.experts_per_rank).sum(1).tolist()
        recv_splits = recv_counts_PL.sum(1).tolist()
        x_recv = _AllToAll.apply(x_sorted, send_splits, recv_splits, self.group)

        local_expert_R = torch.repeat_interleave(
            torch.arange(self.experts_per_rank, device=x_TD.device).repeat(self.ep_size), recv_counts_PL.flatten()
        )
        regroup_R = torch.argsort(local_expert_R, stable=True)
        return DispatchOutput(
            x_recv[regroup_R], recv_counts_PL.sum(0), unsort, weights_TK, regroup_R, send_splits, recv_splits
        )

    def combine(self, y_RD, state: DispatchOutput) -> torch.Tensor:
        if state.regroup_R is not None:
            y_recv = torch.empty_like(y_RD)
            y_recv[state.regroup_R] = y_RD
            y_RD = _AllToAll.apply(y_recv, state.recv_splits, state.send_splits, self.group)
        return self.permute.unsort(y_RD, state.unsort, state.weights_TK)
