"""MasterAdamW's Triton kernel (te_mixtral/optim/adamw_kernel.py) against its torch path.

The kernel is checked bit for bit by running this file's `interpreter` tests in a subprocess
with TRITON_INTERPRET=1 (the interpreter must be on before triton is first imported); run
directly, those tests are skipped. Compiled for a GPU it gives the same bits as the torch path
on the CPU: its PTX is checked here for every instruction that would round otherwise, and the
`cuda` tests compare the bits a GPU gives. Units: see test_master_adamw.py.
"""

import os
import re

import pytest
import torch
from adamw_reference import CLIP, bf16_grads, bits, fp32_weights
from background import assert_passed, interpreter_run

from te_mixtral.optim import MasterAdamW
from te_mixtral.optim.adamw_torch import (
    StepScalars,
    adamw_update_8bit_torch,
    adamw_update_torch,
)
from te_mixtral.optim.bits import join_master, split_master
from te_mixtral.optim.moments8 import BLOCK, EXP_AVG, SQRT_EXP_AVG_SQ, quantize

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


def assert_same_bits_after_three_steps(case, torch_update, kernel_update, kernel_device: str = "cpu") -> None:
    """Both paths from `case`, steps 1, 2 and 9 in a row, the torch path on the CPU and the
    kernel on `kernel_device`: every tensor the same bits, but a NaN need only be a NaN in
    both (where fp32 moments are stored as computed, a GPU writes its own NaN, the CPU the
    operand's)."""
    by_torch, by_kernel = [t.clone() for t in case], [t.to(kernel_device, copy=True) for t in case]
    for step in (1, 2, 9):
        scalars = StepScalars.for_step(3e-3, 0.1, 0.9, 0.999, 1e-8, step)
        torch_update(*by_torch, scalars, CLIP)
        kernel_update(*by_kernel, scalars, CLIP.to(kernel_device))
    for x, y in zip(by_torch, (t.cpu() for t in by_kernel)):
        nan = x.isnan()
        assert torch.equal(nan, y.isnan()) and torch.equal(bits(x)[~nan], bits(y)[~nan])


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
    return [param, remainder, grad, *quantize(m, EXP_AVG), *quantize(sqrt_v, SQRT_EXP_AVG_SQ, salt=12345)]


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


# Argument types of the kernels as the launches pass them (bf16 tensors as int16 bits); others fp32.
ARGUMENT_TYPES = {"param_ptr": "*i16", "remainder_ptr": "*i16", "grad_ptr": "*i16", "exp_avg_ptr": "*i16",
                  "exp_avg_sq_ptr": "*i16", "grad_scale_ptr": "*fp32", "m_codes_ptr": "*u8", "m_scales_ptr": "*fp32",
                  "r_codes_ptr": "*u8", "r_scales_ptr": "*fp32", "n": "i32", "n_blocks": "i32",
                  "rounding_salt": "i32"}


def sm90_ptx(kernel, constexprs: dict) -> str:
    """The PTX `kernel` compiles to for an H100 or H200 (sm_90) with the launches' options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from te_mixtral.optim.adamw_kernel import LAUNCH_OPTIONS

    signature = {p.name: "constexpr" if p.name in constexprs else ARGUMENT_TYPES.get(p.name, "fp32")
                 for p in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=LAUNCH_OPTIONS).asm["ptx"]


@pytest.mark.skipif(INTERPRETING, reason="compiles for a GPU")
@pytest.mark.parametrize("moments", ["as they are", "8-bit"])
def test_compiled_kernel_rounds_every_operation_as_the_torch_path(moments):
    """What would make the kernel's bits on a GPU differ from the torch path's (and its own in
    the interpreter), found in its PTX without a GPU: a fused multiply-add (fma or mad, or an
    add, sub or mul.f32 without a rounding mode, which ptxas may still contract), an
    approximate division, square root or reciprocal (.approx, .full), subnormals flushed to
    zero (.ftz)."""
    pytest.importorskip("triton")
    from te_mixtral.optim import adamw_kernel

    kernel, constexprs = {
        "as they are": (adamw_kernel._master_adamw_kernel,
                        {"GRAD_FP32": False, "M_FP32": False, "V_FP32": False, "BLOCK": adamw_kernel.BLOCK}),
        "8-bit": (adamw_kernel._master_adamw_8bit_kernel, {"GRAD_FP32": False, **adamw_kernel.FORMATS_8BIT}),
    }[moments]
    instructions = set(re.findall(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)", sm90_ptx(kernel, constexprs), re.MULTILINE))
    fused = {op for op in instructions if op.split(".")[0] in ("fma", "mad") or op in ("add.f32", "sub.f32", "mul.f32")}
    approximate = {op for op in instructions if {"approx", "full", "ftz"} & set(op.split("."))}
    assert {"div.rn.f32", "sqrt.rn.f32"} <= instructions, sorted(instructions)
    assert not fused | approximate, f"rounds unlike the torch path: {sorted(fused | approximate)}"


@pytest.mark.cuda
@pytest.mark.parametrize("n", [5001, 1 << 20])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_equals_torch_path_on_cpu(n, grad_dtype, moment_dtype):
    from te_mixtral.optim.adamw_kernel import adamw_update_triton

    assert_same_bits_after_three_steps(kernel_case(n, grad_dtype, moment_dtype, seed=16), adamw_update_torch,
                                       adamw_update_triton, kernel_device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("blocks", [9, 1 << 12])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_cuda_8bit_kernel_equals_torch_path_on_cpu(blocks, grad_dtype):
    from te_mixtral.optim.adamw_kernel import adamw_update_8bit_triton

    assert_same_bits_after_three_steps(kernel_case_8bit(blocks, grad_dtype, seed=17), adamw_update_8bit_torch,
                                       adamw_update_8bit_triton, kernel_device="cuda")
