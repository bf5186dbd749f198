"""LoRA: low-rank adapters trained over a frozen base model.

Shape suffixes: see te_mixtral/__init__.py; r is the adapter rank.

An adapted projection computes

    y = x @ W.T + s * (dropout(x) @ A.T) @ B.T,        s = alpha / r  (alpha / sqrt(r): rsLoRA)

with W frozen, A [r, in] drawn from U(-1/sqrt(in), 1/sqrt(in)) and B [out, r] zero, PEFT's
default, so the first forward is the base model's exactly. Only A and B train: the base
keeps no gradient and no optimizer state, and its backward needs no weight-gradient GEMM,
a third of a frozen GEMM's training FLOPs.

Where the adapters live. Each adapted module holds them in its `adapters` dict (empty
without LoRA), beside its base weights, whose names stay those of a full fine-tune, so a
Hugging Face checkpoint loads into an adapted model as into any other:

    attention   `self_attn.adapters.q_proj.A`  [r, D],    `.B` [H*hd, r]   one per projection
    experts     `mlp.experts.adapters.gate_up_proj.A` [L, r, D], `.B` [L, 2F, r]
                `mlp.experts.adapters.down_proj.A`    [L, r, F], `.B` [L, D, r]

The experts' adapters are stacked like the experts (one adapter per expert on each stacked
weight, as PEFT's `target_parameters` adapts them) and, their names holding `.experts.`,
split over the EP group with them and summed over the experts' replicas, as the expert
weights are (te_mixtral/distributed/layout.py). The tier runs them inside its grouped call
(te_mixtral/experts/adapters.py). Dense adapters are replicated and summed over all ranks.

Initialisation, like the base's (model/mixtral.py), does not depend on the EP layout: every
expert's adapter comes from a generator seeded by (seed, layer, global expert).

Precision: the frozen base is made in the run's compute dtype (bf16 on a GPU: 2 bytes per
parameter, not the 4 of an fp32 master that nothing updates: training/loop.py builds it so);
the adapters are fp32 and train with AdamW, cast to bf16 for their GEMMs by autocast (or by
the tier).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.adapters import ExpertAdapters
from te_mixtral.experts.quant.frozen import FrozenWeight
from te_mixtral.lora_config import LORA_EXPERT_TARGETS, LoRAConfig


class LowRank(nn.Module):
    """One dense projection's adapter: its `forward` is the delta added to the base output."""

    def __init__(self, in_features: int, out_features: int, lora: LoRAConfig):
        super().__init__()
        self.A = nn.Parameter(torch.empty(lora.rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, lora.rank))
        self.scale = lora.scale
        # Not Dropout(0): that still copies its input, and the copy is what A's GEMM keeps.
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.dropout(x), self.A), self.B) * self.scale


class StackedLowRank(nn.Module):
    """The adapters of one stacked expert weight [L, out, in]: A [L, r, in], B [L, out, r]."""

    def __init__(self, experts: int, in_features: int, out_features: int, lora: LoRAConfig):
        super().__init__()
        self.A = nn.Parameter(torch.empty(experts, lora.rank, in_features))
        self.B = nn.Parameter(torch.zeros(experts, out_features, lora.rank))
        self.scale, self.dropout = lora.scale, lora.dropout


def expert_adapters(adapters: nn.ModuleDict, training: bool) -> ExpertAdapters:
    """What a tier receives of a StackedExperts' (non-empty) `adapters`."""
    def pair(target):
        return (adapters[target].A, adapters[target].B) if target in adapters else None
    any_one = next(iter(adapters.values()))
    return ExpertAdapters(pair("gate_up_proj"), pair("down_proj"), any_one.scale,
                          any_one.dropout if training else 0.0)


def _a_bound(in_features: int) -> float:
    """PEFT's A init, kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))."""
    return 1.0 / math.sqrt(in_features)


def adapter_seed(seed: int, layer_index: int, global_expert: int) -> int:
    """Apart from every expert weight's seed (model/mixtral.py's `expert_seed`)."""
    return ((seed * 1_000_003 + layer_index) * 65_537 + global_expert + 1) ^ 0x10_4A_D4


@torch.no_grad()
def add_adapters(model: nn.Module, lora: LoRAConfig, seed: int, layout: Layout) -> None:
    """Give `model` (te_mixtral's Mixtral, its weights in place) the adapters `lora` targets,
    initialised from `seed`, on its device, in fp32."""
    m = model.config
    device = next(model.parameters()).device
    dense = torch.Generator(device).manual_seed(adapter_seed(seed, -1, -1))
    experts_per_rank = m.num_experts // layout.ep_size
    for layer_index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        for target in lora.dense_targets():
            base = getattr(attention, target)
            out_features, in_features = base.weight.shape
            adapter = attention.adapters[target] = LowRank(in_features, out_features, lora).to(device)
            adapter.A.uniform_(-_a_bound(in_features), _a_bound(in_features), generator=dense)
        experts = layer.mlp.experts
        for target in lora.expert_targets():
            _, out_features, in_features = getattr(experts, target).shape
            adapter = experts.adapters[target] = StackedLowRank(experts_per_rank, in_features, out_features,
                                                                lora).to(device)
            for local, global_expert in enumerate(model.placement.held(layer_index, layout.ep_rank, m.num_experts)):
                gen = torch.Generator(device).manual_seed(
                    adapter_seed(seed, layer_index, global_expert) + LORA_EXPERT_TARGETS.index(target))
                adapter.A[local].uniform_(-_a_bound(in_features), _a_bound(in_features), generator=gen)


def is_adapter_param(name: str) -> bool:
    return ".adapters." in name


def lora_adapters(model: nn.Module) -> dict[str, nn.Module]:
    """Each adapted weight's name (`...self_attn.q_proj.weight`, `...mlp.experts.down_proj`)
    -> its adapter (with `A`, `B` and `scale`); empty without LoRA."""
    found = {}
    for name, module in model.named_modules():
        owner, found_one, target = name.rpartition(".adapters.")
        if found_one and "." not in target:
            found[f"{owner}.{target}.weight" if isinstance(module, LowRank) else f"{owner}.{target}"] = module
    return found


def base_weights(model: nn.Module) -> dict[str, torch.Tensor | FrozenWeight]:
    """Every weight by the name a full fine-tune's parameter has: the parameters, and the
    expert stacks of a base frozen in a quantised format (experts/quant/frozen.py), which are modules.
    Both fill from a checkpoint alike (`w[index].copy_(tensor)`); `weight_tensor` reads one."""
    weights = dict(model.named_parameters())
    weights.update((name, module) for name, module in model.named_modules() if isinstance(module, FrozenWeight))
    return weights


def weight_tensor(weight: torch.Tensor | FrozenWeight) -> torch.Tensor:
    """A weight of `base_weights` as a tensor: a frozen quantised stack dequantised to float32."""
    return weight.dequantized() if isinstance(weight, FrozenWeight) else weight.detach()


@torch.no_grad()
def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + s * B @ A in fp32, for a dense weight [out, in] or a stack [L, out, in]."""
    return weight.float() + scale * torch.matmul(b.float(), a.float())
