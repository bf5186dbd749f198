"""The `loop` tier: one `F.linear` per local expert, in a Python loop.

This is the teaching baseline and the reference every faster tier is tested against, so
it stays simple. It has one trap worth knowing about.

Pitfall: indexing a stacked parameter per expert (`gate_up_L2FD[e]`) makes autograd build,
in the backward of *each* index, a zero-filled tensor of the full stacked size and add
them up: L stacked-size allocations and L full-size adds per weight, per layer, which with
few tokens per expert made the loop several times slower than a grouped GEMM (measured:
docs/results/2026-11-21-checks-behind-tolerances.md). `unbind` instead has one backward
that stacks the L per-expert gradients once: about one stacked-size gradient in total
(tests/experts/test_loop.py measures it).

`tokens_per_expert_L.tolist()` synchronises with the host: the loop needs Python ints to
slice, which is exactly the cost the grouped tiers remove.

Shape suffixes: see te_mixtral/__init__.py.
"""

import torch
import torch.nn.functional as F

from te_mixtral.experts.adapters import with_adapter
from te_mixtral.experts.base import ExpertTier, swiglu


class LoopTier(ExpertTier):
    name = "loop"  # plain PyTorch: the default check_available (runs everywhere) holds
    takes_adapters = True

    def __call__(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
        splits = tokens_per_expert_L.tolist()

        def matmul(x_RI, w_LNI):  # x_RI @ w_LNI[e].T over each expert's rows
            return torch.cat([F.linear(x_NI, w_NI) for x_NI, w_NI in zip(x_RI.split(splits), w_LNI.unbind(0))])

        act_RF = swiglu(with_adapter(matmul(x_RD, gate_up_L2FD), adapters, "gate_up", x_RD, matmul))
        return with_adapter(matmul(act_RF, down_LDF), adapters, "down", act_RF, matmul)
