"""TE's fused permute (te_mixtral/distributed/te_permute.py) against the PyTorch one it stands
in for on the TE backend: the same rows to each expert, the same combined output, and the same
gradients for the tokens and for the routing weights (through which the router learns), the
latter also against a float64 reference, for both permutes (the PyTorch one on the CPU too)."""

import pytest
import torch

from te_mixtral.distributed.dispatch import AllToAllDispatcher, TorchPermute
from te_mixtral.te_support import te_available

# Every test needs a GPU and TE but test_torch_backend_dispatches_with_torch_permute, which checks
# the PyTorch backend's wiring (and the helper the TE test uses) on the CPU, and the CPU case of
# test_routing_weight_gradient_against_float64.
on_te = pytest.mark.skipif(not (torch.cuda.is_available() and te_available()), reason="needs a CUDA GPU and TE")
TOKENS, HIDDEN, EXPERTS, TOP_K = 300, 64, 6, 2


def routed_inputs(dtype, seed, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x_TD = torch.randn(TOKENS, HIDDEN, device=device, generator=gen).to(dtype).requires_grad_()
    scores = torch.rand(TOKENS, EXPERTS, device=device, generator=gen)
    scores[:, 5] -= 2  # the last expert gets no token: an empty group at the end of the sort
    weights_TK, experts_TK = torch.topk(scores.softmax(-1), TOP_K, dim=-1)
    return x_TD, experts_TK, (weights_TK / weights_TK.sum(-1, keepdim=True)).requires_grad_()


def output_gradient(out_TD):
    """The gradient the round trip's output receives (the same for every run)."""
    device = out_TD.device
    return torch.randn(out_TD.shape, dtype=out_TD.dtype, device=device,
                       generator=torch.Generator(device=device).manual_seed(5))


def round_trip(permute, x_TD, experts_TK, weights_TK):
    """Dispatch, an expert-dependent map of each row (a row sent to the wrong expert would be
    scaled wrongly), combine; the output, the rows as sorted, and the gradients of the inputs
    that need one (None for one that does not)."""
    dispatcher = AllToAllDispatcher(EXPERTS, 1, None, permute)
    routed = dispatcher.dispatch(x_TD, experts_TK, weights_TK)
    expert_R = torch.repeat_interleave(torch.arange(EXPERTS, device=x_TD.device), routed.tokens_per_expert_L)
    y_RD = routed.x_RD * (1.0 + expert_R.to(routed.x_RD.dtype)).unsqueeze(1)
    out_TD = dispatcher.combine(y_RD, routed)
    wanted = [t for t in (x_TD, weights_TK) if t.requires_grad]
    grads = iter(torch.autograd.grad(out_TD, wanted, output_gradient(out_TD)))
    x_grad, w_grad = (next(grads) if t.requires_grad else None for t in (x_TD, weights_TK))
    return out_TD, routed, x_grad, w_grad


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.cuda
@on_te
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_te_permute_equals_torch_permute(dtype, tol):
    from te_mixtral.distributed.te_permute import TEPermute

    inputs = routed_inputs(dtype, seed=3)
    out_te, routed_te, x_grad_te, w_grad_te = round_trip(TEPermute(), *inputs)
    out, routed, x_grad, w_grad = round_trip(TorchPermute(), *inputs)
    assert torch.equal(routed_te.tokens_per_expert_L, routed.tokens_per_expert_L)
    assert out_te.dtype == out.dtype == dtype
    # Both weight in float32 and round once; bf16 may round the sum of two rows apart.
    assert rel(out_te, out) < tol
    assert rel(x_grad_te, x_grad) < tol
    assert rel(w_grad_te, w_grad) < tol


def te_permute():
    from te_mixtral.distributed.te_permute import TEPermute

    return TEPermute()


@pytest.mark.parametrize("rows_need_grad", [True, False], ids=["trained-rows", "frozen-rows"])
@pytest.mark.parametrize("make_permute, device", [
    (TorchPermute, "cpu"),
    pytest.param(te_permute, "cuda", marks=[pytest.mark.cuda, on_te]),
], ids=["torch-cpu", "te-cuda"])
def test_routing_weight_gradient_against_float64(make_permute, device, rows_need_grad):
    """The combine out_t = sum_k w_tk * f(x_t, e_tk), where round_trip's experts compute
    f(x, e) = (1 + e) x, gives d(loss)/d(w_tk) = <d(loss)/d(out_t), (1 + e_tk) x_t>, the
    router's only way to learn from the LM loss. It must come whether or not the expert rows
    need a gradient themselves (frozen experts and inputs: TE's unpermute computed the weights'
    gradient only along with the rows')."""
    x_TD, experts_TK, weights_TK = routed_inputs(torch.float32, seed=6, device=device)
    x_TD.requires_grad_(rows_need_grad)
    out_TD, _, _, w_grad = round_trip(make_permute(), x_TD, experts_TK, weights_TK)
    rows_TKD = x_TD.detach().double().unsqueeze(1) * (1.0 + experts_TK.double()).unsqueeze(-1)
    want_TK = (rows_TKD * output_gradient(out_TD).double().unsqueeze(1)).sum(-1)
    assert w_grad is not None and w_grad.shape == want_TK.shape
    assert rel(w_grad, want_TK) < 1e-6


@pytest.mark.cuda
@on_te
def test_te_permute_sorts_rows_in_the_same_order():
    """A stable sort both ways: each expert's rows in token order, so TE and PyTorch runs route
    identically."""
    from te_mixtral.distributed.te_permute import TEPermute

    x_TD, experts_TK, _ = routed_inputs(torch.float32, seed=4)
    sorted_te, _ = TEPermute().sort(x_TD, experts_TK)
    sorted_torch, _ = TorchPermute().sort(x_TD, experts_TK)
    assert torch.equal(sorted_te, sorted_torch)


@pytest.mark.cuda
@on_te
def test_te_backend_dispatches_with_te_permute():
    from te_mixtral.distributed.te_permute import TEPermute
    from te_mixtral.model.layers import TE

    assert {type(p) for p in tiny_model_permutes(TE, "cuda")} == {TEPermute}


def test_torch_backend_dispatches_with_torch_permute():
    from te_mixtral.model.layers import TORCH

    assert {type(p) for p in tiny_model_permutes(TORCH, "cpu")} == {TorchPermute}


def tiny_model_permutes(backend, device):
    """The local permute of every layer's dispatcher in configs/tiny.yaml's model."""
    from conftest import REPO

    from te_mixtral.config import load_config
    from te_mixtral.distributed.layout import Layout
    from te_mixtral.experts.loop import LoopTier
    from te_mixtral.model.mixtral import MixtralForCausalLM

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {})
    with torch.device(device):
        model = MixtralForCausalLM(cfg.model, backend, Layout(0, 1, 1, None, None), LoopTier())
    return [layer.mlp.dispatcher.permute for layer in model.model.layers]
