"""The `hf` baseline: Hugging Face `MixtralForCausalLM` as is, the whole model every tier is
measured against (te_mixtral/experts/registry.py lists it under `BASELINES`).

It runs in a single process with transformers' own attention (SDPA) and the experts
implementation a transformers user gets by default, `grouped_mm` (`torch.nn.functional.
grouped_mm` over the stacked expert weights; transformers falls back to a loop of per-expert
matmuls where the kernel cannot run, e.g. a GPU older than sm_80). Its per-expert Python loop,
`eager`, stays available as the run name `hf_eager` (te_mixtral/experts/registry.py).
It starts from the very weights our model would start from (same seed, same
initialisation, copied by name), so its losses are comparable step by step.
Packed documents: passing position_ids that restart at 0 makes transformers build a
document-separating causal mask itself.

Generation (training/generate.py) passes the cache `kv_cache` makes, transformers' own
`DynamicCache`.

Router losses: the forward asks transformers for its router logits and its own
load-balancing loss (`output_router_logits`), so an `hf` run trains with transformers' aux
loss, not ours, and a loss check against it compares like with like. The z-loss and the
expert load come from the same router logits through our `RouterStats` (transformers'
Mixtral has no z-loss).
"""

import dataclasses
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from te_mixtral.config import ModelConfig
from te_mixtral.distributed.layout import Layout
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.model.hf_config import hf_config
from te_mixtral.model.layers import PackedSequences
from te_mixtral.model.mixtral import causal_lm_loss
from te_mixtral.model.router_losses import RouterLosses, RouterStats, router_losses


class HFMixtral(nn.Module):
    def __init__(self, m: ModelConfig, experts: str = "grouped_mm"):
        """`experts`: transformers' `experts_implementation`, "grouped_mm" or "eager"."""
        super().__init__()
        from transformers import MixtralForCausalLM

        cfg = hf_config(m)
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = experts
        self.config = m
        self.hf = MixtralForCausalLM(cfg)
        self.placement = ExpertPlacement(1)  # every expert, in order (the exports read it)
        self.routing: RouterStats | None = None  # the latest forward's
        # transformers renamed `past_key_values` to `cache` (5.24 warns at the old name).
        forward_arguments = inspect.signature(self.hf.forward).parameters
        self._cache_argument = "cache" if "cache" in forward_arguments else "past_key_values"
        self.aux_loss: torch.Tensor | None = None  # transformers' load_balancing_loss_func, the latest forward's

    @classmethod
    def from_model(cls, ours: nn.Module, experts: str = "grouped_mm") -> "HFMixtral":
        """An HF model holding the same weights as `ours` (a single-rank te_mixtral model),
        its experts run by transformers' `experts` implementation."""
        device = next(ours.parameters()).device
        with torch.device(device):
            wrapped = cls(ours.config, experts)
        wrapped.hf.load_state_dict(ours.state_dict())
        return wrapped

    def forward(self, input_ids_BS: torch.Tensor, packed: PackedSequences, cache=None) -> torch.Tensor:
        given = {} if cache is None else {self._cache_argument: cache}
        out = self.hf(input_ids=input_ids_BS, position_ids=packed.position_ids_BS, use_cache=cache is not None,
                      output_router_logits=True, **given)
        self.aux_loss = out.aux_loss
        top_k = self.config.num_experts_per_tok
        layers = []
        for logits_TE in out.router_logits:
            logits_TE = logits_TE.float()
            probs_TE = F.softmax(logits_TE, dim=-1)
            layers.append(RouterStats.of_layer(logits_TE, probs_TE, torch.topk(probs_TE, top_k, dim=-1).indices))
        self.routing = RouterStats.cat(layers)
        return out.logits

    def kv_cache(self, length: int):
        """An empty cache for one sequence (transformers' grows as it goes: `length` is not needed)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)

    def lm_loss(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                num_targets_global: torch.Tensor) -> torch.Tensor:
        """As our model's, by PyTorch's cross-entropy."""
        return causal_lm_loss(logits_BSV, labels_BS, num_targets_global)

    def router_losses(self, layout: Layout) -> RouterLosses:
        """As our model's, with transformers' aux loss in place of ours (one process: the
        whole batch is this rank's)."""
        return dataclasses.replace(router_losses(self.routing, layout), aux=self.aux_loss.float())
