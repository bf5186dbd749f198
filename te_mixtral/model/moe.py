"""The sparse MoE block: route, dispatch, run the expert tier, combine.

Shape suffixes: see te_mixtral/__init__.py.

Routing is Hugging Face Mixtral's, step for step: router logits, softmax in float32,
top-k, renormalise the k weights to sum to one. The block never looks at which tier it
runs: the tier is any `ExpertTier` and sees only sorted rows and per-expert counts.

The block returns its routing statistics with its output (`RouterStats`: per-expert picks,
summed probabilities, the z-loss sum), from which the model computes the router's losses
and the expert load (te_mixtral/model/router_losses.py). They travel as a return value, not
as state the block records, so that a layer run again by a full recompute cannot count
them twice.

With `recompute_experts` (train.recompute selective) the tier's forward runs again in the
backward instead of keeping its hidden rows; routing and dispatch run once (see
te_mixtral/model/recompute.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from te_mixtral.distributed.dispatch import DispatchOutput, TokenDispatcher
from te_mixtral.experts.base import ExpertTier
from te_mixtral.model.lora import expert_adapters
from te_mixtral.model.recompute import recomputed
from te_mixtral.model.router_losses import RouterStats


class StackedExperts(nn.Module):
    """This rank's experts, stored stacked (gate_up [L, 2F, D], down [L, D, F]): the one
    parameter layout every tier reads; in the storage `tier` keeps them in (a parameter
    unless the tier holds a `frozen` base its own way: ExpertTier.expert_weight)."""

    def __init__(self, experts_per_rank: int, hidden_size: int, intermediate_size: int, tier: ExpertTier,
                 frozen: bool = False):
        super().__init__()
        self.gate_up_proj = tier.expert_weight((experts_per_rank, 2 * intermediate_size, hidden_size), frozen)
        self.down_proj = tier.expert_weight((experts_per_rank, hidden_size, intermediate_size), frozen)
        self.adapters = nn.ModuleDict()  # LoRA's, by stacked weight name (model/lora.py); empty without

    def forward(self, tier: ExpertTier, x_RD: torch.Tensor, tokens_per_expert_L: torch.Tensor,
                keep_hidden: bool = True) -> torch.Tensor:
        """`tier` over these experts (`keep_hidden=False`: the tier's own selective recompute).
        A forward of their own, so that FSDP, which shards the experts apart from the dense
        weights (distributed/parallelize.py), gathers them here."""
        run = tier if keep_hidden else tier.recompute_hidden
        adapters = expert_adapters(self.adapters, self.training) if self.adapters else None
        return run(x_RD, tokens_per_expert_L, self.gate_up_proj, self.down_proj, adapters)


class MoEBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 dispatcher: TokenDispatcher, tier: ExpertTier, experts_per_rank: int,
                 recompute_experts: bool = False, z_loss_grad: bool = False, frozen_base: bool = False):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = StackedExperts(experts_per_rank, hidden_size, intermediate_size, tier, frozen_base)
        self.dispatcher = dispatcher
        self.tier = tier
        self.recompute_experts = recompute_experts
        # The z-loss keeps the router logits for its backward: only when it trains (coef > 0).
        self.z_loss_grad = z_loss_grad

    # The four steps of `forward`, public so that measure/phases.py can time each one alone
    # on the very code the model runs.

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        """Each token's top-k experts and their weights (summing to one), both [T, K]; and
        the layer's routing statistics."""
        logits_TE = self.gate(x_TD).float()
        probs_TE = F.softmax(logits_TE, dim=-1)
        weights_TK, experts_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        stats = RouterStats.of_layer(logits_TE, probs_TE, experts_TK, self.z_loss_grad)
        return weights_TK / weights_TK.sum(-1, keepdim=True), experts_TK, stats

    def dispatch(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor) -> DispatchOutput:
        """Send each token's k copies to the ranks of their experts, sorted by local expert."""
        return self.dispatcher.dispatch(self._travelling(x_TD), experts_TK, weights_TK)

    @staticmethod
    def _travelling(x_TD: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x_TD.device.type):
            # The experts compute in the autocast dtype anyway; casting before dispatch
            # halves the bytes the all-to-all moves.
            return x_TD.to(torch.get_autocast_dtype(x_TD.device.type))
        return x_TD

    def run_experts(self, x_RD: torch.Tensor, tokens_per_expert_L: torch.Tensor) -> torch.Tensor:
        """The expert tier over this rank's sorted rows: [R, D] in, [R, D] out."""
        inputs = (self.tier, x_RD, tokens_per_expert_L)
        if not self.recompute_experts:
            return self.experts(*inputs)
        if self.tier.recomputes_hidden(x_RD):
            return self.experts(*inputs, keep_hidden=False)
        return recomputed(self.experts, *inputs)

    def combine(self, y_RD: torch.Tensor, routed: DispatchOutput) -> torch.Tensor:
        """Send the rows back to their tokens and sum each token's k outputs, weighted: [T, D]."""
        return self.dispatcher.combine(y_RD, routed)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        weights_TK, experts_TK, stats = self.route(x_TD)
        # dispatch, run_experts and combine, the exchanges of one chunk of tokens under the
        # experts of another where the dispatcher overlaps them (distributed/dispatch.py).
        y_TD = self.dispatcher.run(self._travelling(x_TD), experts_TK, weights_TK, self.run_experts)
        return y_TD.view_as(x_BSD), stats
