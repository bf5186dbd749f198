"""Adam's two moments in 8 bits a value: blocks of 256 values sharing a power-of-two scale.

Why. MasterAdamW keeps 2 bytes of remainder and two moments per weight; with bf16 moments
that is 6 bytes of state, with fp32 ones 10. The experts are nearly all of Mixtral's weights,
so storing their moments in one byte each saves 2 (or 6) bytes per expert weight (what that
makes of the whole Mixtral-8x7B: docs/full-model.md). Adam tolerates it because the
moments are running averages whose rounding errors fade (a step keeps a fraction beta of the
error it read and adds its own rounding: tests/optim/test_moments8.py bounds the sum) and
because an update divides one moment by the other, so what matters is relative precision: "8-bit Optimizers via Block-wise
Quantization" (Dettmers et al., 2022, bitsandbytes) trains language models with 8-bit
moments to fp32 quality; torchao's AdamW8bit and AdamWFp8 do the same.

The format. A moment tensor is cut into blocks of BLOCK consecutive values. Each block
stores one fp32 scale, the power of two 2^floor(log2(max |x|)) of its largest value (at
least 2^-108: MIN_SCALE_EXPONENT), and
each value as an 8-bit float relative to it: 4 exponent bits cover the 16 binades below
the scale (subnormals a few more), the rest are mantissa. Like the papers' block-wise
"dynamic" quantisation, an outlier only coarsens its own block and small values keep their
relative precision; unlike their codebooks (a search per value), an 8-bit float is rounded
with a few integer operations on the fp32 bits, as bits.py rounds bf16, so the torch path
and the Triton kernel give the same bits and the kernel stays at the memory-bandwidth floor.
A power-of-two scale costs nothing in precision (the top binade of the format lines up with
the block's largest value) and makes normalising exact: no division, nothing to round.

    exp_avg            signed: sign, 4 exponent bits, 3 mantissa bits (as FP8 E4M3):
                       rounded to nearest, at most 1/16 relative error
    sqrt(exp_avg_sq)   unsigned: 4 exponent bits, 4 mantissa bits, rounded at random
                       (below): under 1/16 relative error in sqrt(v), the number Adam
                       divides by, and none on average

Why the second moment is rounded at random. Where the gradient shrinks, v decays by beta2 a
step: sqrt(v) by 1 - sqrt(0.95) = 2.5% at the configs' beta2 (less at torch's 0.999), less
than half a code step (up to 3.1%) of 4 mantissa bits. Rounded to nearest, it comes back to
the code it was: sqrt(v) stays at its largest value, and the step lr * m / sqrt(v) shrinks as
the gradient does (tests/optim/test_moments8.py's shrinking gradients: updates under a fifth
of fp32 moments' after 300 steps). Rounded up with probability equal to the fraction of a
step dropped, the stored value is the exact one on average, so the decay goes on (the same
test: within a few per cent of fp32 moments' updates). The first moment decays by
1 - beta1 = 10% a step, more than its half step of 6.25%, and keeps rounding to nearest. The
random bits are a hash of the value's own fp32 bits and a salt drawn from the step number:
the same on every device and in the Triton kernel, whatever the tensor's sharding or layout,
and again after a resume.

The second moment is stored as its square root (torchao notes the sign bit is wasted on an
unsigned state; the square root also halves the dynamic range of v, since sqrt(v) ~ |g|).
That square root is the one the update computes anyway (adamw_torch.py). A nonzero sqrt(v)
too small for the format is stored as the smallest code, never as zero: a zero denominator
would turn a first moment that is not zero into a step of lr * m / eps, the "zero point"
failure of linear quantisers ("Memory Efficient Optimizers with 4-bit States", Li et al.,
2023). Rounding up instead only shrinks such a step.

The largest value of a block can round up past the format's largest code: it is clamped to
it (an error below one code step, not half of one). A block holding a NaN or infinity gets
a NaN scale and codes 0, so all its values read back as NaN rather than as numbers (the
training loop never steps on a non-finite gradient, so this only matters when the optimizer
is used alone).

Storage: codes are uint8 tensors shaped like the parameter; scales are fp32 tensors of shape
[rows, row numel / BLOCK] (row = index along the parameter's first dimension, an expert), so a
block never straddles two experts and the scales shard with the experts (checkpoints,
distributed/global_state.py). A parameter's rows must therefore be multiples of BLOCK values.
"""

from dataclasses import dataclass

import torch

BLOCK = 256
_ABS_MASK = 0x7FFFFFFF
_NAN_BITS = 0x7FC00000
_MANTISSA_BITS = 23


@dataclass(frozen=True)
class Format:
    """An 8-bit float relative to its block's scale: `mantissa` bits, 4 exponent bits (the top
    binade of the format is the scale's), a sign bit when `signed`."""

    mantissa: int
    signed: bool
    nonzero_stays_nonzero: bool  # round a nonzero value below the smallest code up to it
    stochastic: bool  # round at random (unbiased) rather than to nearest; needs a salt

    @property
    def max_magnitude(self) -> int:
        """The largest code without its sign: every exponent and mantissa bit set."""
        return (1 << (7 if self.signed else 8)) - 1

    @property
    def subnormal_unit(self) -> float:
        """The value of magnitude code 1 (relative to the scale): 2^(1 - 15 - mantissa)."""
        return 2.0 ** (-14 - self.mantissa)


EXP_AVG = Format(mantissa=3, signed=True, nonzero_stays_nonzero=False, stochastic=False)
SQRT_EXP_AVG_SQ = Format(mantissa=4, signed=False, nonzero_stays_nonzero=True, stochastic=True)
_TOP = 15  # the format's biased exponent of the scale's binade (4 exponent bits, none kept for inf)
# The fp32 exponent field of the smallest scale, 2^-108: every code times it is an fp32 normal
# (no flush to zero on any device), and fp32 subnormals and zeros fall below the format's normals,
# where the rounding below treats them right. Smaller moments than this do not move a weight.
MIN_SCALE_EXPONENT = 1 + 14 + 4


