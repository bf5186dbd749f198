"""The router losses (te_mixtral/model/router_losses.py) against transformers' own
`load_balancing_loss_func`, float64 references and finite differences; and once per forward
under a full recompute."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from te_mixtral.config import load_config
from te_mixtral.data.packing import batch_from_windows
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.hf_model import HFMixtral
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM, causal_lm_loss, init_weights
from te_mixtral.model.router_losses import RouterStats, router_losses

SINGLE = Layout(0, 1, 1, None, None)
LAYERS = 3


def our_losses(logits_per_layer: list[torch.Tensor], top_k: int):
    layers = []
    for logits_TE in logits_per_layer:
        probs_TE = F.softmax(logits_TE.float(), dim=-1)
        layers.append(RouterStats.of_layer(logits_TE.float(), probs_TE, torch.topk(probs_TE, top_k, dim=-1).indices))
    return router_losses(RouterStats.cat(layers), SINGLE)


CASES = [(e, k) for e in (3, 5, 8) for k in (1, 2, 3)]


@pytest.mark.parametrize("num_experts,top_k", CASES, ids=[f"E{e}-K{k}" for e, k in CASES])
def test_aux_equals_transformers_unpadded(num_experts, top_k):
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    # A per-expert bias, different in each layer, so that the router is really unbalanced.
    logits = [torch.randn(37, num_experts, generator=gen) * 2 + torch.randn(num_experts, generator=gen) * 2
              for _ in range(LAYERS)]
    want = load_balancing_loss_func(tuple(logits), num_experts, top_k)
    got = our_losses(logits, top_k)
    torch.testing.assert_close(got.aux, want, rtol=2e-6, atol=0)
    # The value is not trivially K (a balanced router), but where every expert is picked.
    assert (abs(want.item() - top_k) > 1e-2) == (top_k < num_experts)


@pytest.mark.parametrize("num_experts,top_k", CASES, ids=[f"E{e}-K{k}" for e, k in CASES])
def test_packed_equals_transformers_padded_with_mask(num_experts, top_k):
    """Documents of odd lengths: transformers on a padded batch with its attention mask, ours
    on the same tokens packed end to end (no padding anywhere)."""
    gen = torch.Generator().manual_seed(100 + num_experts * 10 + top_k)
    lengths = [5, 11, 2, 9]
    longest = max(lengths)
    mask_BS = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask_BS[row, :n] = 1
    padded, packed = [], []
    for _ in range(LAYERS):
        # Padding rows get huge logits: they would move the loss a lot if they were counted.
        logits_BSE = torch.randn(len(lengths), longest, num_experts, generator=gen)
        logits_BSE[mask_BS == 0] = 50.0 * torch.arange(num_experts, dtype=torch.float32)
        padded.append(logits_BSE.reshape(-1, num_experts))
        packed.append(logits_BSE[mask_BS == 1])
    want = load_balancing_loss_func(tuple(padded), num_experts, top_k, attention_mask=mask_BS)
    got = our_losses(packed, top_k)
    torch.testing.assert_close(got.aux, want, rtol=2e-6, atol=0)
    # Counting the padding would have changed it (unless every expert is every token's).
    assert top_k == num_experts or abs(load_balancing_loss_func(tuple(padded), num_experts, top_k).item() - want.item()) > 1e-2


def test_z_loss_and_counts_against_float64():
    gen = torch.Generator().manual_seed(3)
    logits = [torch.randn(29, 5, generator=gen) * 3 for _ in range(LAYERS)]
    got = our_losses(logits, 2)
    want = torch.cat([torch.logsumexp(x.double(), -1) ** 2 for x in logits]).mean()
    torch.testing.assert_close(got.z.double(), want, rtol=1e-6, atol=0)
    for layer, x in enumerate(logits):
        picks = torch.topk(x, 2, dim=-1).indices.flatten()
        assert got.tokens_per_expert_YE[layer].tolist() == [int((picks == e).sum()) for e in range(5)]


# --- in the model ------------------------------------------------------------------------------


def tiny(**model_keys):
    overrides = {"num_experts": "5", "num_experts_per_tok": "2", "batch_size": "2", "seq_len": "24", "num_hidden_layers": "3",
                 **{k: str(v) for k, v in model_keys.items()}}
    return load_config("configs/tiny.yaml", overrides)


def random_batch(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    windows = torch.randint(1, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1), generator=gen)
    windows[torch.rand(windows.shape, generator=gen) < 0.05] = 0
    return batch_from_windows(windows, eos_id=0)


def build(cfg, recompute="none", dtype=torch.float32):
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier(), recompute)
    init_weights(model, 11, SINGLE)
    return model.to(dtype)


def router_grads(model, batch, coef: float):
    """The routers' gradients of LM loss + coef * aux, and the aux loss."""
    model.zero_grad(set_to_none=True)
    targets = (batch.labels != -100).sum().double()
    loss = causal_lm_loss(model(batch.input_ids, batch.packed), batch.labels, targets)
    router = model.router_losses(SINGLE)
    (loss + coef * router.aux).backward()
    return [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers], router


