"""MasterAdamW's Triton kernel (te_mixtral/optim/adamw_kernel.py) against its torch path.

The kernel is checked bit for bit by running this file's `interpreter` tests in a subprocess
with TRITON_INTERPRET=1 (the interpreter must be on before triton is first imported); run
directly, those tests are skipped. On a GPU the kernel may fuse multiply-adds, so there it
is checked within an ulp (`cuda`). Units: see test_master_adamw.py.
"""

import os

import pytest
import torch
from adamw_reference import CLIP, U, bf16_grads, bits, error_in_u, fp32_weights
from background import assert_passed, interpreter_run

from te_mixtral.optim import MasterAdamW
from te_mixtral.optim.adamw_torch import (
    StepScalars,
    adamw_update_8bit_torch,
    adamw_update_torch,
)
from te_mixtral.optim.bits import join_master, split_master
from te_mixtral.optim.moments8 import (
    BLOCK,
    EXP_AVG,
    SQRT_EXP_AVG_SQ,
    dequantize,
    quantize,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")


def kernel_case(n: int, grad_dtype, moment_dtype, seed: int):
    """Random state with special values: NaN/inf gradients, inf and NaN parameters."""
    gen = torch.Generator().manual_seed(seed)
    param_bits, remainder = split_master(torch.randn(n, generator=gen))
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    m = (torch.randn(n, generator=gen) * 1e-2).to(moment_dtype)
    v = (torch.rand(n, generator=gen) * 1e-4).to(moment_dtype)
    if n > 8:
        grad[3], grad[4] = float("nan"), float("inf")
        master = join_master(param_bits, remainder)
        master[5], master[6], master[7] = float("inf"), float("nan"), torch.finfo(torch.float32).max
        param_bits, remainder = split_master(master)
    return [param_bits.view(torch.bfloat16), remainder, grad, m, v]


@interpreter_only
@pytest.mark.parametrize("n", [0, 1, 7, 2047, 2049, 5001])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32])
def test_interpreter_kernel_equals_torch_path(n, grad_dtype, moment_dtype):
    from te_mixtral.optim.adamw_kernel import adamw_update_triton

    assert_same_bits_after_three_steps(kernel_case(n, grad_dtype, moment_dtype, seed=n), adamw_update_torch,
                                       adamw_update_triton)


def assert_same_bits_after_three_steps(case, torch_update, kernel_update) -> None:
    """Both paths from `case`, steps 1, 2 and 9 in a row: every tensor the same bits."""
    by_torch, by_kernel = [t.clone() for t in case], [t.clone() for t in case]
    for step in (1, 2, 9):
        scalars = StepScalars.for_step(3e-3, 0.1, 0.9, 0.999, 1e-8, step)
        torch_update(*by_torch, scalars, CLIP)
        kernel_update(*by_kernel, scalars, CLIP)
    for x, y in zip(by_torch, by_kernel):
        assert torch.equal(bits(x), bits(y))


