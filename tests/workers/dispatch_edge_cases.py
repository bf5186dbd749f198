"""torchrun worker: the all-to-all dispatcher on routings with empty experts and an idle rank,
step by step (dispatch, tier, combine) and overlapped in 1 to 4 chunks (`run`), where a chunk
asks for more chunks than there are tokens (4 of 3).

The "tier" multiplies each row by (global expert index + 1), so the expected output of a
token is x * sum_k w_k (expert_k + 1), and its input gradient is the same factor; the
routing weights' gradient is the row (expert_k + 1) * x summed over D.
A padded exchange too short for its routing: the copies that did not fit must come back with
a real row's output, never a padding row's, which a tier may fill with anything (NaN here):
the step is run again, but its outputs reach the next layers' routing and so the capacity it
runs again at, which would then change from run to run.
Last, the order in which the overlapped path launches and waits for its exchanges and runs
its experts, forward and backward: each chunk's experts must run between the launch and the
wait of its neighbour's exchange, or nothing is hidden (the results would still be right).
Exits non-zero on any mismatch.
"""

import torch
import torch.distributed as dist

from te_mixtral.distributed import dispatch
from te_mixtral.distributed.dispatch import AllToAllDispatcher
from te_mixtral.distributed.layout import init_layout, shutdown

EXPERTS, TOP_K, TOKENS, HIDDEN = 4, 2, 3, 5

layout = init_layout(ep_size=2, device="cpu", timeout_s=60)
local = EXPERTS // layout.ep_size
dispatchers = {chunks: AllToAllDispatcher(EXPERTS, layout.ep_size, layout.ep_group, chunks=chunks)
               for chunks in (1, 2, 4)}


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
def step_by_step(x_TD, experts_TK, weights_TK):
    dispatcher = dispatchers[1]
    routed = dispatcher.dispatch(x_TD, experts_TK, weights_TK)
    assert routed.x_RD.shape[0] == int(routed.tokens_per_expert_L.sum())
    return dispatcher.combine(scale_by_expert(routed.x_RD, routed.tokens_per_expert_L), routed)


def overlapped(chunks):
    return lambda x_TD, experts_TK, weights_TK: dispatchers[chunks].run(x_TD, experts_TK, weights_TK, scale_by_expert)


ways = {"step by step": step_by_step, **{f"{chunks} chunks": overlapped(chunks) for chunks in dispatchers}}
generator = torch.Generator().manual_seed(100 + layout.rank)
for name, routing in routings.items():
    experts_TK = routing(generator)
    weights = torch.rand(TOKENS, TOP_K, generator=generator)
    weights /= weights.sum(1, keepdim=True)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    factor_T = (weights * (experts_TK + 1.0)).sum(1, keepdim=True)
    for way, run in ways.items():
        x_TD, weights_TK = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y_TD = run(x_TD, experts_TK, weights_TK)
        torch.testing.assert_close(y_TD, x * factor_T, msg=f"{name}, {way}")
        y_TD.sum().backward()
        torch.testing.assert_close(x_TD.grad, factor_T.expand_as(x_TD), msg=f"{name}, {way}")
        torch.testing.assert_close(weights_TK.grad, (experts_TK + 1.0) * x.sum(1, keepdim=True), msg=f"{name}, {way}")
    dist.barrier()
    if layout.rank == 0:
        print(f"ok: {name}", flush=True)


def scale_and_fill_padding(x_RD, tokens_per_expert_L):
    """`scale_by_expert` over the real rows; NaN in the padding rows after them."""
    real = int(tokens_per_expert_L.sum())
    return torch.cat([scale_by_expert(x_RD[:real], tokens_per_expert_L), torch.full_like(x_RD[real:], float("nan"))])


# Every copy to rank 0's experts, a block of half of them: the copies past it are dropped, and the
# padding rank 1 sends back comes last.
short = AllToAllDispatcher(EXPERTS, layout.ep_size, layout.ep_group, capacity=1.0)
y_TD = short.run(torch.randn(TOKENS, HIDDEN, generator=generator), routings["idle rank"](generator),
                 torch.rand(TOKENS, TOP_K, generator=generator), scale_and_fill_padding)
assert short.take_needed() > 1.0 and y_TD.isfinite().all(), y_TD
dist.barrier()
if layout.rank == 0:
    print("ok: a short padded exchange", flush=True)


class Logged(dispatch._Exchange):
    """The real exchange, logging its launches and waits by the order it was made in."""
    made = 0

    def __init__(self, *args):
        super().__init__(*args)
        self.name, Logged.made = f"x{Logged.made}", Logged.made + 1

    def launch(self, *args):
        events.append(f"launch {self.name}")
        return super().launch(*args)

    def wait(self):
        events.append(f"wait {self.name}")
        super().wait()


class LoggedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, name):
        ctx.name = name
        events.append(f"experts {name}")
        return 2 * x_RD

    @staticmethod
    def backward(ctx, grad):
        events.append(f"experts' backward {ctx.name}")
        return 2 * grad, None


events = []
dispatch._Exchange = Logged
chunk_names = iter(("c0", "c1"))
x_TD = torch.randn(4, HIDDEN, requires_grad=True)
experts_TK = torch.rand(4, EXPERTS, generator=generator).argsort(1)[:, :TOP_K]
y_TD = dispatchers[2].run(x_TD, experts_TK, torch.rand(4, TOP_K),
                          lambda x_RD, _: LoggedExperts.apply(x_RD, next(chunk_names)))
events.append("backward")
y_TD.sum().backward()
# x0, x1: the chunks' dispatches; x2, x3: their returns.
want = ["launch x0", "launch x1", "wait x0", "experts c0", "launch x2", "wait x1", "experts c1", "launch x3",
        "wait x2", "wait x3", "backward",
        "launch x3", "launch x2", "wait x3", "experts' backward c1", "launch x1", "wait x2", "experts' backward c0",
        "launch x0", "wait x1", "wait x0"]
assert events == want, events
if layout.rank == 0:
    print("ok: overlap order", flush=True)
shutdown(wait_for_peers=True)
