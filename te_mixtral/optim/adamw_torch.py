"""One AdamW update of one tensor in plain torch: the CPU path and the kernel's reference.

The update, in fp32, for a master weight w with gradient g (torch.optim.AdamW's formula):

    w  <- w * (1 - lr * weight_decay)                 decoupled weight decay, on the master
    m  <- m + (1 - beta1) * (g - m)                   torch's exp_avg.lerp_(g, 1 - beta1)
    v  <- v * beta2 + ((1 - beta2) * g) * g           torch's mul_(beta2).addcmul_(g, g, 1 - beta2)
    w  <- w + (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

eps is added outside the square root, to sqrt of the bias-corrected v, as torch does. The
step-dependent numbers are worked out on the host in float64 and rounded to fp32 once
(`StepScalars`), which is also what torch's single-tensor AdamW does with its Python-float
scalars (torch's fused CUDA AdamW instead forms 1 - beta2 in fp32, 1.3e-5 off for 0.999).
Results still differ from torch's in the last bits: torch's CPU lerp and addcmul may fuse
a multiply-add, and fp32 AdamW is sensitive to operation order (m is a difference of
nearly equal terms when the gradient changes sign); torch's own fused and single-tensor
AdamW differ from each other by about as much as this does from either.

The master is rebuilt from the bf16 parameter and its int16 remainder, updated, and split
again (`bits.py`); moments are read and written in their own dtype (bf16 moments rounded
to nearest even), or in 8-bit blocks (`moments8.py`, `adamw_update_8bit_torch`: the second
moment stored as its square root, the one the update computes). Every operation below is
one torch op, so nothing is fused into an FMA: the Triton kernel, run in the CPU interpreter
or compiled for a GPU without FMAs, gives the same bits as this path on the CPU. The square
root is taken in float64 and rounded once to fp32, which is the correctly rounded fp32
square root (as the kernel's `sqrt_rn` is): torch's fp32 `sqrt` on CPU is not always
correctly rounded (seen with torch 2.13's CPU build: about one value in five is an ulp off).
On a GPU this path itself can differ from the CPU's in the last bit: torch's CUDA division
by a number (`/ s.bc2_sqrt`) multiplies by its reciprocal.
"""

import struct
from dataclasses import dataclass

import torch

from te_mixtral.optim.bits import bf16_to_fp32, join_master, round_to_bf16, split_master
from te_mixtral.optim.moments8 import (
    BLOCK,
    EXP_AVG,
    SQRT_EXP_AVG_SQ,
    dequantize,
    quantize,
    rounding_salt,
)