def kernel_case_8bit(blocks: int, grad_dtype, seed: int):
    """`kernel_case`'s parameter and gradient (NaN, inf) with random 8-bit moments over many
    binades, a block of zero moments and one whose moments are far below the smallest scale."""
    param, remainder, grad, m, v = kernel_case(blocks * BLOCK, grad_dtype, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    spread = torch.exp(torch.randn(blocks, 1, generator=gen) * 8).expand(-1, BLOCK).reshape(-1)
    m, sqrt_v = m * spread, v.sqrt() * spread
    if blocks > 2:
        m[BLOCK:2 * BLOCK], sqrt_v[BLOCK:2 * BLOCK] = 0.0, 0.0
        m[2 * BLOCK:3 * BLOCK] *= 1e-35
        sqrt_v[2 * BLOCK:3 * BLOCK] *= 1e-35
    return [param, remainder, grad, *quantize(m, EXP_AVG), *quantize(sqrt_v, SQRT_EXP_AVG_SQ)]


@interpreter_only
@pytest.mark.parametrize("blocks", [0, 1, 3, 8, 9, 21])  # a program takes 8 blocks
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_interpreter_8bit_kernel_equals_torch_path(blocks, grad_dtype):
    from te_mixtral.optim.adamw_kernel import adamw_update_8bit_triton

    assert_same_bits_after_three_steps(kernel_case_8bit(blocks, grad_dtype, seed=blocks), adamw_update_8bit_torch,
                                       adamw_update_8bit_triton)


@interpreter_only
def test_interpreter_optimizer_impls_agree():
    w = fp32_weights(3000, 14)
    shapes = [(7, 100), (0,), (3, 7, 31), (17,)]
    results = []
    for impl in ("torch", "triton"):
        params, start = [], 0
        for shape in shapes:
            size = torch.Size(shape).numel()
            params.append(torch.nn.Parameter(w[start:start + size].view(shape).clone()))
            start += size
        experts = torch.nn.Parameter(w[:4 * BLOCK].view(2, 2 * BLOCK).clone())  # in a group with 8-bit moments
        opt = MasterAdamW.from_fp32([{"params": params}, {"params": [experts], "moments_8bit": True}], lr=1e-3,
                                    moment_dtype=torch.bfloat16, impl=impl)
        params.append(experts)
        for g in bf16_grads(3, start + 4 * BLOCK, 15):
            offset = 0
            for p in params:
                p.grad, offset = g[offset:offset + p.numel()].view(p.shape), offset + p.numel()
            opt.step()
        results.append([bits(opt.master(p)) for p in params] + [bits(t) for t in opt.state[experts].values()])
    assert all(torch.equal(x, y) for x, y in zip(*results))


INTERPRETER_RUN = interpreter_run(__file__)
PLANNED_COMMANDS = [INTERPRETER_RUN]  # run from the session's start (conftest.py's planned_command)


@pytest.mark.skipif(INTERPRETING, reason="this is the launcher")
def test_triton_kernel_in_interpreter(planned_command):
    pytest.importorskip("triton")
    assert_passed(planned_command(INTERPRETER_RUN)[0], __file__)


def one_step_each_on_cuda(case, torch_update, kernel_update, lr: float = 3e-3):
    """For step numbers 1, 2 and 9: (torch path's tensors, kernel's) after one step each from
    `case`, their masters checked within 4 U of each other (a fused multiply-add's ulp)."""
    for step in (1, 2, 9):
        by_torch, by_kernel = [t.clone() for t in case], [t.clone() for t in case]
        scalars = StepScalars.for_step(lr, 0.1, 0.9, 0.999, 1e-8, step)
        torch_update(*by_torch, scalars, CLIP.cuda())
        kernel_update(*by_kernel, scalars, CLIP.cuda())
        masters = [join_master(p.view(torch.int16), r) for p, r, *_ in (by_torch, by_kernel)]
        finite = masters[0].isfinite()
        assert torch.equal(finite, masters[1].isfinite())
        assert error_in_u(masters[1][finite], masters[0][finite], lr) <= 4
        yield by_torch, by_kernel


@pytest.mark.cuda
@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_matches_torch_path(moment_dtype):
    """One step from the same state, at several step numbers. On the GPU the kernel may fuse
    multiply-adds, so masters can differ from the torch path by about an ulp of the weight
    or the update, and moments by an ulp of their dtype (more where m nearly cancels). (Over several steps bf16 moments
    that rounded differently once make the paths drift apart, so each step starts afresh.)"""
    from te_mixtral.optim.adamw_kernel import adamw_update_triton

    case = [t.cuda() for t in kernel_case(1 << 20, torch.bfloat16, moment_dtype, seed=16)]
    for by_torch, by_kernel in one_step_each_on_cuda(case, adamw_update_torch, adamw_update_triton):
        for x, y in zip(by_torch[3:], by_kernel[3:]):  # m near cancellation: atol
            atol = 8 * U * x[x.isfinite()].abs().max().item()
            rtol = 2**-7 if moment_dtype == torch.bfloat16 else 4 * U
            torch.testing.assert_close(y, x, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.xfail(strict=True, reason="on an H200 the kernel's masters differed from the torch path's by more than "
                   "4 U (docs/results/2026-11-28-8bit-expert-moments.md): training refuses expert_moments 8bit on "
                   "CUDA until this passes")
def test_cuda_8bit_kernel_matches_torch_path():
    """As above with 8-bit moments, one step from the same state: a fused multiply-add may move
    a new moment by an fp32 ulp, and with it across a rounding boundary of the format, so the
    moments read back may differ by one code step; the masters by a few U."""
    from te_mixtral.optim.adamw_kernel import adamw_update_8bit_triton

    case = [t.cuda() for t in kernel_case_8bit(1 << 12, torch.bfloat16, seed=17)]
    for by_torch, by_kernel in one_step_each_on_cuda(case, adamw_update_8bit_torch, adamw_update_8bit_triton):
        for at, fmt in ((3, EXP_AVG), (5, SQRT_EXP_AVG_SQ)):
            x, y = (dequantize(t[at], t[at + 1], fmt) for t in (by_torch, by_kernel))
            step_size = 2.0 ** -fmt.mantissa * x.abs() + fmt.subnormal_unit * by_torch[at + 1].repeat_interleave(BLOCK)
            both = x.isfinite() & y.isfinite()
            assert torch.equal(x.isfinite(), y.isfinite()) and ((x - y).abs()[both] <= step_size[both] * 1.01).all()
