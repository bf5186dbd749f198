"""Token dispatch: send each routed token copy to the rank that owns its expert, and back.

Shape suffixes: see te_mixtral/__init__.py (here L = E / P, C = the chunks of a layer's tokens).

One MoE layer does

    permute  : the T*K token copies, sorted by global expert (so by destination rank; by
               slot where the experts are placed by load: distributed/placement.py)
    exchange : all_to_all_single with uneven splits; rows arrive grouped by source rank,
               then by local expert within each source
    regroup  : reorder the received rows by local expert, the row order every tier expects
    ... the expert tier runs on x_RD ...
    and the inverse of each step, then a weighted sum of each token's K expert outputs.

Communication under compute (`run`, with `chunks` > 1). The layer's tokens are cut into C
contiguous chunks and every chunk's exchange is launched at once (asynchronously, on the
process group's own stream); the experts of chunk c start as soon as its rows arrive, while
the rows of chunk c+1 are still travelling, and chunk c's outputs travel back while chunk
c+1's experts run. The backward mirrors it: each exchange is a pair of autograd nodes, a
start and a wait, and the autograd engine runs nodes made later first, so the reverse
exchange of one chunk is launched before, and waited for after, the expert backward of its
neighbour. A token's K rows stay within its chunk, so chunking changes no token's result,
only the order of rows inside the tier (equal to rounding; tests/distributed/test_ep_gradients.py).

Only the first chunk's dispatch and the last chunk's return would then be exposed, where the
GPU runs NCCL's kernels beside the experts. On H200s it does not: our persistent grouped
GEMMs hold every SM until they end, so the exchanges wait for gaps between kernels, and
chunking only adds launches and smaller GEMMs (docs/parallelism.md). `chunks` defaults to 1.

Host synchronisation. all_to_all_single needs the split sizes on the host: every layer's
forward waits once for the GPU to deliver them (all chunks' counts travel in one exchange and
come back in one copy). The backward reuses them and never waits. A single-rank group skips
the exchange entirely and stays sync-free.

Padded exchange (`capacity` > 0): no wait at all. Each rank sends every other rank a block of
exactly `capacity` x its even share of rows (T*K / P, rounded up), its rows for that rank
first and zeros after, so every split is known on the host before the layer runs; the
receiver puts the rows it got in local-expert order on the device, and the tier runs over
P blocks' worth of rows, of which the counts on the device say how many are real
(`ExpertTier.takes_padded_rows`). It costs the padding's bytes on the wire and in the
tier's rows, about what the busiest rank holds anyway. The results are exact only if no
rank sends any rank more than a block: rows past a full block are dropped, and each
dispatcher records the largest share it was asked to send (`needed`); the training loop
reads it with the step's losses, once a step, and runs a step whose share outgrew the
capacity again with a larger one (training/loop.py), so no such step is ever applied.

The permute and its inverse with the weighted sum (`LocalPermute`) come in two kinds that
give the same rows in the same order: `TorchPermute` in plain PyTorch (a stable argsort and
a gather; a scatter, an fp32 product and a sum back), and on the Transformer Engine
backend TE's fused `moe_permute` / `moe_unpermute` (te_permute.py), which undo the sort and
merge each token's K weighted rows in one kernel each way.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class DispatchOutput:
    x_RD: torch.Tensor  # rows for the local experts, sorted by local expert (in flight until `arrive`)
    tokens_per_expert_L: torch.Tensor  # int64, on the rows' device
    # What `combine` needs to undo the dispatch:
    unsort: object  # the local permute's record of the sort (TorchPermute: the order of the copies)
    weights_TK: torch.Tensor  # routing weights, float32
    regroup_R: torch.Tensor | None  # received row order -> local-expert order (None: no exchange)
    send_splits: list[int] | None
    recv_splits: list[int] | None
    exchange: "_Exchange | None" = None  # the rows' exchange while in flight
    # Padded exchange: the row of the blocks each copy's output comes back in ([T*K]; for a copy
    # that did not fit, the last of its destination's block), and each received row's place
    # among the tier's rows ([P*C], a permutation: the padding after the real rows).
    # `regroup_R` is then its inverse, once the rows have arrived.
    back_TK: torch.Tensor | None = None
    place_Q: torch.Tensor | None = None


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


ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x_RD, tokens_per_expert_L) -> y_RD


class TokenDispatcher(Protocol):
    def dispatch(self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor) -> DispatchOutput: ...

    def combine(self, y_RD: torch.Tensor, state: DispatchOutput) -> torch.Tensor: ...

    def run(self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor,
            experts: ExpertsFn) -> torch.Tensor:
        """dispatch, `experts`, combine: [T, D] in, [T, D] out."""
        ...


class _Exchange:
    """One all_to_all_single in flight, forward or backward: what its wait needs."""

    def __init__(self, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup):
        self.send_splits, self.recv_splits, self.group = send_splits, recv_splits, group
        self.work: dist.Work | None = None
        self.grad_in: torch.Tensor | None = None  # the backward's result, until _Start's backward takes it

    def launch(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        self.work = dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.group,
                                           async_op=True)
        return out

    def wait(self) -> None:
        self.work.wait()
        self.work = None


class _Start(torch.autograd.Function):
    """Launches the exchange and returns its (not yet filled) output; `_Wait` makes it valid.
    Backward: waits for the reverse exchange that `_Wait`'s backward launched, and returns
    its result (the gradient arriving here is only the token that orders the two nodes)."""

    @staticmethod
    def forward(ctx, x, exchange: _Exchange):
        ctx.exchange = exchange
        return exchange.launch(x, exchange.send_splits, exchange.recv_splits)

    @staticmethod
    def backward(ctx, _token):
        exchange = ctx.exchange
        exchange.wait()
        grad_in, exchange.grad_in = exchange.grad_in, None
        return grad_in, None


class _Wait(torch.autograd.Function):
    """Waits for the exchange `_Start` launched. Backward: launches the reverse exchange of
    the gradient and returns at once, so that the nodes between this one and `_Start` (the
    experts of another chunk) run while it travels."""

    @staticmethod
    def forward(ctx, out, exchange: _Exchange):
        ctx.exchange = exchange
        exchange.wait()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        exchange = ctx.exchange
        exchange.grad_in = exchange.launch(grad_out, exchange.recv_splits, exchange.send_splits)
        return grad_out, None


class _DistinctRows(torch.autograd.Function):
    """`x.index_select(0, index)` for an `index` that picks no row twice, with a backward that
    scatters without atomics (autograd's index_add makes every padding row's zero gradient
    contend for one row): `inverse` given, `index` is a permutation and the backward is the
    inverse gather; else a copy into zeros."""

    @staticmethod
    def forward(ctx, x, index, inverse=None):
        ctx.save_for_backward(index, inverse)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        if inverse is not None:
            return grad.index_select(0, inverse), None, None
        return grad.new_zeros((ctx.rows, *grad.shape[1:])).index_copy_(0, index, grad), None, None


class AllToAllDispatcher:
    """Expert-parallel dispatch over an EP group; with one rank it is a local permutation.
    `chunks` > 1: `run` overlaps the exchanges with the experts (module docstring)."""

    def __init__(self, num_experts: int, ep_size: int, group: dist.ProcessGroup | None,
                 permute: LocalPermute | None = None, chunks: int = 1, capacity: float = 0.0,
                 slot_of_expert: list[int] | None = None):
        self.permute = permute or TorchPermute()
        # Each expert id's slot, where the experts are placed by load (distributed/placement.py):
        # the exchange sends a copy to the rank of its slot. None: slot = expert.
        self.slot_of_expert = None if slot_of_expert is None else torch.tensor(slot_of_expert, dtype=torch.int64)
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.experts_per_rank = num_experts // ep_size
        self.group = group
        self.chunks = chunks
        self.capacity = capacity  # 0: exact splits, learnt by the host; > 0: padded blocks (module docstring)
        self.needed: torch.Tensor | None = None  # the largest share sent to a rank since `take_needed`, on the device

    def take_needed(self) -> torch.Tensor | None:
        """The largest number of rows this dispatcher sent one rank, over its even share, in the
        calls since the last take (a float32 on the device; None if it padded nothing)."""
        needed, self.needed = self.needed, None
        return needed

    def dispatch(self, x_TD, experts_TK, weights_TK) -> DispatchOutput:
        (routed,) = self._start_dispatch(x_TD, experts_TK, weights_TK, chunks=1)
        return self._arrive(routed)

    def combine(self, y_RD, state: DispatchOutput) -> torch.Tensor:
        return self._finish_combine(self._start_combine(y_RD, state), state)

    def run(self, x_TD, experts_TK, weights_TK, experts: ExpertsFn) -> torch.Tensor:
        # One rank: nothing travels, nothing to hide. Never a chunk without tokens.
        chunks = min(self.chunks, x_TD.shape[0]) if self.ep_size > 1 else 1
        returning = []
        for routed in self._start_dispatch(x_TD, experts_TK, weights_TK, chunks):
            routed = self._arrive(routed)
            returning.append((self._start_combine(experts(routed.x_RD, routed.tokens_per_expert_L), routed), routed))
        return torch.cat([self._finish_combine(y, routed) for y, routed in returning])

    # --- the steps, each chunk's in order: start dispatch, arrive, (experts), start combine, finish

    def _start_dispatch(self, x_TD, experts_TK, weights_TK, chunks: int) -> list[DispatchOutput]:
        """Sort each chunk's copies and launch their exchanges; the rows are in flight."""
        if self.slot_of_expert is not None:
            if self.slot_of_expert.device != experts_TK.device:  # once: made where the model was
                self.slot_of_expert = self.slot_of_expert.to(experts_TK.device)
            experts_TK = self.slot_of_expert[experts_TK]
        pieces = list(zip(*(t.tensor_split(chunks) for t in (x_TD, experts_TK, weights_TK))))
        # Each chunk's copies per global expert, [C, E]. An index_add, not bincount, which
        # asks the GPU for the largest index first (a host sync).
        tokens_per_expert_CE = torch.stack([
            torch.zeros(self.num_experts, dtype=torch.int64, device=e.device).index_add_(
                0, e.flatten(), torch.ones(e.numel(), dtype=torch.int64, device=e.device))
            for _, e, _ in pieces])
        sorted_pieces = [self.permute.sort(x, e) for x, e, _ in pieces]
        if self.ep_size > 1 and self.capacity > 0:
            ((x_sorted, unsort),), ((_, _, weights),) = sorted_pieces, pieces
            return [self._start_padded(x_sorted, unsort, weights, tokens_per_expert_CE[0])]
        if self.ep_size == 1:  # one rank holds every expert: L == E
            return [DispatchOutput(x_sorted, tokens_per_expert_E, unsort, w, None, None, None)
                    for (x_sorted, unsort), tokens_per_expert_E, (_, _, w)
                    in zip(sorted_pieces, tokens_per_expert_CE, pieces)]

        # Each rank learns how many rows it receives for each local expert of each chunk from
        # each source: one exchange of counts for all chunks, then one copy to the host.
        P, C, L = self.ep_size, len(pieces), self.experts_per_rank
        send_counts_PCL = tokens_per_expert_CE.view(C, P, L).transpose(0, 1).contiguous()
        recv_counts_PCL = torch.empty_like(send_counts_PCL)
        dist.all_to_all_single(recv_counts_PCL, send_counts_PCL, group=self.group)
        splits = torch.cat([send_counts_PCL.sum(2), recv_counts_PCL.sum(2)]).T.tolist()  # [C][2P]
        local_expert = torch.arange(L, device=x_TD.device).repeat(P)
        routed = []
        for c, ((x_sorted, unsort), (_, _, weights), chunk_splits) in enumerate(zip(sorted_pieces, pieces, splits)):
            send_splits, recv_splits = chunk_splits[:P], chunk_splits[P:]
            exchange = _Exchange(send_splits, recv_splits, self.group)
            x_recv = _Start.apply(x_sorted, exchange)
            local_expert_R = torch.repeat_interleave(local_expert, recv_counts_PCL[:, c].flatten(),
                                                     output_size=sum(recv_splits))
            regroup_R = torch.argsort(local_expert_R, stable=True)
            routed.append(DispatchOutput(x_recv, recv_counts_PCL[:, c].sum(0), unsort, weights, regroup_R,
                                         send_splits, recv_splits, exchange))
        return routed

    @staticmethod
    def _arrive(routed: DispatchOutput) -> DispatchOutput:
        """Wait for the chunk's rows and put them in local-expert order."""
        if routed.exchange is None:
            return routed
        x_recv = _Wait.apply(routed.x_RD, routed.exchange)
        if routed.place_Q is not None:  # padded: the real rows by local expert, the padding after them
            gather_R = torch.empty_like(routed.place_Q)
            gather_R[routed.place_Q] = torch.arange(gather_R.shape[0], device=gather_R.device)
            routed.x_RD, routed.exchange = _DistinctRows.apply(x_recv, gather_R, routed.place_Q), None
            routed.regroup_R = gather_R  # for the way back
            return routed
        routed.x_RD, routed.exchange = x_recv[routed.regroup_R], None
        return routed

    def _start_combine(self, y_RD, state: DispatchOutput) -> torch.Tensor:
        """Launch the rows' way back (in flight until `_finish_combine`)."""
        if state.place_Q is not None:  # padded: each received row's output back to its place
            y_recv = _DistinctRows.apply(y_RD, state.place_Q, state.regroup_R)
        elif state.regroup_R is None:
            return y_RD
        else:
            y_recv = torch.empty_like(y_RD)
            y_recv[state.regroup_R] = y_RD
        state.exchange = _Exchange(state.recv_splits, state.send_splits, self.group)
        return _Start.apply(y_recv, state.exchange)

    def _finish_combine(self, y_sorted, state: DispatchOutput) -> torch.Tensor:
        """Wait for the rows to come back, then un-sort and sum each token's K outputs."""
        if state.exchange is not None:
            y_sorted = _Wait.apply(y_sorted, state.exchange)
            state.exchange = None
        if state.back_TK is not None:  # padded: each copy's row out of its block
            y_sorted = _DistinctRows.apply(y_sorted, state.back_TK)
        return self.permute.unsort(y_sorted, state.unsort, state.weights_TK)

    def _start_padded(self, x_sorted, unsort, weights_TK, tokens_per_expert_E) -> DispatchOutput:
        """Launch the padded exchange of one layer's sorted copies: P blocks of `block` rows
        each way, every split known on the host, every index made on the device."""
        P, L, device = self.ep_size, self.experts_per_rank, x_sorted.device
        copies = x_sorted.shape[0]
        block = max(1, math.ceil(self.capacity * copies / P))
        send_counts_PL = tokens_per_expert_E.view(P, L)
        recv_counts_PL = torch.empty_like(send_counts_PL)
        dist.all_to_all_single(recv_counts_PL, send_counts_PL, group=self.group)
        send_P = send_counts_PL.sum(1)
        share = send_P.max().float() * P / max(copies, 1)
        self.needed = share if self.needed is None else torch.maximum(self.needed, share)

        # The sorted copies go to their destination's block in order; those past a full block
        # to the spare row, which is never sent.
        destination_TK = torch.repeat_interleave(torch.arange(P, device=device), send_P, output_size=copies)
        place_TK = torch.arange(copies, device=device) - (send_P.cumsum(0) - send_P)[destination_TK]
        slot_TK = torch.where(place_TK < block, destination_TK * block + place_TK, P * block)
        send = x_sorted.new_zeros((P * block + 1, *x_sorted.shape[1:])).index_copy_(0, slot_TK, x_sorted)
        # On the way back a copy that did not fit takes the output of the last row of its
        # destination's block, a real row (the block is full), never a padding row, which the
        # tier may fill with anything: the step runs again, but this output still reaches the
        # next layers' routing, and so the capacity the step runs again at.
        back_TK = destination_TK * block + place_TK.clamp(max=block - 1)
        splits = [block] * P
        exchange = _Exchange(splits, splits, self.group)
        x_recv = _Start.apply(send[:P * block], exchange)

        # Received block p holds its rows by local expert, the first of them real: what fitted.
        # Among the tier's rows, expert l's come first from source 0, then 1, ...
        ends_PL = recv_counts_PL.cumsum(1).clamp(max=block)
        kept_PL = ends_PL - F.pad(ends_PL[:, :-1], (1, 0))
        starts_LP = (kept_PL.T.flatten().cumsum(0) - kept_PL.T.flatten()).view(L, P)
        within_Q = torch.arange(block, device=device).repeat(P)
        source_Q = torch.arange(P, device=device).repeat_interleave(block)
        expert_Q = torch.searchsorted(ends_PL, within_Q.view(P, block), right=True).flatten().clamp(max=L - 1)
        real_Q = within_Q < ends_PL[:, -1][source_Q]
        row_Q = starts_LP[expert_Q, source_Q] + within_Q - (ends_PL - kept_PL)[source_Q, expert_Q]
        padding_Q = kept_PL.sum() + (~real_Q).cumsum(0) - 1  # after every real row, in received order
        place_Q = torch.where(real_Q, row_Q, padding_Q)  # a permutation of the received rows
        return DispatchOutput(x_recv, kept_PL.sum(0), unsort, weights_TK, None, splits, splits, exchange,
                              back_TK, place_Q)
