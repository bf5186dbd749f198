"""fp32 <-> bf16 by integer operations on the bit patterns, in torch.

A bf16 number is the top 16 bits of an fp32 number. MasterAdamW keeps each fp32 master
weight as two 16-bit halves: the bf16 parameter the model computes with, and an int16
`remainder` such that

    master bits = (bf16 bits << 16) + remainder        (32-bit two's-complement integers)

Splitting a master (`split_master`) rounds it to the nearest bf16, ties away from zero in
magnitude ("round half up" on the 16 dropped bits: dropped bits >= 0x8000 carry into the
kept ones). Then remainder = master bits - (bf16 bits << 16) lies in [-32768, 32767],
exactly the int16 range. Round-to-nearest-even would not fit: at a tie that rounds down
the remainder would be +32768. So the bf16 parameter is the master rounded to nearest, and
differs from torch's `.to(torch.bfloat16)` (ties to even) only at exact ties.

Moments stored in bf16 are rounded the usual way, to nearest even (`round_to_bf16`).

Everything is integer arithmetic on int32 views, for two reasons: it is exact by
construction (no float conversion whose rounding mode could differ between devices), and
the Triton kernel in `adamw_kernel.py` does the same operations, so that kernel run under
Triton's CPU interpreter (where bf16 arithmetic is not meaningful) can be checked against
these functions bit for bit.

Non-finite values. A NaN master becomes the canonical NaN 0x7FC0 with remainder 0, so it
stays NaN after the round trip (a naive rounding would carry a NaN whose low bits are set
into the sign bit and turn it into -0.0, or wrap a negative NaN to +0.0). Infinities split
exactly (remainder 0). A finite master just below the largest fp32 rounds to a bf16
infinity with a negative remainder, as IEEE rounding to bf16 would; the master itself
stays finite.
"""

import torch

NAN_BF16_BITS = 0x7FC0  # the quiet NaN torch itself produces when rounding to bf16
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_LOW_MASK = 0xFFFF
_HALF = 0x8000


def _halves(x_fp32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(high 16 bits as a signed int, low 16 bits in [0, 65535], is-NaN) of fp32 values."""
    bits = x_fp32.contiguous().view(torch.int32)
    is_nan = (bits & _ABS_MASK) > _INF_BITS
    return bits >> 16, bits & _LOW_MASK, is_nan  # >> is arithmetic: high keeps the sign bit


def split_master(master_fp32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 bits, remainder), both int16, of fp32 masters; see the module docstring."""
    high, low, is_nan = _halves(master_fp32)
    up = low >= _HALF
    # No overflow: high + 1 only wraps for high = 0x7FFF or -1, both NaN, replaced below.
    bf16_bits = torch.where(is_nan, NAN_BF16_BITS, high + up.to(torch.int32))
    remainder = torch.where(is_nan, 0, low - up.to(torch.int32) * 0x10000)
    return bf16_bits.to(torch.int16), remainder.to(torch.int16)


def join_master(bf16_bits: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 masters whose halves are `bf16_bits` and `remainder` (int16 tensors)."""
    bits = (bf16_bits.to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


def round_to_bf16(x_fp32: torch.Tensor) -> torch.Tensor:
    """bf16 bits (int16) of fp32 values rounded to nearest, ties to even; NaN -> 0x7FC0."""
    high, low, is_nan = _halves(x_fp32)
    up = (low > _HALF) | ((low == _HALF) & ((high & 1) == 1))
    return torch.where(is_nan, NAN_BF16_BITS, high + up.to(torch.int32)).to(torch.int16)


def bf16_to_fp32(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of bf16 numbers given as int16 bits (exact: the low 16 bits are zero)."""
    return (bits.to(torch.int32) << 16).view(torch.float32)
