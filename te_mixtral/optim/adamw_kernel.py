"""The AdamW update of one tensor as a single Triton kernel: bf16 parameter + int16 remainder.

One pass over memory per tensor. Each program loads BLOCK elements of the parameter and
its remainder (as int16 bits), the gradient (bf16 bits or fp32) and both moments (bf16
bits or fp32), rebuilds the fp32 master with integer operations, does the update in fp32
in registers, and stores the parameter, remainder and moments. With bf16 moments that is
10 bytes read and 8 written per parameter, the least this storage layout allows.

Every bf16 <-> fp32 conversion is done on the bits (`bits << 16` one way, integer rounding
the other), mirroring `bits.py` operation for operation. That has two purposes: the
kernel gives the same bits as the torch path when run by Triton's CPU interpreter
(TRITON_INTERPRET=1, where bf16 arithmetic is not meaningful), and on the GPU integer ops
are as cheap as conversion instructions. On the GPU the compiler may fuse a multiply and
an add into one FMA, so GPU results can differ from the torch path in the last fp32 bit of
the master; the square root and the division are the correctly rounded ones, as in torch.

The step-dependent scalars (`StepScalars`) are plain fp32 arguments: a new learning rate
or step count neither recompiles the kernel nor synchronises with the host. One launch
per tensor; the large expert tensors dominate the time, so launches are not batched.
"""

import torch
import triton
import triton.language as tl

from te_mixtral.optim.adamw_torch import StepScalars

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _bf16_bits_to_fp32(bits):
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _halves(x):
    """(high 16 bits, signed; low 16 bits; is NaN) of fp32 values, as in bits._halves."""
    bits = x.to(tl.int32, bitcast=True)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return bits >> 16, bits & 0xFFFF, is_nan


@triton.jit
def _round_to_bf16_bits(x):
    """Nearest-even bf16 bits (int16) of fp32 values; NaN -> 0x7FC0 (bits.round_to_bf16)."""
    high, low, is_nan = _halves(x)
    up = (low > 0x8000) | ((low == 0x8000) & ((high & 1) == 1))
    return tl.where(is_nan, 0x7FC0, high + up.to(tl.int32)).to(tl.int16)


@triton.jit
def _load_fp32(ptr, offs, mask, IS_FP32: tl.constexpr):
    if IS_FP32:
        return tl.load(ptr + offs, mask=mask, other=0.0)
    return _bf16_bits_to_fp32(tl.load(ptr + offs, mask=mask, other=0))


@triton.jit
def _store_fp32(ptr, offs, x, mask, IS_FP32: tl.constexpr):
    if IS_FP32:
        tl.store(ptr + offs, x, mask=mask)
    else:
        tl.store(ptr + offs, _round_to_bf16_bits(x), mask=mask)


@triton.jit
def _master_adamw_kernel(
    param_ptr, remainder_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_scale_ptr, n,
    decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps,
    GRAD_FP32: tl.constexpr, M_FP32: tl.constexpr, V_FP32: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: tensors > 2^31
    mask = offs < n

    # master bits = (bf16 bits << 16) + remainder; no overflow for any pair split_master makes
    param_bits = tl.load(param_ptr + offs, mask=mask, other=0).to(tl.int32)
    remainder = tl.load(remainder_ptr + offs, mask=mask, other=0).to(tl.int32)
    master = ((param_bits << 16) + remainder).to(tl.float32, bitcast=True)
    g = _load_fp32(grad_ptr, offs, mask, GRAD_FP32) * tl.load(grad_scale_ptr)  # e.g. the clip factor
    m = _load_fp32(exp_avg_ptr, offs, mask, M_FP32)
    v = _load_fp32(exp_avg_sq_ptr, offs, mask, V_FP32)

    master = master * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + (one_minus_beta2 * g) * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    master = master + tl.div_rn(neg_step_size * m, denom)

    # split: round half up on the 16 dropped bits (bits.split_master)
    high, low, is_nan = _halves(master)
    up = low >= 0x8000
    new_param = tl.where(is_nan, 0x7FC0, high + up.to(tl.int32))
    new_remainder = tl.where(is_nan, 0, low - up.to(tl.int32) * 0x10000)
    tl.store(param_ptr + offs, new_param.to(tl.int16), mask=mask)
    tl.store(remainder_ptr + offs, new_remainder.to(tl.int16), mask=mask)
    _store_fp32(exp_avg_ptr, offs, m, mask, M_FP32)
    _store_fp32(exp_avg_sq_ptr, offs, v, mask, V_FP32)


def _bits_or_fp32(t):
    """What the kernel loads: int16 bits of a bf16 tensor, an fp32 tensor as it is."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def adamw_update_triton(param, remainder, grad, exp_avg, exp_avg_sq, scalars: StepScalars,
                        grad_scale: torch.Tensor) -> None:
    """Same contract as `adamw_torch.adamw_update_torch`, as one kernel launch."""
    n = param.numel()
    if n == 0:
        return
    grad = grad.contiguous()
    for t in (param, remainder, exp_avg, exp_avg_sq):
        if not t.is_contiguous():
            raise ValueError("MasterAdamW needs contiguous parameters and state")
    s = scalars
    _master_adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param.view(torch.int16), remainder, _bits_or_fp32(grad),
        _bits_or_fp32(exp_avg), _bits_or_fp32(exp_avg_sq), grad_scale, n,
        s.decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.neg_step_size, s.bc2_sqrt, s.eps,
        GRAD_FP32=grad.dtype == torch.float32, M_FP32=exp_avg.dtype == torch.float32,
        V_FP32=exp_avg_sq.dtype == torch.float32, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
