"""TE's fused permute (te_mixtral/distributed/te_permute.py) against the PyTorch one it stands
in for on the TE backend: the same rows to each expert, the same combined output, and the same
gradients for the tokens and for the routing weights (through which the router learns)."""

import pytest
import torch

from te_mixtral.distributed.dispatch import AllToAllDispatcher, TorchPermute
from te_mixtral.te_support import te_available

# Every test needs a GPU and TE but test_torch_backend_dispatches_with_torch_permute, which checks
# the PyTorch backend's wiring (and the helper the TE test uses) on the CPU.
on_te = pytest.mark.skipif(not (torch.cuda.is_available() and te_available()), reason="needs a CUDA GPU and TE")
TOKENS, HIDDEN, EXPERTS, TOP_K = 300, 64, 6, 2


def routed_inputs(dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x_TD = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(dtype).requires_grad_()
    scores = torch.rand(TOKENS, EXPERTS, device="cuda", generator=gen)
    scores[:, 5] -= 2  # the last expert gets no token: an empty group at the end of the sort
    weights_TK, experts_TK = torch.topk(scores.softmax(-1), TOP_K, dim=-1)
    return x_TD, experts_TK, (weights_TK / weights_TK.sum(-1, keepdim=True)).requires_grad_()


def round_trip(permute, x_TD, experts_TK, weights_TK):
    """Dispatch, an expert-dependent map of each row (a row sent to the wrong expert would be
    scaled wrongly), combine; the output, the rows as sorted, and the gradients."""
    dispatcher = AllToAllDispatcher(EXPERTS, 1, 0, None, permute)
    routed = dispatcher.dispatch(x_TD, experts_TK, weights_TK)
    expert_R = torch.repeat_interleave(torch.arange(EXPERTS, device="cuda"), routed.tokens_per_expert_L)
    y_RD = routed.x_RD * (1.0 + expert_R.to(routed.x_RD.dtype)).unsqueeze(1)
    out_TD = dispatcher.combine(y_RD, routed)
    grad_TD = torch.randn(out_TD.shape, dtype=out_TD.dtype, device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(5))
    x_grad, w_grad = torch.autograd.grad(out_TD, (x_TD, weights_TK), grad_TD)
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
