"""Clipping and stepping as the training loop does it, for both optimizers: the norm is the
global gradient norm, and the step sees the gradients times the clip factor (MasterAdamW reads
the factor inside its step instead of scaling the gradients first); and weight decay reaches
the weight matrices only."""

import pytest
import torch
from conftest import REPO

from te_mixtral.config import load_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.optim import MasterAdamW
from te_mixtral.training.optimizer import clip_gradients, make_optimizer, optimizer_step

SINGLE = Layout(0, 1, 1, None, None)


def model_with_grads(seed: int, scale: float) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model


@pytest.mark.parametrize("scale", [10.0, 1e-3], ids=["clipped", "within"])
def test_adamw_step_sees_clipped_gradients(scale):
    cfg = load_config(None, {"grad_clip": "1.0", "optimizer": "adamw", "model.num_hidden_layers": "1"})
    model = model_with_grads(0, scale)
    grads = [p.grad.double().clone() for p in model.parameters()]
    optimizer = make_optimizer(model, cfg)
    norm, grad_scale = clip_gradients(optimizer, model, 1.0, SINGLE)
    want_norm = torch.cat([g.flatten() for g in grads]).norm()
    assert norm.double() == pytest.approx(want_norm.item(), rel=1e-6) and grad_scale is None
    factor = min(1.0, 1.0 / (want_norm.item() + 1e-6))
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad.double(), g * factor, rtol=1e-6, atol=0)
    optimizer_step(optimizer, grad_scale)


@pytest.mark.parametrize("scale", [10.0, 1e-3], ids=["clipped", "within"])
def test_master_adamw_reads_the_clip_factor_in_its_step(scale):
    """The step with the folded factor equals MasterAdamW stepped on fp32 gradients that were
    multiplied by the factor beforehand; the bf16 gradients stay untouched. eps = 1 makes the
    update proportional to the gradient (Adam is otherwise blind to a gradient's scale at its
    first step), so a factor applied twice, inverted or not at all shows."""
    masters, factors = [], []
    for folded in (True, False):
        model = model_with_grads(1, scale)
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer = MasterAdamW.from_fp32(list(model.parameters()), lr=1e-2, eps=1.0, impl="torch")
        for p, g in zip(model.parameters(), grads):  # gradients of bf16 parameters are bf16
            p.grad = g.bfloat16()
        if folded:
            _, grad_scale = clip_gradients(optimizer, model, 1.0, SINGLE)
            assert all(torch.equal(p.grad, g.bfloat16()) for p, g in zip(model.parameters(), grads))
            optimizer_step(optimizer, grad_scale)
            factors.append(grad_scale.item())
        else:
            want = torch.cat([g.bfloat16().double().flatten() for g in grads]).norm().item()
            factor = torch.tensor(min(1.0, 1.0 / (want + 1e-6)), dtype=torch.float32)
            factors.append(factor.item())
            for p in model.parameters():
                p.grad_dtype = None
                p.grad = p.grad.float() * factor
            optimizer.step()
        masters.append([optimizer.master(p) for p in model.parameters()])
    # The folded factor comes from bf16 per-tensor norms: equal to the exact one within their
    # rounding (2^-8), and the updates (1e-2 x gradient x factor) within it too.
    assert factors[0] == pytest.approx(factors[1], rel=2**-8)
    for a, b in zip(*masters):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * 2**-8 * max(1.0, scale))


def mixtral(cfg) -> torch.nn.Module:
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier())
    init_weights(model, 0, SINGLE)
    return model


MODELS = {"mixtral": mixtral, "linear-layernorm": lambda cfg: model_with_grads(2, 1.0)}


@pytest.mark.parametrize("optimizer, dtype, expert_moments", [("adamw", "fp32", "same"), ("master_adamw", "bf16", "same"),
                                                              ("master_adamw", "bf16", "8bit")])
@pytest.mark.parametrize("model_name", MODELS)
def test_weight_decay_shrinks_the_matrices_and_no_vector(optimizer, dtype, expert_moments, model_name):
    """Every parameter of two dimensions or more (projections, experts, embeddings) decays and
    no vector does (norm weights, biases), told apart by shape, never by name: the second
    model's LayerNorm weight is called `1.weight`. With zero gradients Adam's update is
    0 / (0 + eps) = 0, so one step at lr 1 multiplies a decayed parameter by 1 - weight_decay
    and leaves any other exactly as it was."""
    moments = {} if expert_moments == "same" else {"expert_moments": expert_moments}  # typed, only where it counts
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {"optimizer": optimizer, "dtype": dtype, **moments,
                                                           "weight_decay": "0.5", "lr": "1.0"})
    model = MODELS[model_name](cfg)
    opt = make_optimizer(model, cfg)
    params = dict(model.named_parameters())

    def values():  # master_adamw: the exact fp32 masters its bf16 parameters are the top half of
        return {name: (opt.master(p) if isinstance(opt, MasterAdamW) else p.detach().clone())
                for name, p in params.items()}

    before = values()
    for p in params.values():
        p.grad = torch.zeros_like(p)
    optimizer_step(opt, None)
    after = values()
    assert any(p.dim() == 1 for p in params.values()) and any(p.dim() >= 2 for p in params.values())
    for name, p in params.items():
        if p.dim() >= 2:
            torch.testing.assert_close(after[name], before[name] * 0.5, rtol=1e-6, atol=0, msg=f"{name} did not decay")
        else:
            assert torch.equal(after[name], before[name]), f"{name} (a vector) decayed"


def test_8bit_expert_moments_are_the_experts_alone():
    """`train.expert_moments 8bit` puts every expert weight, and nothing else, in the group with
    8-bit moments; the others keep `moment_dtype`."""
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {"optimizer": "master_adamw", "dtype": "bf16",
                                                           "expert_moments": "8bit"})
    model = mixtral(cfg)
    opt = make_optimizer(model, cfg)
    eight_bit = {id(p) for g in opt.param_groups if g["moments_8bit"] for p in g["params"]}
    experts = {id(p) for name, p in model.named_parameters() if ".experts." in name}
    assert eight_bit == experts and len(experts) == 2 * cfg.model.num_hidden_layers
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
