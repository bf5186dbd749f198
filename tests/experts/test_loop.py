"""The `loop` tier against a float64 reference, and what its backward allocates."""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from te_mixtral.experts.loop import LoopTier


def reference_f64(x_RD, counts, gate_up_L2FD, down_LDF):
    """Row by row in float64: the plainest statement of the expert FFN."""
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    rows = []
    for x_D, e in zip(x_RD.double(), expert_of_row):
        gate_up = gate_up_L2FD[e].double() @ x_D
        gate, up = gate_up.chunk(2)
        rows.append(down_LDF[e].double() @ (F.silu(gate) * up))
    return torch.stack(rows)


def random_problem(experts=5, hidden=24, ffn=40, counts=(3, 0, 7, 1, 0)):
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), hidden, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * ffn, hidden) / hidden**0.5).requires_grad_()
    down = (torch.randn(experts, hidden, ffn) / ffn**0.5).requires_grad_()
    return x, counts, gate_up, down


def test_loop_matches_float64_reference():
    x, counts, gate_up, down = random_problem()
    y = LoopTier()(x, counts, gate_up, down)
    y_ref = reference_f64(x, counts, gate_up, down)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)

    grad_out = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, gate_up, down), grad_out)
    want = torch.autograd.grad(y_ref, (x, gate_up, down), grad_out.double())
    for g, w in zip(got, want):
        # Weight gradients sum over rows in fp32: an element that cancels to near zero keeps the
        # rounding of its largest terms, so the absolute tolerance scales with the tensor's size
        # (over 300 seeds the worst error was 7e-7 of the largest element).
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-5 * w.abs().max().item())
    assert got[1][1].abs().sum() == 0 and got[1][4].abs().sum() == 0  # zero-token experts: zero gradient


class AllocationCounter(TorchDispatchMode):
    """Counts the new tensors of a given shape that aten ops create (aliases such as
    `detach` share their input's storage and are not counted)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = torch.Size(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        self.count += sum(isinstance(t, torch.Tensor) and t.shape == self.shape
                          and t.untyped_storage().data_ptr() not in inputs for t in tree_flatten(out)[0])
        return out


def stacked_size_allocations_in_backward(tier, experts=8):
    x, counts, gate_up, down = random_problem(experts=experts, counts=[4] * experts)
    y = tier(x, counts, gate_up, down)
    with AllocationCounter(gate_up.shape) as counter:
        y.sum().backward()
    return counter.count


def test_loop_backward_allocates_one_stacked_gradient():
    assert stacked_size_allocations_in_backward(LoopTier()) == 1


def test_indexing_per_expert_would_allocate_one_per_expert():
    """The pitfall the loop avoids, measured the same way (so the counter can fail)."""

    def indexing_loop(x_RD, counts, gate_up_L2FD, down_LDF):
        chunks = x_RD.split(counts.tolist())
        return torch.cat([F.linear(F.silu(F.linear(x, gate_up_L2FD[e]).chunk(2, -1)[0]) *
                                   F.linear(x, gate_up_L2FD[e]).chunk(2, -1)[1], down_LDF[e])
                          for e, x in enumerate(chunks)])

    assert stacked_size_allocations_in_backward(indexing_loop, experts=8) >= 8
