"""The `hf` baseline: Hugging Face `MixtralForCausalLM` as is, the whole model every tier is
measured against (te_mixtral/experts/registry.py lists it under `BASELINES`).

It runs in a single process with transformers' own attention (SDPA) and its own eager
experts loop. It starts from the very weights our model would start from (same seed, same
initialisation, copied by name), so its losses are comparable step by step.
Packed documents: passing position_ids that restart at 0 makes transformers build a
document-separating causal mask itself.
"""

import torch
from torch import nn

from te_mixtral.config import ModelConfig
from te_mixtral.model.hf_config import hf_config
from te_mixtral.model.layers import PackedSequences


class HFMixtral(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        from transformers import MixtralForCausalLM

        cfg = hf_config(m)
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "eager"
        self.config = m
        self.hf = MixtralForCausalLM(cfg)

    @classmethod
    def from_model(cls, ours: nn.Module) -> "HFMixtral":
        """An HF model holding the same weights as `ours` (a single-rank te_mixtral model)."""
        device = next(ours.parameters()).device
        with torch.device(device):
            wrapped = cls(ours.config)
        wrapped.hf.load_state_dict(ours.state_dict())
        return wrapped

    def forward(self, input_ids_BS: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
        return self.hf(input_ids=input_ids_BS, position_ids=packed.position_ids_BS, use_cache=False).logits
