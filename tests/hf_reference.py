"""A random Hugging Face Mixtral, for the tests that compare with transformers or load its
checkpoints."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM


def random_hf_mixtral(**config) -> MixtralForCausalLM:
    """transformers' Mixtral built from `config` with eager attention, in eval mode. HF's init
    leaves the norms at one; they are drawn from U(0.5, 1.5) so that a swapped or dropped norm
    would show."""
    hf = MixtralForCausalLM(MixtralConfig(**config, attn_implementation="eager")).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return hf
