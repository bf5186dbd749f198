"""The optimizer step taken unit by unit in the forward's order (training/overlapped_step.py):
which parameters each unit holds, and that the update is master_adamw's to the bit. On a CPU
there is no stream to overlap on; tests/gpu/test_overlapped_step_gpu.py checks the streams."""

import pytest
import torch

from te_mixtral.config import load_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.optim import MasterAdamW
from te_mixtral.training.overlapped_step import OverlappedStep, forward_units

SINGLE = Layout(0, 1, 1, None, None)
TINY = {"vocab_size": "64", "hidden_size": "16", "intermediate_size": "32", "num_hidden_layers": "3",
        "num_attention_heads": "2", "num_key_value_heads": "1", "head_dim": "8", "num_experts": "4",
        "tokenizer_vocab_size": "64"}


def tiny(seed: int, **overrides: str) -> MixtralForCausalLM:
    cfg = load_config(None, {**TINY, **overrides})
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier())
    init_weights(model, seed, SINGLE)
    return model


@pytest.mark.parametrize("tied", ["false", "true"])
def test_units_hold_each_trained_parameter_once_in_the_forward_order(tied):
    model = tiny(0, tie_word_embeddings=tied)
    units = forward_units(model)
    body = model.model
    assert [m for m, _ in units] == [body.embed_tokens, *body.layers, body.norm, model.lm_head]
    held = [p for _, params in units for p in params]
    assert len(held) == len(set(held)) and set(held) == set(model.parameters())
    for module, params in units[1:-2]:  # a decoder layer's unit is that layer's parameters
        assert set(params) == set(module.parameters())
    assert units[-1][1] == ([] if tied == "true" else [model.lm_head.weight])  # a tied head is the embeddings'


def stepped(order: str, grads_seed: int, steps: int = 3) -> tuple[MixtralForCausalLM, MasterAdamW]:
    """A bf16 model stepped by master_adamw `steps` times on random gradients (the same draws
    for every `order`), all at once or unit by unit; the last parameter left without a gradient."""
    model = tiny(1)
    optimizer = MasterAdamW.from_fp32(model.parameters(), lr=1e-2, moment_dtype=torch.bfloat16, impl="torch")
    overlap = OverlappedStep(model, optimizer) if order == "units" else None
    generator = torch.Generator().manual_seed(grads_seed)
    last = list(model.parameters())[-1]
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None if p is last else torch.randn(p.shape, generator=generator).bfloat16()
        grad_scale = torch.tensor(0.5)
        if overlap:
            overlap.step(grad_scale)
        else:
            optimizer.step(grad_scale=grad_scale)
    return model, optimizer


def test_unit_by_unit_is_the_optimizer_step_to_the_bit():
    (a, opt_a), (b, opt_b) = stepped("all", 7), stepped("units", 7)
    untouched = tiny(1)
    for (name, p), q, p0 in zip(a.named_parameters(), b.parameters(), untouched.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(opt_a.master(p), opt_b.master(q)), name
    last_a, last_b, last_0 = (list(m.parameters())[-1] for m in (a, b, untouched))
    assert torch.equal(opt_b.master(last_b), last_0.float())  # no gradient: not stepped
    assert not torch.equal(list(a.parameters())[0], list(untouched.parameters())[0].bfloat16())


def test_step_in_a_given_order_reports_every_parameter():
    model = tiny(2)
    optimizer = MasterAdamW.from_fp32(model.parameters(), lr=1e-2, impl="torch")
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    params[3].grad = None
    before = [p.clone() for p in params]
    order = [params[5], params[3], params[0]]
    launched = []
    optimizer.step(params=order, launched=launched.append)
    assert launched == order
    changed = [i for i, (p, q) in enumerate(zip(params, before)) if not torch.equal(p, q)]
    assert changed == [0, 5]


def test_overlap_refuses_another_optimizer():
    model = tiny(3)
    with pytest.raises(ValueError, match="master_adamw"):
        OverlappedStep(model, torch.optim.AdamW(model.parameters()))


def test_remove_takes_the_hooks_off():
    model = tiny(4)
    optimizer = MasterAdamW.from_fp32(model.parameters(), impl="torch")
    hooks = len(model.model.layers[0]._forward_pre_hooks)
    overlap = OverlappedStep(model, optimizer)
    assert len(model.model.layers[0]._forward_pre_hooks) == hooks + 1
    overlap.remove()
    assert len(model.model.layers[0]._forward_pre_hooks) == hooks
