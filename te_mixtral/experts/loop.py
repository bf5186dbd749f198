"""The `loop` tier: one `F.linear` per local expert, in a Python loop.

This is the teaching baseline and the reference every faster tier is tested against, so
it stays simple. It has one trap worth knowing about.

Pitfall: indexing a stacked parameter per expert (`gate_up_E2FD[e]`) makes autograd build,
in the backward of *each* index, a zero-filled tensor of the full stacked size and add
them up: E stacked-size allocations and E full-size adds per weight, per layer. At 64 tokens
per expert that made a loop 3x slower than a grouped GEMM on an H100. `unbind` instead has
one backward that stacks the E per-expert gradients once: about one stacked-size gradient
in total (tests/test_loop_tier.py measures it).

`tokens_per_expert_E.tolist()` synchronises with the host: the loop needs Python ints to
slice, which is exactly the cost the grouped tiers remove.
"""

import torch
import torch.nn.functional as F

from te_mixtral.experts.base import swiglu


class LoopTier:
    name = "loop"

    def check_available(self, device: torch.device) -> None:
        pass  # plain PyTorch: runs everywhere

    def __call__(self, x_RD, tokens_per_expert_E, gate_up_E2FD, down_EDF):
        gate_ups = gate_up_E2FD.unbind(0)
        downs = down_EDF.unbind(0)
        outputs = []
        for x_ND, gate_up_2FD, down_DF, in zip(x_RD.split(tokens_per_expert_E.tolist()), gate_ups, downs):
            outputs.append(F.linear(swiglu(F.linear(x_ND, gate_up_2FD)), down_DF))
        return torch.cat(outputs)
