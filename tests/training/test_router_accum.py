"""Router losses through the real training loop: with gradient accumulation a step's aux
loss is the mean of its micro-batches' (each computed as transformers computes one
forward's), the expert load in results.json counts every micro-batch once, and the router
losses' gradients are averaged over the micro-batches as their values are."""

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from te_mixtral.config import load_config
from te_mixtral.data.packing import PackedData
from te_mixtral.distributed.layout import Layout
from te_mixtral.distributed.parallelize import reduce_gradients
from te_mixtral.experts.loop import LoopTier
from te_mixtral.measure.report import read_results
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.training import loop
from te_mixtral.training.loop import train

SINGLE = Layout(0, 1, 1, None, None)


def test_accumulated_step_is_the_mean_of_micro_batches(tmp_path):
    cfg = load_config("configs/tiny.yaml", {
        "steps": "1", "timing_warmup_steps": "0", "batch_size": "4", "seq_len": "32", "grad_accum_steps": "2",
        "router_aux_loss_coef": "0.1", "router_z_loss_coef": "0.01", "plots": "false", "output_dir": str(tmp_path)})
    train(cfg)
    results = read_results(tmp_path / "results.json")

    # The reference: the initial weights, each micro-batch's router logits, transformers' loss.
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier())
    init_weights(model, cfg.train.seed, SINGLE)
    logits = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    data = PackedData(cfg.data, cfg.train.batch_size, 0, 1, cfg.train.seed, cfg.train.grad_accum_steps)
    per_micro = []
    with torch.no_grad():
        for micro in data.micro_batches(0):
            logits.clear()
            model(micro.input_ids, micro.packed)
            per_micro.append(tuple(logits))
    top_k, num_experts = cfg.model.num_experts_per_tok, cfg.model.num_experts
    auxes = [load_balancing_loss_func(layers, num_experts, top_k).item() for layers in per_micro]
    assert results["aux_losses"][0] == pytest.approx(sum(auxes) / len(auxes), rel=1e-6)
    # Pooling the step's two micro-batches would give another value: the test tells them apart.
    pooled = load_balancing_loss_func(tuple(torch.cat(pair) for pair in zip(*per_micro)), num_experts, top_k).item()
    assert abs(pooled - results["aux_losses"][0]) > 1e-4

    z = [torch.cat(layers).double().logsumexp(-1).square().mean().item() for layers in per_micro]
    assert results["z_losses"][0] == pytest.approx(sum(z) / len(z), rel=1e-6)
    counts = [[sum(int((torch.topk(layers[y], top_k).indices == e).sum()) for layers in per_micro)
               for e in range(num_experts)] for y in range(cfg.model.num_hidden_layers)]
    assert results["expert_load"]["tokens_per_expert"] == counts
    assert results["expert_load"]["tokens_per_expert_steps"] == [1, 1]


def first_step_router_gradients(tmp_path, monkeypatch, accum: int, z_coef: str) -> dict[str, torch.Tensor]:
    """The routers' gradients of a real one-step run (`loop.train`), recorded where the loop
    has summed its micro-batches' gradients, before clipping and the optimizer."""
    recorded = []

    def recording_reduce_gradients(model, layout, sharding):
        reduce_gradients(model, layout, sharding)
        recorded.append({name: p.grad.clone() for name, p in model.named_parameters()
                         if name.endswith(".mlp.gate.weight")})

    monkeypatch.setattr(loop, "reduce_gradients", recording_reduce_gradients)
    train(load_config("configs/tiny.yaml", {
        "steps": "1", "timing_warmup_steps": "0", "batch_size": "4", "seq_len": "32", "grad_accum_steps": str(accum),
        "router_z_loss_coef": z_coef, "plots": "false", "output_dir": str(tmp_path / f"n{accum}-z{z_coef}")}))
    (step,) = recorded
    return step


def test_router_gradient_of_accumulated_micro_batches_is_one_batchs(tmp_path, monkeypatch):
    """The z-loss is a mean over tokens, so with micro-batches of equal token counts the mean
    of the micro-batches' z-losses is the whole batch's, and so is its gradient: N micro-batches
    must give the routers one batch's gradient, not N times the router losses' share. (The
    load-balancing loss is not: a step's is the mean of its micro-batches', see the test above,
    so it is left out here.)"""
    one = first_step_router_gradients(tmp_path, monkeypatch, 1, "1.0")
    two = first_step_router_gradients(tmp_path, monkeypatch, 2, "1.0")
    lm_only = first_step_router_gradients(tmp_path, monkeypatch, 1, "0")
    assert one.keys() == two.keys() == lm_only.keys() and len(one) == 2
    for name, want in one.items():
        scale = want.abs().max().item()
        # Only the order of the sums differs.
        torch.testing.assert_close(two[name], want, rtol=0, atol=1e-5 * scale, msg=name)
        # The z-loss is most of the gradient, so that counting it twice would show.
        assert (want - lm_only[name]).abs().max().item() > 0.5 * scale
