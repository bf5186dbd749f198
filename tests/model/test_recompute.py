"""Activation recompute (train.recompute) changes what the forward keeps, never the numbers:
the loss and every gradient equal a run without it, the routing is decided once where it
should be, and nothing the forward records is recorded twice."""

import json

import pytest
import torch
from conftest import REPO
from launch import EP_ARGS, train_ep_many

from te_mixtral.config import load_config, load_run_config
from te_mixtral.data.packing import batch_from_windows
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError
from te_mixtral.experts.base import ExpertTier
from te_mixtral.experts.registry import make_tier
from te_mixtral.model.layers import TORCH
from te_mixtral.model.lora import add_adapters
from te_mixtral.model.mixtral import MixtralForCausalLM, causal_lm_loss, init_weights

SINGLE = Layout(0, 1, 1, None, None)
MODES = ("none", "selective", "full")
EP2_RUNS = {mode: (2, "--recompute", mode, "--profile_phases", "true") for mode in MODES}
# Launched with the other modules' two-rank runs (conftest.py's launch_planned), for the slow test.
PLANNED_RUNS = {2: [pytest.param([*EP_ARGS, "--ep-size", str(ep), *extra], marks=pytest.mark.slow)
                    for ep, *extra in EP2_RUNS.values()]}


class CountingTier(ExpertTier):
    """A tier that counts its calls and hands them to a real one."""

    name = "counting"

    def __init__(self, inner: ExpertTier):
        self.inner, self.calls = inner, 0

    def __call__(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
        self.calls += 1
        return self.inner(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters)


def random_batch(cfg, seed):
    """Random tokens with a few document ends (token 0), so attention sees several documents."""
    gen = torch.Generator().manual_seed(seed)
    windows = torch.randint(1, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1), generator=gen)
    windows[torch.rand(windows.shape, generator=gen) < 0.02] = 0
    return batch_from_windows(windows, eos_id=0)


def step(cfg, tier_name, recompute, batch, recompute_layers=None):
    """One forward and backward: the loss, every gradient, and how often the router and
    the tier ran."""
    tier = CountingTier(make_tier(tier_name))
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, tier, recompute, recompute_layers)
    init_weights(model, 7, SINGLE)
    router_calls = [0]
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda *_: router_calls.__setitem__(0, router_calls[0] + 1))
    targets = (batch.labels != -100).sum().double()
    loss = causal_lm_loss(model(batch.input_ids, batch.packed), batch.labels, targets)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, router_calls[0], tier.calls