CHUNK = 1 << 22  # elements per slice: bounds the fp32/int32 temporaries on big tensors; whole 8-bit blocks


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 (a kernel's fp32 argument receives exactly this)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class StepScalars:
    """The scalars of one AdamW step, fp32-rounded; kernel arguments, so no recompile per step."""

    decay: float  # 1 - lr * weight_decay
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    neg_step_size: float  # -lr / (1 - beta1^t)
    bc2_sqrt: float  # sqrt(1 - beta2^t)
    eps: float
    rounding_salt: int  # of 8-bit moments rounded at random (moments8.rounding_salt)

    @classmethod
    def for_step(cls, lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
                 step: int) -> "StepScalars":
        """Scalars for step number `step` (1 for the first update)."""
        return cls(*(_fp32(x) for x in (
            1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2,
            -lr / (1 - beta1**step), (1 - beta2**step) ** 0.5, eps)), rounding_salt(step))


def _load(x: torch.Tensor) -> torch.Tensor:
    """fp32 values of a bf16 or fp32 tensor; bf16 by its bits."""
    return bf16_to_fp32(x.view(torch.int16)) if x.dtype == torch.bfloat16 else x.float()


def _store(dst: torch.Tensor, x_fp32: torch.Tensor) -> None:
    if dst.dtype == torch.bfloat16:
        dst.view(torch.int16).copy_(round_to_bf16(x_fp32))
    else:
        dst.copy_(x_fp32)


def _adamw(master, g, m, v, s: StepScalars):
    """The update in fp32: (master, m, v, sqrt(v)), the new values."""
    master = master * s.decay
    m = m + s.one_minus_beta1 * (g - m)
    v = v * s.beta2 + (s.one_minus_beta2 * g) * g
    sqrt_v = torch.sqrt(v.double()).float()  # see the docstring on sqrt
    denom = sqrt_v / s.bc2_sqrt + s.eps
    return master + (s.neg_step_size * m) / denom, m, v, sqrt_v


def _store_master(param: torch.Tensor, remainder: torch.Tensor, master: torch.Tensor) -> None:
    bf16_bits, new_remainder = split_master(master)
    param.view(torch.int16).copy_(bf16_bits)
    remainder.copy_(new_remainder)


def _update(param, remainder, grad, exp_avg, exp_avg_sq, s: StepScalars, grad_scale: torch.Tensor) -> None:
    master = join_master(param.view(torch.int16), remainder)
    g = _load(grad) * grad_scale
    master, m, v, _ = _adamw(master, g, _load(exp_avg), _load(exp_avg_sq), s)
    _store_master(param, remainder, master)
    _store(exp_avg, m)
    _store(exp_avg_sq, v)


def _update_8bit(param, remainder, grad, m_codes, m_scales, r_codes, r_scales, s: StepScalars,
                 grad_scale: torch.Tensor) -> None:
    master = join_master(param.view(torch.int16), remainder)
    g = _load(grad) * grad_scale
    sqrt_v = dequantize(r_codes, r_scales, SQRT_EXP_AVG_SQ)
    master, m, _, sqrt_v = _adamw(master, g, dequantize(m_codes, m_scales, EXP_AVG), sqrt_v * sqrt_v, s)
    _store_master(param, remainder, master)
    for codes, scales, x, fmt in ((m_codes, m_scales, m, EXP_AVG), (r_codes, r_scales, sqrt_v, SQRT_EXP_AVG_SQ)):
        new_codes, new_scales = quantize(x, fmt, s.rounding_salt)
        codes.copy_(new_codes)
        scales.copy_(new_scales)


def adamw_update_torch(param: torch.Tensor, remainder: torch.Tensor, grad: torch.Tensor,
                       exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, scalars: StepScalars,
                       grad_scale: torch.Tensor) -> None:
    """Update one tensor in place: bf16 `param` with its int16 `remainder`, `grad` (bf16 or
    fp32) times `grad_scale` (an fp32 scalar tensor on the device: read there, never on the
    host), moments (bf16 or fp32). All contiguous and of one shape."""
    flat = [t.view(-1) for t in (param, remainder, grad.contiguous(), exp_avg, exp_avg_sq)]
    for start in range(0, param.numel(), CHUNK):
        _update(*(t[start:start + CHUNK] for t in flat), scalars, grad_scale)


def adamw_update_8bit_torch(param: torch.Tensor, remainder: torch.Tensor, grad: torch.Tensor,
                            m_codes: torch.Tensor, m_scales: torch.Tensor, r_codes: torch.Tensor,
                            r_scales: torch.Tensor, scalars: StepScalars, grad_scale: torch.Tensor) -> None:
    """`adamw_update_torch` with 8-bit moments (moments8.py): the first moment as `m_codes` and
    `m_scales`, the square root of the second as `r_codes` and `r_scales`; read, updated in
    fp32 and stored again. The update itself uses the new fp32 moments, before they are
    rounded to 8 bits (as bitsandbytes does)."""
    flat = [t.view(-1) for t in (param, remainder, grad.contiguous(), m_codes, r_codes)]
    m_scales, r_scales = m_scales.view(-1), r_scales.view(-1)
    for start in range(0, param.numel(), CHUNK):
        p, rem, g, mc, rc = (t[start:start + CHUNK] for t in flat)
        blocks = slice(start // BLOCK, (start + CHUNK) // BLOCK)
        _update_8bit(p, rem, g, mc, m_scales[blocks], rc, r_scales[blocks], scalars, grad_scale)
