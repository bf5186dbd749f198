"""The op profile's step and host profile on the CPU (its kernel table needs a GPU): a step is
fwd+bwd then the optimizer's step, and the host profile counts per step."""

import torch

from benchmarks.op_profile import CPROFILE_STEPS, host_profile, make_step
from te_mixtral.experts.custom_grouped import grouped_mm_swiglu


def test_a_step_is_fwd_bwd_then_the_optimizer_step():
    generator = torch.Generator().manual_seed(0)
    sizes, D, F = [3, 5], 16, 24
    x = torch.randn(8, D, generator=generator, requires_grad=True)
    w1 = torch.randn(2, 2 * F, D, generator=generator, requires_grad=True)
    w2 = torch.randn(2, D, F, generator=generator, requires_grad=True)
    dy = torch.randn(8, D, generator=generator)
    seen, stepped = [], []

    def op(x, counts, w1, w2):
        seen.append(x)
        return grouped_mm_swiglu(x, counts, w1, w2)

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    optimizer.register_step_post_hook(lambda *_: stepped.append(len(seen)))
    inputs = (x, torch.tensor(sizes), w1, w2, dy)
    make_step(op, inputs, optimizer)()
    make_step(op, inputs, optimizer)()
    make_step(op, inputs, None)()
    assert len(seen) == 3 and stepped == [1, 2]  # each optimizer step after its fwd+bwd

    rows = host_profile(make_step(op, inputs, None), torch.device("cpu"), top=10**6)
    assert len(seen) == 3 + CPROFILE_STEPS
    mine = [r for r in rows if r["function"].startswith("test_op_profile.py:") and r["function"].endswith("(op)")]
    assert len(mine) == 1 and mine[0]["calls"] == 1  # per step
    assert [r["own_ms"] for r in rows] == sorted((r["own_ms"] for r in rows), reverse=True)
    assert all(r["cum_ms"] >= r["own_ms"] for r in rows)