def scales_shape(shape: torch.Size) -> tuple[int, int]:
    """The shape of the scales of a moment shaped `shape`: one per BLOCK values of each row."""
    rows = shape[0]
    per_row = shape.numel() // rows if rows else 0
    return rows, per_row // BLOCK


def check_blockable(shape: torch.Size, what: str) -> None:
    """Raise ValueError unless a tensor shaped `shape` splits into whole blocks per row."""
    if len(shape) < 2 or shape.numel() // max(shape[0], 1) % BLOCK:
        raise ValueError(f"8-bit moments need a parameter of two or more dimensions whose rows are multiples of "
                         f"{BLOCK} values; {what} is {tuple(shape)}")


_HASH_MASK = 0xFFFFFFFF


def _hash32(x):
    """A 32-bit integer hash (Wellons' lowbias32 shape, multipliers below 2^31 so that no
    product leaves int64) of integers in [0, 2^32): torch tensors or Python ints alike."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _HASH_MASK
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _HASH_MASK
    return x ^ (x >> 16)


def rounding_salt(step: int) -> int:
    """The salt of a step's random rounding: below 2^31, so a kernel takes it as an int32."""
    return _hash32(step & _HASH_MASK) & 0x7FFFFFFF


def _rne_shift(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """z >> shift rounded to nearest, ties to even (z >= 0, 1 <= shift <= 31; int32)."""
    q = z >> shift
    rest = z - (q << shift)
    half = torch.ones_like(shift) << (shift - 1)
    up = (rest > half) | ((rest == half) & ((q & 1) == 1))
    return q + up.to(torch.int32)


def _random_shift(z: torch.Tensor, shift: torch.Tensor, bits: torch.Tensor, salt: int) -> torch.Tensor:
    """z >> shift rounded up with probability (the dropped bits) / 2^shift: z plus `shift`
    random bits, truncated. The bits hash the value's fp32 `bits` with `salt`. In int64:
    z + 2^31 - 1 leaves int32."""
    low_bits = (torch.ones_like(shift, dtype=torch.int64) << shift) - 1
    random = _hash32((bits.to(torch.int64) & _HASH_MASK) ^ salt) & low_bits
    return ((z.to(torch.int64) + random) >> shift).to(torch.int32)


def quantize(x: torch.Tensor, fmt: Format, salt: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, fp32 scales) of fp32 values `x`, flat, a whole number of blocks long:
    codes[i] for x[i], scales[b] for block b. A stochastic format needs the step's `salt`
    (`rounding_salt`)."""
    if fmt.stochastic and salt is None:
        raise ValueError("a stochastic format is rounded with a salt (rounding_salt(step))")
    bits = x.contiguous().view(torch.int32).view(-1, BLOCK)
    a = bits & _ABS_MASK
    exponent = a >> _MANTISSA_BITS  # biased fp32 exponent field, 0 for zeros and subnormals
    block_exponent = a.amax(dim=1, keepdim=True) >> _MANTISSA_BITS  # of the largest |x|; 255: non-finite
    significand = (a & 0x7FFFFF) | ((exponent > 0).to(torch.int32) << _MANTISSA_BITS)  # the implicit leading 1
    # The value's exponent in the format: _TOP for the block's largest binade, <= 0 below the normals.
    e = torch.clamp(exponent, min=1) - torch.clamp(block_exponent, min=MIN_SCALE_EXPONENT) + _TOP
    # Normals keep their exponent above the mantissa (a carry of the rounding moves it up);
    # below them the significand is shifted further right, so the step stays the subnormal unit.
    z = ((torch.clamp(e, min=1) - 1) << _MANTISSA_BITS) + significand
    shift = torch.clamp((_MANTISSA_BITS - fmt.mantissa) + torch.clamp(1 - e, min=0), max=31)
    rounded = _random_shift(z, shift, bits, salt) if fmt.stochastic else _rne_shift(z, shift)
    q = torch.clamp(rounded, max=fmt.max_magnitude)
    if fmt.nonzero_stays_nonzero:
        q = torch.where((q == 0) & (a != 0), 1, q)
    if fmt.signed:
        q = q | ((bits < 0).to(torch.int32) << 7)
    q = torch.where(block_exponent == 255, 0, q)  # nothing kept, not even a NaN's sign (a device's own)
    scale_bits = torch.where(block_exponent == 255, _NAN_BITS,
                             torch.clamp(block_exponent, min=MIN_SCALE_EXPONENT) << _MANTISSA_BITS)
    return q.to(torch.uint8).view(-1), scale_bits.view(torch.float32).view(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fp32 values of uint8 `codes` (flat, whole blocks) with their blocks' fp32 `scales`."""
    c = codes.view(-1, BLOCK).to(torch.int32)
    magnitude = c & fmt.max_magnitude
    e, mantissa = magnitude >> fmt.mantissa, magnitude & ((1 << fmt.mantissa) - 1)
    # A normal code is 1.mantissa x 2^(e - _TOP): its fp32 bits directly; a subnormal one mantissa units.
    normal = (((e + 127 - _TOP) << _MANTISSA_BITS) | (mantissa << (_MANTISSA_BITS - fmt.mantissa))).view(torch.float32)
    value = torch.where(e > 0, normal, mantissa.float() * fmt.subnormal_unit)
    if fmt.signed:
        value = torch.where(c >= 128, -value, value)
    return (value * scales.view(-1, 1)).view(-1)  # the scale is a power of two: exact
