"""Greedy generation is transformers' greedy: the same tokens from the same weights, with our KV
cache and with transformers' own behind the `hf` tier; the cached forward is the full forward;
the decode step waits for nothing but the token it hands back.

(The end-to-end check, generation after training against transformers on an exported
checkpoint, is in test_checkpoint_hf_out.py; the decode step's CUDA graph in
tests/gpu/test_generate_gpu.py.)"""

import contextlib

import pytest
import torch
from hf_reference import random_hf_mixtral
from host_syncs import SYNCHRONISING_OPS, OpRecorder

from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.registry import make_tier
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.hf_model import HFMixtral
from te_mixtral.model.layers import TORCH, PackedSequences
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.training.generate import greedy_generate
from te_mixtral.training.hf_checkpoint import load_hf_weights

SINGLE = Layout(0, 1, 1, None, None)
CPU = torch.device("cpu")
# Odd sizes: 6 experts, top-3, GQA ratio 3, a head_dim that is not hidden / heads.
ODD = dict(vocab_size=101, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
           num_key_value_heads=2, head_dim=12, num_local_experts=6, num_experts_per_tok=3,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=None, bos_token_id=None)


def ours_from(folder, tier="loop") -> Ours:
    """Our model with the weights of the transformers checkpoint in `folder`."""
    ours = Ours(model_config_from_hf(folder), TORCH, SINGLE, make_tier(tier)).eval()
    load_hf_weights(ours, folder, SINGLE)
    return ours


def saved(hf, folder):
    hf.save_pretrained(folder)
    return folder


def ours_greedy(model, prompt, tokens, eos_id=-1):
    return greedy_generate(model, prompt, tokens, eos_id, SINGLE, CPU, contextlib.nullcontext(), 1024)


def hf_greedy(hf, prompt, tokens, eos_id=None):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, eos_token_id=eos_id,
                      pad_token_id=eos_id)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """transformers' Mixtral at odd shapes, saved, and its greedy tokens after a prompt of one
    token and one of 11: 20 new tokens, far enough that a cache row written at the wrong
    position, or a key the mask lets through early, changes a token."""
    torch.manual_seed(1)
    hf = random_hf_mixtral(**ODD)
    folder = tmp_path_factory.mktemp("odd")
    hf.save_pretrained(folder)
    prompts = ([7], torch.randint(0, 101, (11,)).tolist())
    return folder, hf, {tuple(p): hf_greedy(hf, p, 20) for p in prompts}


@pytest.mark.parametrize("tier", ["loop", "custom_grouped", "hf"])
def test_every_path_generates_transformers_tokens(tier, odd):
    folder, hf, expected = odd
    ours = ours_from(folder, "loop" if tier == "hf" else tier)
    model = HFMixtral.from_model(ours) if tier == "hf" else ours
    for prompt, tokens in expected.items():
        assert len(tokens) == 20 and ours_greedy(model, list(prompt), 20) == tokens
    prompt, tokens = next(iter(expected.items()))
    stop = tokens[2]  # make the third token the eos: generation stops right after it
    assert ours_greedy(model, list(prompt), 20, eos_id=stop) == tokens[: tokens.index(stop) + 1]


def test_the_cached_forward_is_the_full_forward(tmp_path):
    """A prompt through the cache, then one token at a time: every position's logits are the
    whole sequence's in one forward without a cache."""
    torch.manual_seed(2)
    ours = ours_from(saved(random_hf_mixtral(**ODD), tmp_path))
    ids = torch.randint(0, 101, (1, 13))

    def packed(start, end):
        return PackedSequences(torch.arange(start, end)[None], torch.tensor([0, end - start], dtype=torch.int32),
                               end - start)

    with torch.no_grad():
        full = ours(ids, packed(0, 13))
        cache = ours.kv_cache(16)  # longer than used: the rows after the last are never seen
        pieces = [ours(ids[:, :5], packed(0, 5), cache)]
        pieces += [ours(ids[:, i:i + 1], packed(i, i + 1), cache) for i in range(5, 13)]
    assert torch.allclose(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-6)


def test_a_decode_step_waits_for_nothing_but_its_token(tmp_path):
    """What a CUDA graph of the decode step needs (the CPU half; the capture itself is in
    tests/gpu): over a whole generation, the only ops that would wait for a GPU are the prompt's
    tensors, made once from Python, and one read of each new token."""
    torch.manual_seed(3)
    ours = ours_from(saved(random_hf_mixtral(**ODD), tmp_path), "custom_grouped")
    with OpRecorder() as recorder:
        tokens = ours_greedy(ours, [4, 9, 2], 6)
    waits = {op: n for op, n in recorder.counts.items() if op in SYNCHRONISING_OPS}
    assert waits == {"aten.lift_fresh": 3, "aten._local_scalar_dense": len(tokens)}  # ids, two cu_seqlens
