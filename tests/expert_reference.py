"""What every tier's accuracy test shares: the splits, fresh random inputs, a way to run a
tier on them, and the float64 expert-FFN reference it is compared against."""

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


def reference_f64(x_RD, splits, gate_up_L2FD, down_LDF, dy_RD):
    """y and (dx, d_gate_up, d_down) in float64, one expert at a time, by plain autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x_RD, gate_up_L2FD, down_LDF)]
    x, gate_up, down = leaves
    outputs = []
    for e, x_ND in enumerate(x.split(splits)):
        gate_NF, up_NF = (x_ND @ gate_up[e].T).chunk(2, dim=-1)
        outputs.append((F.silu(gate_NF) * up_NF) @ down[e].T)
    y = torch.cat(outputs)
    return (y.detach(), *torch.autograd.grad(y, leaves, dy_RD.double()))


def random_expert_inputs(splits, D, F, seed, dtype=torch.bfloat16, param_dtype=None):
    """Fresh random (never zero) CUDA inputs: x_RD, tokens_per_expert_L, gate_up_L2FD,
    down_LDF, dy_RD; weights scaled by 1/sqrt(fan-in), in `param_dtype` (default `dtype`)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0, dtype_=dtype):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(dtype_)

    E, R = len(splits), sum(splits)
    param_dtype = param_dtype or dtype
    return (randn(R, D), torch.tensor(splits, dtype=torch.int64, device="cuda"),
            randn(E, 2 * F, D, scale=D**-0.5, dtype_=param_dtype), randn(E, D, F, scale=F**-0.5, dtype_=param_dtype),
            randn(R, D))


def poison_free_memory():
    """Fill some freed allocator blocks with NaN and free them again, so a tier's
    `torch.empty` outputs start as NaN rather than stale valid numbers. The caching
    allocator keeps blocks of up to 1 MiB in a pool of their own, hence the small ones too."""
    nan = float("nan")
    blocks = [torch.full((2**26,), nan, device="cuda")]  # 256 MiB
    blocks += [torch.full((2**17,), nan, device="cuda") for _ in range(64)]  # 512 KiB each
    del blocks
    torch.cuda.synchronize()


def run_tier(tier, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, dy_RD, autocast=False):
    """y and (dx, d_gate_up, d_down) of `tier` on fresh leaves, into NaN-poisoned memory."""
    leaves = [t.detach().clone().requires_grad_() for t in (x_RD, gate_up_L2FD, down_LDF)]
    x, gate_up, down = leaves
    poison_free_memory()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = tier(x, tokens_per_expert_L, gate_up, down)
    return (y, *torch.autograd.grad(y, leaves, dy_RD))


def rel_err(out, ref):
    """Relative error of `out` against a float64 reference, in the Frobenius norm."""
    return ((out.double() - ref).norm() / ref.norm()).item()
