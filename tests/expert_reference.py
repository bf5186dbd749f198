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


def check_micro_batches_add_into_grad(op, micro_batches, gate_up_L2FD, down_LDF, monkeypatch):
    """Train-style gradient accumulation through `op(x, counts, gate_up, down)`: one
    `.backward()` per micro-batch (x_RD, tokens_per_expert_L, dy_RD) into the weights' `.grad`
    (kernels/grad_accumulation.py). Checks, in float32 under Triton's interpreter:

    - the first micro-batch writes a new gradient, every later one adds into `.grad` in the
      weight-gradient kernel (seen by wrapping `wgrad_gemm` where the ops call it), and
      `.grad` stays one tensor throughout (no copy);
    - the post-accumulate hooks fire after each micro-batch and see the running sum;
    - the sum equals, bit for bit, the micro-batches' gradients taken one by one with
      `torch.autograd.grad` and added by torch, and lies within float32 rounding of float64;
    - `torch.autograd.grad` while `.grad` holds a sum leaves it alone (the kernel writes a
      new tensor), and so does a tensor hook on the weight, which must see this micro-batch's
      gradient, not the sum.
    """
    from te_mixtral.experts.kernels import grouped_swiglu, scaled_grouped_mm, wgrad_gemm

    adds = []

    def spy(*args, accumulate=False, **kwargs):
        adds.append(accumulate)
        return wgrad_gemm.wgrad_gemm(*args, accumulate=accumulate, **kwargs)

    for module in (grouped_swiglu, scaled_grouped_mm):
        monkeypatch.setattr(module, "wgrad_gemm", spy)
    weights = [torch.nn.Parameter(w.detach().clone()) for w in (gate_up_L2FD, down_LDF)]

    def micro_batch_grads(x, counts, dy):
        return torch.autograd.grad(op(x, counts, *weights), weights, dy)

    one_by_one = [micro_batch_grads(*batch) for batch in micro_batches]
    assert not any(adds) and all(w.grad is None for w in weights)
    expected = [one_by_one[0][i] for i in range(2)]
    for grads in one_by_one[1:]:
        expected = [e + g for e, g in zip(expected, grads)]
    f64 = [sum(reference_f64(x, counts.tolist(), *weights, dy)[2 + i] for x, counts, dy in micro_batches)
           for i in range(2)]

    seen = []
    for w in weights:
        w.register_post_accumulate_grad_hook(lambda w: seen.append(w.grad.clone()))
    adds.clear()
    for n, (x, counts, dy) in enumerate(micro_batches):
        op(x, counts, *weights).backward(dy)
        if n == 0:
            buffers = [w.grad.data_ptr() for w in weights]
    assert adds[:2] == [False, False] and adds[2:] and all(adds[2:])  # (an op may skip a batch without rows)
    assert [w.grad.data_ptr() for w in weights] == buffers
    for w, e, ref in zip(weights, expected, f64):
        assert torch.equal(w.grad, e)
        assert rel_err(w.grad, ref) < 1e-5
    assert len(seen) == 2 * len(micro_batches) and torch.equal(seen[-1], expected[1])

    summed = [w.grad.clone() for w in weights]
    adds.clear()
    again = micro_batch_grads(*micro_batches[0])
    hooked = []
    weights[0].register_hook(lambda g: hooked.append(g.clone()))
    op(*micro_batches[0][:2], *weights).backward(micro_batches[0][2])
    assert adds == [False, False, True, False]  # autograd.grad's two, then down adds, gate_up not
    assert all(torch.equal(a, b) for a, b in zip(again, one_by_one[0]))
    assert torch.equal(hooked[0], one_by_one[0][0])
    assert torch.equal(weights[0].grad, summed[0] + one_by_one[0][0])
    assert torch.equal(weights[1].grad, summed[1] + one_by_one[0][1])


def accumulated_and_summed_grads(op, micro_batches, gate_up_L2FD, down_LDF):
    """For both weights: `.grad` after one `.backward()` per micro-batch (x_RD,
    tokens_per_expert_L, dy_RD) through `op(x, counts, gate_up, down)`, where the op may add
    into `.grad` itself, and the micro-batches' gradients from `torch.autograd.grad` (where
    it cannot) summed in float64."""
    weights = [torch.nn.Parameter(w.detach().clone()) for w in (gate_up_L2FD, down_LDF)]
    summed = [torch.zeros(w.shape, dtype=torch.float64, device=w.device) for w in weights]
    for x, counts, dy in micro_batches:
        for total, grad in zip(summed, torch.autograd.grad(op(x, counts, *weights), weights, dy)):
            total += grad.double()
    for x, counts, dy in micro_batches:
        op(x, counts, *weights).backward(dy)
    return [w.grad for w in weights], summed


def random_adapters(splits, D, F, rank, seed, device="cpu", dtype=torch.float32, targets=("gate_up", "down")):
    """Fresh random LoRA adapters for the experts (B too, so that every A gets a gradient):
    {"gate_up": (A [L, r, D], B [L, 2F, r]), "down": (A [L, r, F], B [L, D, r])} for `targets`."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = {"gate_up": (D, 2 * F), "down": (F, D)}
    L = len(splits)
    return {name: (torch.randn(L, rank, shapes[name][0], generator=g, device=device).to(dtype) / shapes[name][0] ** 0.5,
                   torch.randn(L, shapes[name][1], rank, generator=g, device=device).to(dtype) * 0.1)
            for name in targets}


def reference_lora_f64(x_RD, splits, gate_up_L2FD, down_LDF, adapters, scale, dy_RD):
    """y and the gradients of x and of every adapter tensor (in `adapters`' order, A then B),
    in float64, one expert at a time by plain autograd, the base weights frozen."""
    x = x_RD.detach().double().requires_grad_()
    pairs = {name: tuple(t.detach().double().requires_grad_() for t in pair) for name, pair in adapters.items()}
    gate_up, down = gate_up_L2FD.double(), down_LDF.double()

    def project(name, x_NI, weight, e):
        out = x_NI @ weight[e].T
        if name in pairs:
            a, b = pairs[name]
            out = out + scale * (x_NI @ a[e].T) @ b[e].T
        return out

    outputs = []
    for e, x_ND in enumerate(x.split(splits)):
        gate_NF, up_NF = project("gate_up", x_ND, gate_up, e).chunk(2, dim=-1)
        outputs.append(project("down", F.silu(gate_NF) * up_NF, down, e))
    y = torch.cat(outputs)
    leaves = [x, *(t for pair in pairs.values() for t in pair)]
    return (y.detach(), *torch.autograd.grad(y, leaves, dy_RD.double()))