@pytest.mark.parametrize("recompute_layers", [None, 1], ids=["every-layer", "first-layer"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("tier", ["loop", "custom_grouped"])
def test_loss_and_every_gradient_equal_no_recompute(tier, recompute, recompute_layers):
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {"seq_len": "64", "dtype": "fp32"})
    batch = random_batch(cfg, seed=3)
    want_loss, want_grads, _, _ = step(cfg, tier, "none", batch)
    loss, grads, _, _ = step(cfg, tier, recompute, batch, recompute_layers)
    # fp32 on the CPU: the recompute runs the very kernels on the very inputs again, so the
    # bits agree; any difference is a bug, not rounding.
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name  # every parameter was reached
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_lora_dropout_draws_the_forwards_masks_again(recompute):
    """LoRA's dropout draws masks in the forward: the recompute must draw the very same (torch's
    checkpoint restores the RNG state before it runs again), or the adapters' gradients would
    be of other masks than the loss; the same loss and adapter gradients, bit for bit."""
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {"seq_len": "32", "lora.rank": "4", "lora.dropout": "0.5"})
    batch = random_batch(cfg, seed=6)
    targets = (batch.labels != -100).sum().double()
    runs = []
    for mode in ("none", recompute):
        model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, make_tier("loop"), mode, frozen_base=True)
        init_weights(model, 7, SINGLE)
        add_adapters(model, cfg.lora, 7, SINGLE)
        with torch.no_grad():  # B starts at zero, which would leave every A without a gradient
            for name, p in model.named_parameters():
                if name.endswith(".B"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
        torch.manual_seed(0)
        loss = causal_lm_loss(model(batch.input_ids, batch.packed), batch.labels, targets)
        loss.backward()
        runs.append((loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (want_loss, want_grads), (loss, grads) = runs
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys() and any(".experts." in name for name in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.parametrize("recompute, router_runs, tier_runs", [("none", 1, 1), ("selective", 1, 2), ("full", 2, 2)])
def test_what_runs_again(recompute, router_runs, tier_runs):
    """Per layer and step: selective runs the tier again but never the router; full runs the
    whole layer again, router included, so a forward hook on the router fires twice (a place
    where a routing statistic must not be recorded: see te_mixtral/model/recompute.py). With
    train.recompute_layers only that many layers, the first ones, run anything again."""
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {"seq_len": "32", "num_hidden_layers": "3"})
    layers = cfg.model.num_hidden_layers
    for recomputing in (None, 1, 2):
        _, _, router_calls, tier_calls = step(cfg, "loop", recompute, random_batch(cfg, seed=4), recomputing)
        again = 0 if recompute == "none" else layers if recomputing is None else recomputing
        assert (router_calls, tier_calls) == (layers + (router_runs - 1) * again, layers + (tier_runs - 1) * again)


def test_without_autograd_nothing_is_recomputed():
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {"seq_len": "32"})
    batch = random_batch(cfg, seed=5)
    tier = CountingTier(make_tier("loop"))
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, tier, "full")
    init_weights(model, 7, SINGLE)
    with torch.no_grad():
        model(batch.input_ids, batch.packed)
    assert tier.calls == cfg.model.num_hidden_layers


def test_recompute_key_is_checked():
    with pytest.raises(UserError, match="train.recompute must be one of none, selective, full"):
        load_config(None, {"recompute": "layers"})
    with pytest.raises(UserError, match="train.recompute_layers counts the layers that recompute: it needs "
                                        "train.recompute selective or full"):
        load_config(None, {"recompute_layers": "1"})
    for layers in ("0", "3"):  # configs/tiny.yaml has 2
        with pytest.raises(UserError, match=rf"train.recompute_layers must be in \[1, model.num_hidden_layers "
                                            rf"\(2\)\], got {layers}"):
            load_config(str(REPO / "configs" / "tiny.yaml"), {"recompute": "full", "recompute_layers": layers})
    with pytest.raises(UserError, match="train.recompute applies to te_mixtral's own model; tiers hf and hf_eager run "
                                        "transformers' model"):
        load_run_config(None, {"recompute": "full", "tier": "hf"}, world_size=1)


@pytest.mark.slow
def test_ep2_trains_alike_with_and_without_recompute(tmp_path, launch_planned):
    """EP=2 over gloo: full recompute runs the all-to-alls again in the backward; the losses,
    the trained weights and the expert rows each rank records come out the same."""
    runs = {}
    launch_planned(2)
    trained = train_ep_many(tmp_path, 2, EP2_RUNS)
    for recompute, (losses, weights) in trained.items():
        rows = json.loads((tmp_path / recompute / "results.json").read_text())["expert_rows_per_rank"]
        runs[recompute] = losses, weights, rows
    want_losses, want_weights, want_rows = runs["none"]
    assert sum(want_rows) == 4 * 64 * 2 * 2  # every token's 2 copies in each of the 2 layers, once
    for recompute in ("selective", "full"):
        losses, weights, rows = runs[recompute]
        assert losses == want_losses, recompute
        assert rows == want_rows, recompute
        for rank, (got, want) in enumerate(zip(weights, want_weights)):
            for name in want:
                assert torch.equal(got[name], want[name]), f"{recompute}, rank {rank}: {name}"


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_the_training_loop_recomputes_the_layers_it_is_told(recompute, tmp_path, monkeypatch):
    """Through the loop (`train`): with train.recompute_layers 1 of 3, only the first layer's
    part (the experts, or the whole layer) is wrapped for recompute, at every step; a loop
    that dropped the key would recompute all three, or none."""
    from te_mixtral.model import mixtral, moe
    from te_mixtral.model.recompute import recomputed
    from te_mixtral.training.loop import train

    wrapped = []  # what was wrapped for recompute, once per forward that keeps a graph

    def spy(fn, *args):
        if torch.is_grad_enabled():
            wrapped.append(getattr(fn, "__self__", fn))
        return recomputed(fn, *args)

    monkeypatch.setattr(mixtral, "recomputed", spy)
    monkeypatch.setattr(moe, "recomputed", spy)
    steps = 2
    cfg = load_run_config(str(REPO / "configs" / "tiny.yaml"), {
        "seq_len": "32", "num_hidden_layers": "3", "steps": str(steps), "timing_warmup_steps": "0",
        "max_documents": "40", "recompute": recompute, "recompute_layers": "1", "plots": "false",
        "output_dir": str(tmp_path)})
    model = train(cfg).model
    first = model.model.layers[0]
    assert wrapped == [first if recompute == "full" else first.mlp.experts] * steps
