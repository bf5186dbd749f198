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
are as cheap as conversion instructions.

Compiled, it gives the torch path's bits too. The fp32 operations are the torch path's one
for one, each rounded once: the square root and the divisions are the correctly rounded ones
(`sqrt_rn`, `div_rn`; Triton's plain `/` is approximate), and the launches turn off the
compiler's fusion of a multiply and an add into one FMA (`LAUNCH_OPTIONS`). An FMA rounds
once where the torch path rounds twice: in `master * decay + update` that is up to an ulp of
the old master, which is many ulps of the new one where the update nearly cancels the
master, and in a moment it can move an 8-bit code. Unfused costs two instructions a value
of some 180, and the same bits on every device keep the torch path on the CPU a complete
reference for the kernel.

8-bit moments (`moments8.py`): the second kernel works on whole blocks of 256 values, eight
to a program as a [8, 256] tile, so that each block's largest value is a reduction along
the tile's rows. It reads the codes and block scales, decodes them with integer operations
(the square of the stored sqrt(v) is v), updates as above, and rounds the new moments back
to codes by the same integer operations as moments8.quantize: 8 bytes read and 6 written
per parameter (plus a scale per block for each moment), in one pass.

The step-dependent scalars (`StepScalars`) are plain fp32 arguments, and the rounding salt an
int32 one not specialised on: a new learning rate or step count neither recompiles the kernel
nor synchronises with the host. One launch per tensor; the large expert tensors dominate the
time, so launches are not batched.
"""

import torch
import triton
import triton.language as tl

from te_mixtral.optim.adamw_torch import StepScalars
from te_mixtral.optim.moments8 import BLOCK as QBLOCK
from te_mixtral.optim.moments8 import EXP_AVG, MIN_SCALE_EXPONENT, SQRT_EXP_AVG_SQ

BLOCK = 2048
# No fused multiply-adds: every fp32 operation rounds as the torch path's (module docstring).
LAUNCH_OPTIONS = {"num_warps": 8, "enable_fp_fusion": False}
# A compiled kernel reads a module's global only as a constexpr (the interpreter reads any).
_MIN_SCALE_EXPONENT = tl.constexpr(MIN_SCALE_EXPONENT)


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
def _join_master(param_ptr, remainder_ptr, offs, mask):
    """master bits = (bf16 bits << 16) + remainder; no overflow for any pair split_master makes."""
    param_bits = tl.load(param_ptr + offs, mask=mask, other=0).to(tl.int32)
    remainder = tl.load(remainder_ptr + offs, mask=mask, other=0).to(tl.int32)
    return ((param_bits << 16) + remainder).to(tl.float32, bitcast=True)


@triton.jit
def _store_master(param_ptr, remainder_ptr, offs, master, mask):
    """Split: round half up on the 16 dropped bits (bits.split_master)."""
    high, low, is_nan = _halves(master)
    up = low >= 0x8000
    new_param = tl.where(is_nan, 0x7FC0, high + up.to(tl.int32))
    new_remainder = tl.where(is_nan, 0, low - up.to(tl.int32) * 0x10000)
    tl.store(param_ptr + offs, new_param.to(tl.int16), mask=mask)
    tl.store(remainder_ptr + offs, new_remainder.to(tl.int16), mask=mask)


@triton.jit
def _adamw(master, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps):
    """The update in fp32, as adamw_torch._adamw: (master, m, v, sqrt(v))."""
    master = master * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + (one_minus_beta2 * g) * g
    sqrt_v = tl.sqrt_rn(v)
    denom = tl.div_rn(sqrt_v, bc2_sqrt) + eps
    return master + tl.div_rn(neg_step_size * m, denom), m, v, sqrt_v


@triton.jit
def _master_adamw_kernel(
    param_ptr, remainder_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_scale_ptr, n,
    decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps,
    GRAD_FP32: tl.constexpr, M_FP32: tl.constexpr, V_FP32: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: tensors > 2^31
    mask = offs < n
    master = _join_master(param_ptr, remainder_ptr, offs, mask)
    g = _load_fp32(grad_ptr, offs, mask, GRAD_FP32) * tl.load(grad_scale_ptr)  # e.g. the clip factor
    m = _load_fp32(exp_avg_ptr, offs, mask, M_FP32)
    v = _load_fp32(exp_avg_sq_ptr, offs, mask, V_FP32)
    master, m, v, _ = _adamw(master, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
                             bc2_sqrt, eps)
    _store_master(param_ptr, remainder_ptr, offs, master, mask)
    _store_fp32(exp_avg_ptr, offs, m, mask, M_FP32)
    _store_fp32(exp_avg_sq_ptr, offs, v, mask, V_FP32)


# --- 8-bit moments (moments8.py): the same operations as its torch functions ---------------


@triton.jit
def _rne_shift(z, shift):
    """z >> shift rounded to nearest, ties to even (moments8._rne_shift)."""
    q = z >> shift
    rest = z - (q << shift)
    half = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def _hash32(x):
    """moments8._hash32 of uint32 values: the same bits, with 32-bit multiplies that wrap
    (torch's path masks 64-bit ones; a 64-bit multiply costs a GPU several instructions)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _random_shift(z, shift, bits, salt):
    """z >> shift rounded up with probability (dropped bits) / 2^shift (moments8._random_shift);
    in uint32, where z + 2^31 - 1 fits."""
    shift = shift.to(tl.uint32)
    low_bits = (tl.full(shift.shape, 1, tl.uint32) << shift) - 1
    random = _hash32(bits.to(tl.uint32, bitcast=True) ^ salt.to(tl.uint32)) & low_bits
    return ((z.to(tl.uint32, bitcast=True) + random) >> shift).to(tl.int32, bitcast=True)


@triton.jit
def _dequantize(codes_ptr, scales_ptr, offs, blocks, mask, block_mask,
                MANTISSA: tl.constexpr, MAX_MAGNITUDE: tl.constexpr, SUBNORMAL_UNIT: tl.constexpr,
                SIGNED: tl.constexpr):
    """[blocks, BLOCK] fp32 values of the codes at `offs` (moments8.dequantize)."""
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scales_ptr + blocks, mask=block_mask, other=0.0)
    magnitude = c & MAX_MAGNITUDE
    e = magnitude >> MANTISSA
    mantissa = magnitude & ((1 << MANTISSA) - 1)
    normal = (((e + 112) << 23) | (mantissa << (23 - MANTISSA))).to(tl.float32, bitcast=True)
    value = tl.where(e > 0, normal, mantissa.to(tl.float32) * SUBNORMAL_UNIT)
    if SIGNED:
        value = tl.where(c >= 128, -value, value)
    return value * scale[:, None]


@triton.jit
def _quantize_store(codes_ptr, scales_ptr, offs, blocks, x, mask, block_mask, salt,
                    MANTISSA: tl.constexpr, MAX_MAGNITUDE: tl.constexpr, SIGNED: tl.constexpr,
                    NONZERO_STAYS_NONZERO: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Store [blocks, BLOCK] fp32 values `x` as codes and their blocks' scales (moments8.quantize)."""
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    exponent = a >> 23
    block_exponent = tl.max(a, axis=1) >> 23
    top = tl.maximum(block_exponent, _MIN_SCALE_EXPONENT)[:, None]
    significand = (a & 0x7FFFFF) | ((exponent > 0).to(tl.int32) << 23)
    e = tl.maximum(exponent, 1) - top + 15
    z = ((tl.maximum(e, 1) - 1) << 23) + significand
    shift = tl.minimum((23 - MANTISSA) + tl.maximum(1 - e, 0), 31)
    if STOCHASTIC:
        rounded = _random_shift(z, shift, bits, salt)
    else:
        rounded = _rne_shift(z, shift)
    q = tl.minimum(rounded, MAX_MAGNITUDE)
    if NONZERO_STAYS_NONZERO:
        q = tl.where((q == 0) & (a != 0), 1, q)
    if SIGNED:
        q = q | ((bits < 0).to(tl.int32) << 7)
    q = tl.where(block_exponent[:, None] == 255, 0, q)
    scale_bits = tl.where(block_exponent == 255, 0x7FC00000, tl.maximum(block_exponent, _MIN_SCALE_EXPONENT) << 23)
    tl.store(codes_ptr + offs, q.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + blocks, scale_bits.to(tl.float32, bitcast=True), mask=block_mask)


@triton.jit(do_not_specialize=["rounding_salt"])  # a new salt every step: one compile, not one per salt % 16
def _master_adamw_8bit_kernel(
    param_ptr, remainder_ptr, grad_ptr, m_codes_ptr, m_scales_ptr, r_codes_ptr, r_scales_ptr, grad_scale_ptr,
    n_blocks, decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps, rounding_salt,
    GRAD_FP32: tl.constexpr, BLOCKS: tl.constexpr, QBLOCK: tl.constexpr,
    M_MANTISSA: tl.constexpr, M_MAX: tl.constexpr, M_UNIT: tl.constexpr, M_STOCHASTIC: tl.constexpr,
    R_MANTISSA: tl.constexpr, R_MAX: tl.constexpr, R_UNIT: tl.constexpr, R_STOCHASTIC: tl.constexpr,
):
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # int64: tensors > 2^31
    block_mask = blocks < n_blocks
    offs = blocks[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = block_mask[:, None] & (offs >= 0)  # whole blocks: a block is in or out
    master = _join_master(param_ptr, remainder_ptr, offs, mask)
    g = _load_fp32(grad_ptr, offs, mask, GRAD_FP32) * tl.load(grad_scale_ptr)
    m = _dequantize(m_codes_ptr, m_scales_ptr, offs, blocks, mask, block_mask, M_MANTISSA, M_MAX, M_UNIT, True)
    sqrt_v = _dequantize(r_codes_ptr, r_scales_ptr, offs, blocks, mask, block_mask, R_MANTISSA, R_MAX, R_UNIT, False)
    master, m, _, sqrt_v = _adamw(master, g, m, sqrt_v * sqrt_v, decay, one_minus_beta1, beta2, one_minus_beta2,
                                  neg_step_size, bc2_sqrt, eps)
    _store_master(param_ptr, remainder_ptr, offs, master, mask)
    _quantize_store(m_codes_ptr, m_scales_ptr, offs, blocks, m, mask, block_mask, rounding_salt, M_MANTISSA, M_MAX,
                    True, False, M_STOCHASTIC)
    _quantize_store(r_codes_ptr, r_scales_ptr, offs, blocks, sqrt_v, mask, block_mask, rounding_salt, R_MANTISSA,
                    R_MAX, False, True, R_STOCHASTIC)


# The 8-bit kernel's blocks and formats (moments8.py's).
FORMATS_8BIT = {
    "BLOCKS": BLOCK // QBLOCK, "QBLOCK": QBLOCK,
    "M_MANTISSA": EXP_AVG.mantissa, "M_MAX": EXP_AVG.max_magnitude, "M_UNIT": EXP_AVG.subnormal_unit,
    "M_STOCHASTIC": EXP_AVG.stochastic,
    "R_MANTISSA": SQRT_EXP_AVG_SQ.mantissa, "R_MAX": SQRT_EXP_AVG_SQ.max_magnitude,
    "R_UNIT": SQRT_EXP_AVG_SQ.subnormal_unit, "R_STOCHASTIC": SQRT_EXP_AVG_SQ.stochastic,
}


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
        V_FP32=exp_avg_sq.dtype == torch.float32, BLOCK=BLOCK, **LAUNCH_OPTIONS,
    )


def adamw_update_8bit_triton(param, remainder, grad, m_codes, m_scales, r_codes, r_scales, scalars: StepScalars,
                             grad_scale: torch.Tensor) -> None:
    """Same contract as `adamw_torch.adamw_update_8bit_torch`, as one kernel launch."""
    n = param.numel()
    if n == 0:
        return
    grad = grad.contiguous()
    for t in (param, remainder, m_codes, m_scales, r_codes, r_scales):
        if not t.is_contiguous():
            raise ValueError("MasterAdamW needs contiguous parameters and state")
    s = scalars
    n_blocks = n // QBLOCK
    _master_adamw_8bit_kernel[(triton.cdiv(n_blocks, BLOCK // QBLOCK),)](
        param.view(torch.int16), remainder, _bits_or_fp32(grad), m_codes, m_scales, r_codes, r_scales, grad_scale,
        n_blocks, s.decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2, s.neg_step_size, s.bc2_sqrt, s.eps,
        s.rounding_salt, GRAD_FP32=grad.dtype == torch.float32, **FORMATS_8BIT, **LAUNCH_OPTIONS,
    )
