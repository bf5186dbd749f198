"""What the MasterAdamW tests share: the error unit, bit views, and the weights, gradients
and clip factor they draw (tests/optim/test_master_adamw.py explains the unit U)."""

import io

import torch

U = 2.0**-23
CLIP = torch.tensor(0.37)  # a gradient scale as clipping passes it: not 1, so its path is exercised


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor's bits, for bit-for-bit comparisons."""
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(t.dtype, t.dtype))


def error_in_u(x: torch.Tensor, ref: torch.Tensor, lr: float) -> float:
    return ((x.double() - ref.double()).abs() / (U * (ref.double().abs() + lr))).max().item()


def fp32_weights(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02


def bf16_grads(steps: int, n: int, seed: int) -> list[torch.Tensor]:
    """Random fp32 gradients rounded to bf16: both optimizers see the same values."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 1e-3).bfloat16() for _ in range(steps)]


def save_and_resume(make, step, grads: list[torch.Tensor], at: int):
    """`make()` gives (parameters, optimizer); `step(params, optimizer, g)` steps them. One is
    stepped on grads[:at] and saved as a run would be (torch.save of its parameters and
    state_dict), and a fresh `make()` loads that: ((params, optimizer), (resumed params,
    resumed optimizer)), for the caller to compare and step on."""
    ps, opt = make()
    for g in grads[:at]:
        step(ps, opt, g)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in ps], "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed_ps, resumed = make()
    with torch.no_grad():
        for p, value in zip(resumed_ps, saved["params"]):
            p.copy_(value)
    resumed.load_state_dict(saved["optimizer"])
    return (ps, opt), (resumed_ps, resumed)
