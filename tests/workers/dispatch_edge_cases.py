"""torchrun worker: the all-to-all dispatcher on routings with empty experts and an idle rank.

The "tier" multiplies each row by (global expert index + 1), so the expected output of a
token is x * sum_k w_k (expert_k + 1), and its input gradient is the same factor.
Exits non-zero on any mismatch.
"""

import torch
import torch.distributed as dist

from te_mixtral.distributed.dispatch import AllToAllDispatcher
from te_mixtral.distributed.layout import init_layout, shutdown

EXPERTS, TOP_K, TOKENS, HIDDEN = 4, 2, 6, 5

layout = init_layout(ep_size=2, device="cpu", timeout_s=60)
local = EXPERTS // layout.ep_size
dispatcher = AllToAllDispatcher(EXPERTS, layout.ep_size, layout.ep_rank, layout.ep_group)


def scale_by_expert(x_RD, tokens_per_expert_L):
    factor_R = torch.repeat_interleave(torch.arange(local) + layout.ep_rank * local + 1.0, tokens_per_expert_L)
    return x_RD * factor_R[:, None]


routings = {
    # every copy goes to rank 0's experts: rank 1 receives no rows at all
    "idle rank": lambda g: torch.stack([torch.zeros(TOKENS), torch.ones(TOKENS)], 1).long(),
    # experts 1 and 2 get nothing
    "empty experts": lambda g: torch.stack([torch.zeros(TOKENS), torch.full((TOKENS,), 3)], 1).long(),
    "random": lambda g: torch.rand(TOKENS, EXPERTS, generator=g).argsort(1)[:, :TOP_K],
}
generator = torch.Generator().manual_seed(100 + layout.rank)
for name, routing in routings.items():
    experts_TK = routing(generator)
    weights_TK = torch.rand(TOKENS, TOP_K, generator=generator)
    weights_TK /= weights_TK.sum(1, keepdim=True)
    x_TD = torch.randn(TOKENS, HIDDEN, generator=generator, requires_grad=True)

    routed = dispatcher.dispatch(x_TD, experts_TK, weights_TK)
    assert routed.x_RD.shape[0] == int(routed.tokens_per_expert_L.sum()), name
    y_TD = dispatcher.combine(scale_by_expert(routed.x_RD, routed.tokens_per_expert_L), routed)
    factor_T = (weights_TK * (experts_TK + 1.0)).sum(1, keepdim=True)
    torch.testing.assert_close(y_TD, x_TD * factor_T, msg=name)
    y_TD.sum().backward()
    torch.testing.assert_close(x_TD.grad, factor_T.expand_as(x_TD), msg=name)
    dist.barrier()
    if layout.rank == 0:
        print(f"ok: {name}", flush=True)
shutdown(wait_for_peers=True)
