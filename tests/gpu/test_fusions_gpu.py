"""The TE backend's fusions (te_mixtral/model/layers.py, `--te_fusions`) against the paths they
replace: TE's fused cross-entropy against PyTorch's, q, k and v by one GEMM against one GEMM
each (both against float64), the whole model with both against the same model without them
(against float32), and a training run with them loss-checked against one without."""

import pytest
import torch
import torch.nn.functional as F
from gpu.test_model_gpu import train
from gpu.test_recompute_gpu import setup

from te_mixtral.model.layers import TE, TE_UNFUSED, TORCH, te_cross_entropy, torch_cross_entropy
from te_mixtral.model.mixtral import causal_lm_loss
from te_mixtral.model.packed_projection import packed_linear
from te_mixtral.te_support import te_available

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not te_available(), reason="needs Transformer Engine")]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("vocab", [1000, 32000])
def test_te_cross_entropy_is_as_close_to_float64_as_pytorchs(vocab):
    """Loss and logit gradient, ignored targets included (their rows get no gradient). A
    gradient off by the target count, or without the target's -1, is off by order one."""
    gen = torch.Generator("cuda").manual_seed(vocab)
    logits = (3 * torch.randn(2, 300, vocab, device="cuda", generator=gen)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (2, 300), device="cuda", generator=gen)
    ignored = torch.rand(labels.shape, device="cuda", generator=gen) < 0.1
    labels[ignored] = -100
    targets = (labels != -100).sum().double()
    reference = logits.double().requires_grad_()
    ref_loss = F.cross_entropy(reference.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / targets
    ref_loss.backward()

    errors = {}
    for cross_entropy in (te_cross_entropy, torch_cross_entropy):
        x = logits.clone().requires_grad_()
        loss = causal_lm_loss(x, labels, targets, cross_entropy)
        loss.backward()
        assert x.grad.dtype == torch.bfloat16
        assert not x.grad[ignored].any()
        errors[cross_entropy.__name__] = (abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                                          rel(x.grad, reference.grad))
    for te_error, torch_error in zip(errors["te_cross_entropy"], errors["torch_cross_entropy"], strict=True):
        assert te_error <= 2 * torch_error + 1e-6, errors
        assert te_error < 5e-3, errors


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_packed_qkv_under_autocast_is_as_close_to_float64_as_three_linears(weight_dtype):
    """At a GQA shape (k and v a quarter of q); the weight gradients in the weights' dtype,
    as autograd gives three linears'."""
    gen = torch.Generator("cuda").manual_seed(5)
    x = torch.randn(512, 256, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weights = [(0.05 * torch.randn(out, 256, device="cuda", generator=gen)).to(weight_dtype).requires_grad_()
               for out in (256, 64, 64)]
    grads_out = [torch.randn(512, w.shape[0], device="cuda", generator=gen).to(torch.bfloat16) for w in weights]
    x64, w64 = x.double(), [w.double() for w in weights]
    reference = [x64 @ w.t() for w in w64]
    g64 = [g.double() for g in grads_out]
    ref_grads = [sum(g @ w for g, w in zip(g64, w64, strict=True)), *(g.t() @ x64 for g in g64)]

    errors = {}
    for name, project in (("packed", lambda: packed_linear(x, *weights)),
                          ("three", lambda: [F.linear(x, w) for w in weights])):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ys = project()
        grads = torch.autograd.grad(ys, [x, *weights], grads_out)
        assert [g.dtype for g in grads] == [x.dtype, *(w.dtype for w in weights)]
        errors[name] = [rel(y, r) for y, r in zip(ys, reference, strict=True)] + [
            rel(g, r) for g, r in zip(grads, ref_grads, strict=True)]
    for packed, three in zip(errors["packed"], errors["three"], strict=True):
        assert packed <= 2 * three + 1e-4, errors
        assert packed < 1e-2, errors


def loss_and_grads(backend, dtype, autocast: bool, weights: dict | None = None):
    """The tiny model's loss by the backend's cross-entropy, and every parameter's gradient;
    setup()'s weights or `weights` (by name), in `dtype`."""
    _, model, batch = setup(backend, "loop", "none", 256)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if weights is not None:
                p.copy_(weights[name])
            # The parameters alone, as training/optimizer.py's split_masters makes them bf16:
            # model.to() would round the rotary frequencies too.
            p.data = p.data.to(dtype)
    targets = (batch.labels != -100).sum().double()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(batch.input_ids, batch.packed)
    loss = model.lm_loss(logits, batch.labels, targets)
    loss.backward()
    return logits, loss, {name: p for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
def test_the_fused_model_is_as_close_to_float32_as_the_unfused(dtype):
    """Logits, loss and each parameter's gradient against the PyTorch backend in float32 (TE's
    attention has no float32): the fused path within its bf16 error of the unfused one. A
    gradient lost or sent to the wrong projection is off by order one."""
    ref_logits, ref_loss, ref_params = loss_and_grads(TORCH, torch.float32, autocast=False)
    errors = {}
    for backend in (TE, TE_UNFUSED):
        logits, loss, params = loss_and_grads(backend, dtype, autocast=True, weights=ref_params)
        assert params.keys() == ref_params.keys()
        errors[backend.packed_qkv] = {"logits": rel(logits, ref_logits), "loss": rel(loss, ref_loss),
                                      **{name: rel(p.grad, ref_params[name].grad) for name, p in params.items()}}
    fused, unfused = errors[True], errors[False]
    assert unfused["logits"] < 0.1 and unfused["loss"] < 0.05, unfused  # the reference is the same model
    for name, error in unfused.items():
        assert fused[name] <= 2 * error + 1e-2, (name, fused[name], error)


def test_training_with_the_fusions_passes_the_loss_check_against_without(tmp_path):
    reference, _ = train(tmp_path, "unfused", "loop", 1, "--te_fusions", "false")
    _, stdout = train(tmp_path, "fused", "loop", 1, "--loss-check", str(reference))
    assert "loss check passed" in stdout
