"""The float64 expert-FFN reference that every tier's accuracy test compares against."""

import torch
import torch.nn.functional as F

# Splits of rows over 4 experts that GPU tier tests share: uneven, empty experts first,
# in the middle and last, all rows on one expert.
GPU_SPLITS = {
    "uneven": [1, 37, 300, 94],
    "zero_first": [0, 200, 5, 3],
    "zero_middle": [64, 0, 0, 129],
    "zero_last": [50, 77, 13, 0],
    "one_expert": [0, 0, 256, 0],
}


def reference_f64(x_RD, splits, gate_up_E2FD, down_EDF, dy_RD):
    """y and (dx, d_gate_up, d_down) in float64, one expert at a time, by plain autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x_RD, gate_up_E2FD, down_EDF)]
    x, gate_up, down = leaves
    outputs = []
    for e, x_ND in enumerate(x.split(splits)):
        gate_NF, up_NF = (x_ND @ gate_up[e].T).chunk(2, dim=-1)
        outputs.append((F.silu(gate_NF) * up_NF) @ down[e].T)
    y = torch.cat(outputs)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy_RD.double()))