def test_router_gradient_includes_aux_against_float64():
    """(grad with coef - grad without) / coef is the aux loss's own gradient. The last layer's
    router reaches the aux loss only through its own probabilities (earlier routers also
    through later layers' inputs), so its gradient has a float64 reference from its input
    alone: E * sum_e f_e * d p_e / dW, with the model's counts f."""
    cfg = tiny()
    model, batch = build(cfg, dtype=torch.float64), random_batch(cfg, 5)
    gate = model.model.layers[-1].mlp.gate
    captured = []
    gate.register_forward_hook(lambda module, args, out: captured.append(args[0].detach()))
    coef = 0.5
    with_aux, _ = router_grads(model, batch, coef)
    without, router = router_grads(model, batch, 0.0)
    aux_grads = [(a - b) / coef for a, b in zip(with_aux, without)]
    assert all(g.abs().max() > 1e-4 for g in aux_grads)  # every router gets the aux term

    num_experts, layers = cfg.model.num_experts, cfg.model.num_hidden_layers
    rows = layers * batch.input_ids.numel()
    weight = gate.weight.detach().clone().requires_grad_()
    probs_TE = torch.softmax(captured[-1] @ weight.T, dim=-1)
    f_E = router.tokens_per_expert_YE.sum(0).double() / rows
    # Only the last layer's share of p depends on `weight`; the other layers' are constants.
    (num_experts * (f_E * probs_TE.sum(0) / rows).sum()).backward()
    torch.testing.assert_close(aux_grads[-1], weight.grad, rtol=1e-4, atol=1e-6)


def test_router_gradient_includes_z_loss_against_float64():
    """With `model.router_z_loss_coef` set, the z-loss trains every router: the gradient of the
    LM loss plus what `weighted` adds, less that of the LM loss alone, is coef times the
    z-loss's own gradient. The last layer's router reaches the z-loss through its own logits
    only, so its share has a float64 reference from its input: d/dW of sum_t lse(x_t W^T)^2 /
    (Y * N). A zero coefficient adds no gradient at all."""
    coef = 0.5
    cfg = tiny(router_z_loss_coef=coef)
    model, batch = build(cfg, dtype=torch.float64), random_batch(cfg, 7)
    gate = model.model.layers[-1].mlp.gate
    captured = []
    gate.register_forward_hook(lambda module, args, out: captured.append(args[0].detach()))

    def gradients(model, with_router_losses: bool):
        model.zero_grad(set_to_none=True)
        targets = (batch.labels != -100).sum().double()
        loss = causal_lm_loss(model(batch.input_ids, batch.packed), batch.labels, targets)
        router = model.router_losses(SINGLE).weighted(model.config)
        (loss + router if with_router_losses else loss).backward()
        return [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]

    with_z, without = gradients(model, True), gradients(model, False)
    z_grads = [(a - b) / coef for a, b in zip(with_z, without)]
    assert all(g.abs().max() > 1e-3 for g in z_grads)  # every router gets the z-loss term

    rows = cfg.model.num_hidden_layers * batch.input_ids.numel()
    weight = gate.weight.detach().clone().requires_grad_()
    ((captured[-1] @ weight.T).logsumexp(-1).square().sum() / rows).backward()
    torch.testing.assert_close(z_grads[-1], weight.grad, rtol=1e-4, atol=1e-6)

    off = build(tiny(router_z_loss_coef=0.0), dtype=torch.float64)
    for got, want in zip(gradients(off, True), without):
        assert torch.equal(got, want)


def test_full_recompute_counts_once():
    """The routers run twice per layer under full recompute (the forward hooks show it), but
    the routing statistics, the losses and the routers' gradients are those of one forward."""
    cfg = tiny()
    batch = random_batch(cfg, 6)
    results = {}
    for mode in ("none", "full"):
        model = build(cfg, mode)
        calls = [0]
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        grads, router = router_grads(model, batch, 0.3)
        results[mode] = grads, router, calls[0]
    (grads, router, calls), (want_grads, want, want_calls) = results["full"], results["none"]
    assert want_calls == cfg.model.num_hidden_layers and calls == 2 * want_calls
    assert torch.equal(router.tokens_per_expert_YE, want.tokens_per_expert_YE)
    assert int(router.tokens_per_expert_YE.sum()) == cfg.model.num_hidden_layers * batch.input_ids.numel() * 2
    torch.testing.assert_close(router.aux, want.aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(router.z, want.z, rtol=1e-6, atol=0)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_hf_tier_returns_transformers_aux_loss():
    """The `hf` baseline's aux loss is transformers' own, and equals ours on the same weights;
    its z-loss and expert load come from transformers' router logits."""
    cfg = tiny()
    ours, batch = build(cfg), random_batch(cfg, 8)
    hf = HFMixtral.from_model(ours)
    ours(batch.input_ids, batch.packed)
    hf(batch.input_ids, batch.packed)
    want, got = ours.router_losses(SINGLE), hf.router_losses(SINGLE)
    assert got.aux is not None and got.aux.grad_fn is not None  # it trains the routers
    torch.testing.assert_close(got.aux, want.aux, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.z, want.z, rtol=1e-5, atol=0)
    assert torch.equal(got.tokens_per_expert_YE, want.tokens_per_expert_YE)


def test_weighted_skips_zero_coefficients():
    cfg = tiny(router_aux_loss_coef=0.25, router_z_loss_coef=0.0)
    model, batch = build(cfg), random_batch(cfg, 2)
    model(batch.input_ids, batch.packed)
    router = model.router_losses(SINGLE)
    torch.testing.assert_close(router.weighted(cfg.model), 0.25 * router.aux)
    assert tiny().model.aux_loss_coef == 0.0 and router.weighted(tiny().model) == 0
