"""The router's own losses: Mixtral's load-balancing loss and ST-MoE's router z-loss.

Shape suffixes: see te_mixtral/__init__.py (Y the MoE layers, A the tokens of the whole
global batch).

Load-balancing loss, as transformers computes it for Mixtral
-------------------------------------------------------------
transformers' `load_balancing_loss_func` (Switch Transformer, eq. 4-6) pools the router
outputs of *all* layers as if they were one long list of Y * A tokens:

    f_e = (top-k picks of expert e, all layers and tokens) / (Y * A)     no gradient
    p_e = (router probability of e, summed over all layers and tokens) / (Y * A)
    aux = E * sum_e f_e * p_e

f sums to K and p to 1, so a perfectly even router scores K; the gradient reaches the
router through p only. Pooling over layers is transformers' choice, kept here: expert e of
layer 0 and expert e of layer 1 share one f_e and one p_e, although they are unrelated
experts; a per-layer imbalance that other layers happen to offset is not penalised.
The loss is added to the training loss as `model.router_aux_loss_coef * aux`.

Padding and packed batches. transformers takes the attention mask and leaves padding out
of both sums and of A. A packed batch (te_mixtral/data/packing.py) has no padding: every
token is real text that every layer routes, the eos tokens with label -100 included (they
carry no LM loss, but they are routed like any token, and a padded batch's attention mask
counts them too). So a packed batch computes the per-token statistics over all its tokens,
which is transformers' value for the same documents padded with their attention mask, or
for an unpadded batch. How tokens are grouped into samples never matters: the sums run
over tokens.

Many ranks. transformers computes over the batch it is handed; here the batch is every
rank's tokens. f needs the global counts: one all-reduce of the [Y, E] counts (and the token
count) per forward, taken after the layers, so not once per layer. p is a sum over tokens,
so each rank's share

    aux_r = E * sum_e f_e * (this rank's probability sums_e) / (Y * A)

adds up over ranks to the global aux, and its gradient is the global aux's gradient through
this rank's tokens. Every rank's loss is already its share of the global loss, with the
gradients summed over ranks (te_mixtral/distributed/layout.py), so adding aux_r to this
rank's loss gives each rank's router exactly the single-process gradient, with no
collective inside autograd (torch.distributed.nn's all_reduce of p would give the same
gradient at the price of one more all-reduce in the backward).

Gradient accumulation. transformers computes the loss per forward. Each micro-batch here
computes its own aux over its global micro-batch (every rank's share of it), and the
training loop adds aux / `train.grad_accum_steps`: a step's aux is the mean of its
micro-batches', as a Hugging Face Trainer accumulating gradients computes it. Pooling the
counts of a whole step is impossible: a micro-batch's backward runs before the next one
has routed.

Router z-loss (ST-MoE, Zoph et al. 2022)
----------------------------------------
    z = mean over tokens of logsumexp(router logits)^2

keeps the router's logits small, where the softmax is least sensitive to rounding. Mixtral
was not trained with it (transformers' Mixtral has none); it is pooled over the layers as the
load-balancing loss is (a mean over Y * A), as transformers' Switch Transformers computes it
over the concatenated layers. Coefficient `model.router_z_loss_coef`, off by default.
"""

from dataclasses import dataclass

import torch

from te_mixtral.config import ModelConfig
from te_mixtral.distributed.layout import Layout, all_reduce_sum


@dataclass
class RouterStats:
    """One forward's routing on this rank, per MoE layer: what both losses and the expert
    load are computed from."""

    tokens_per_expert_YE: torch.Tensor  # int64: top-k picks of each expert (no gradient)
    prob_sum_YE: torch.Tensor  # float32: router probabilities summed over this rank's tokens
    z_sum_Y: torch.Tensor  # float32: logsumexp(router logits)^2 summed over this rank's tokens
    num_tokens: int  # tokens on this rank: every layer routes all of them

    @classmethod
    def of_layer(cls, logits_TE: torch.Tensor, probs_TE: torch.Tensor, experts_TK: torch.Tensor,
                 z_loss_grad: bool = True) -> "RouterStats":
        """One layer's statistics (Y = 1), from its float32 router logits, their softmax and
        the top-k it picked. Without `z_loss_grad` the z-loss sum is a statistic only, with no
        gradient: its backward would keep the logits for nothing."""
        picks = experts_TK.reshape(1, -1)
        # scatter_add, not bincount: bincount waits for the GPU to learn its output size.
        tokens_per_expert_1E = torch.zeros(1, probs_TE.shape[-1], dtype=torch.int64, device=picks.device)
        tokens_per_expert_1E.scatter_add_(1, picks, torch.ones_like(picks))
        with torch.set_grad_enabled(z_loss_grad and torch.is_grad_enabled()):
            z_sum_1 = logits_TE.logsumexp(-1).square().sum().reshape(1)
        return cls(tokens_per_expert_1E, probs_TE.sum(0, keepdim=True), z_sum_1, logits_TE.shape[0])

    @classmethod
    def cat(cls, layers: list["RouterStats"]) -> "RouterStats":
        """The layers' statistics stacked in layer order."""
        return cls(torch.cat([s.tokens_per_expert_YE for s in layers]), torch.cat([s.prob_sum_YE for s in layers]),
                   torch.cat([s.z_sum_Y for s in layers]), layers[0].num_tokens)


@dataclass
class RouterLosses:
    """This rank's shares of the global batch's router losses (the shares sum over ranks to
    the single-process values), and the global expert load."""

    aux: torch.Tensor  # load-balancing loss, float32 scalar
    z: torch.Tensor  # router z-loss, float32 scalar
    tokens_per_expert_YE: torch.Tensor  # int64: every rank's top-k picks, summed

    def weighted(self, m: ModelConfig) -> torch.Tensor | float:
        """What the training loss adds: each loss times its coefficient (a zero coefficient
        adds nothing, not even a zero gradient)."""
        terms = [(m.aux_loss_coef, self.aux), (m.router_z_loss_coef, self.z)]
        return sum(coef * loss for coef, loss in terms if coef)


def router_losses(stats: RouterStats, layout: Layout) -> RouterLosses:
    """Both losses of one forward (see the module docstring); all-reduces the counts over
    the world, so every rank calls it at the same point."""
    layers, num_experts = stats.tokens_per_expert_YE.shape
    totals = torch.cat([stats.tokens_per_expert_YE.flatten(),
                        stats.tokens_per_expert_YE.new_tensor([stats.num_tokens])])
    all_reduce_sum(totals, layout)
    tokens_per_expert_YE, rows = totals[:-1].view(layers, num_experts), layers * totals[-1]
    f_E = tokens_per_expert_YE.sum(0).float() / rows
    p_E = stats.prob_sum_YE.sum(0) / rows
    return RouterLosses(num_experts * (f_E * p_E).sum(), stats.z_sum_Y.sum() / rows, tokens_per_expert_YE)
