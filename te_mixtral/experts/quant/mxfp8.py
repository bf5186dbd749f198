"""MXFP8 as the OCP Microscaling (MX) spec v1.0 defines it, in plain PyTorch (CPU and GPU).

Shape suffixes: see te_mixtral/__init__.py.

The format. A tensor is cut into blocks of 32 consecutive values along one dim (for a
GEMM: the dim it reduces over). Each block stores one shared scale X = 2^s as E8M0 (an
8-bit biased exponent, no mantissa, no sign; 0xFF is NaN) and 32 elements P_i in FP8
E4M3 (largest finite 448 = 1.75 * 2^8, smallest subnormal 2^-9). A value reads back as
X * P_i.

Quantising a block (the spec's conversion algorithm, section 6.3), with emax_elem = 8,
the exponent of E4M3's largest normal value:

    s   = floor(log2(max_i |V_i|)) - emax_elem
    P_i = V_i / 2^s, rounded to nearest-even E4M3, saturating at +-448

Dividing by 2^s puts the block's largest value in [256, 512): its top power of two lands
on E4M3's top exponent. Values in (448, 512) have no E4M3 encoding and saturate to 448;
that is the price of the floor (TE's kernels instead round the scale *up* from amax/448,
so they never saturate but use one binade less; the two agree except for blocks whose
amax / 2^floor(log2 amax) lies in (1.75, 2)).

Corner cases, as the spec and its reference code (microsoft/microxcaling, written by the
spec's authors) settle them:
- NaN in a block: amax is NaN, so X is NaN (E8M0 0xFF); the spec reads every value of a
  block whose scale is NaN as NaN, whatever its elements (we write NaN elements too).
- Inf in a block: log2(Inf) = Inf exceeds E8M0's largest exponent (127), so X is NaN as
  well, and the whole block reads back NaN. (E4M3 has no Inf to carry it in an element.)
- amax == 0: log2(0) = -inf; s is clamped to E8M0's smallest exponent, -127 (0x00), the
  same clamp that catches any block too small for the scale range. Any scale would give
  all-zero elements; the clamp makes the choice deterministic and never NaN.
- Subnormals: E4M3 subnormals (multiples of 2^-9 below 2^-6) are kept, not flushed; an
  element of at most 2^-10 (after dividing by the scale) rounds to zero.

`floor(log2(amax))` is computed with `frexp`, which is exact; `log2` in float32 can round
a value just under a power of two up to it and pick the wrong scale.

Error bound (tests/experts/quant/test_mxfp8.py checks it): with E = floor(log2 amax) and s = E - 8,
an element that does not saturate (|V| <= 448 * 2^s) is off by at most half an E4M3 ulp:
2^-4 |V| in the normal range, 2^(s-10) in the subnormal range; a saturated element is
off by less than 64 * 2^s = 2^-2 * 2^E. So no element is ever off by more than a quarter
of the block's top power of two.

`MXFP8EmulatedGemms` at the end runs a grouped linear layer's three GEMMs on MXFP8
operands: quantise, dequantise exactly (every MXFP8 value is a float32 value, and a
bfloat16 one whenever the block scale is at least 2^-124), then an ordinary grouped GEMM.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK_SIZE = 32
E4M3_MAX = 448.0
E4M3_EMAX = 8  # exponent of E4M3's largest normal value
E8M0_BIAS = 127
E8M0_MIN_EXP = -127  # 0x00
E8M0_MAX_EXP = 127  # 0xFE; 0xFF is NaN
E8M0_NAN = 0xFF


@dataclass
class MXFP8Tensor:
    """A tensor in MXFP8: E4M3 elements plus one E8M0 scale per 32 values along `dim`."""

    elements: torch.Tensor  # float8_e4m3fn, the source's shape
    scales: torch.Tensor  # float8_e8m0fnu, the source's shape with `dim` divided by 32
    dim: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = self.elements.float().unflatten(self.dim, (-1, BLOCK_SIZE))
        scale = e8m0_to_float(self.scales).unsqueeze(self.dim + 1)
        return (values * scale).flatten(self.dim, self.dim + 1).to(dtype)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """2^(bits - 127) in float32, NaN for 0xFF. Done on the bits: it works on any device."""
    bits = scales.view(torch.uint8).to(torch.int32)
    value = torch.exp2((bits - E8M0_BIAS).float())
    return torch.where(bits == E8M0_NAN, torch.nan, value)


def quantize(x: torch.Tensor, dim: int = -1) -> MXFP8Tensor:
    """Quantise `x` to MXFP8 with its blocks of 32 running along `dim` (spec section 6.3)."""
    dim = dim % x.ndim
    if x.shape[dim] % BLOCK_SIZE:
        raise ValueError(f"MXFP8 blocks need dim {dim} of shape {tuple(x.shape)} to be a multiple of {BLOCK_SIZE}")
    blocks = x.float().unflatten(dim, (-1, BLOCK_SIZE))
    amax = blocks.abs().amax(dim + 1, keepdim=True)  # NaN if the block holds a NaN

    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent with m in [0.5, 1)
    shared_exp = (exponent - 1 - E4M3_EMAX).float()
    shared_exp = torch.where(amax == 0, E8M0_MIN_EXP, shared_exp).clamp(min=E8M0_MIN_EXP)
    shared_exp = torch.where(torch.isfinite(amax) & (shared_exp <= E8M0_MAX_EXP), shared_exp, torch.nan)

    # Dividing by 2^s is exact (a power of two, never leaving float32's range here), so the
    # only rounding is the cast to E4M3. The clamp is the spec's saturation: the cast alone
    # is not guaranteed to saturate on every device. A NaN scale makes every element NaN.
    elements = (blocks * torch.exp2(-shared_exp)).clamp(-E4M3_MAX, E4M3_MAX)
    elements = elements.flatten(dim, dim + 1).to(torch.float8_e4m3fn)

    bits = torch.where(shared_exp.isnan(), E8M0_NAN, shared_exp + E8M0_BIAS).to(torch.uint8)
    return MXFP8Tensor(elements, bits.squeeze(dim + 1).view(torch.float8_e8m0fnu), dim)


def fake_quantize(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """MXFP8 round trip of `x` (blocks along `dim`), returned in `dtype` (default x's)."""
    return quantize(x, dim).dequantize(dtype or x.dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # bfloat16 where the activations are (CUDA): MXFP8 values are exact in it and grouped_mm
    # is fast in it. float32 otherwise (CPU): exact, and the only float type CPU grouped_mm
    # offers besides the half types.
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


class MXFP8EmulatedGemms:
    """A grouped linear's three GEMMs with every operand in MXFP8, blocks along the GEMM's
    reduction dim, computed as `torch.nn.functional.grouped_mm` on the dequantised values.

        fprop  y_QN   = x_QI  w_GNI^T per group   x, w quantised along I
        dgrad  dx_QI  = dy_QN w_GNI   per group   dy, w quantised along N
        wgrad  dw_GNI = dy_QN^T x_QI  per group   dy, x quantised along the group's rows

    The same tensor is quantised once per GEMM that reads it, along that GEMM's reduction
    dim, as TE's MXFP8 recipe does (a rowwise and a columnwise copy): quantising once and
    transposing would put the blocks across the wrong dim. The wgrad blocks run along rows,
    so each group's rows must start on a multiple of 32 (`row_align`). An empty group gets
    32 zero rows (`min_rows`): CUDA's grouped_mm kernel rejects an empty group in the
    2-D x 2-D (wgrad) case with a device-side assert.
    """

    recipe = "mxfp8-emulated"
    row_align = BLOCK_SIZE
    min_rows = BLOCK_SIZE

    @property
    def kernel(self) -> str:
        return "torch.nn.functional.grouped_mm on MXFP8-dequantised operands"

    def weight(self, w_GNI):
        """Each GEMM quantises the weight itself: emulation is for numerics, not speed."""
        return w_GNI

    def fprop(self, x_QI, w_GNI, offsets_G):
        dtype = _compute_dtype(x_QI)
        return F.grouped_mm(
            fake_quantize(x_QI, -1, dtype), fake_quantize(w_GNI, -1, dtype).transpose(-2, -1), offs=offsets_G
        )

    def dgrad(self, dy_QN, w_GNI, offsets_G):
        dtype = _compute_dtype(dy_QN)
        return F.grouped_mm(fake_quantize(dy_QN, -1, dtype), fake_quantize(w_GNI, -2, dtype), offs=offsets_G)

    def wgrad(self, dy_QN, x_QI, offsets_G):
        dtype = _compute_dtype(dy_QN)
        dy_NQ = fake_quantize(dy_QN, 0, dtype).t().contiguous()
        return F.grouped_mm(dy_NQ, fake_quantize(x_QI, 0, dtype), offs=offsets_G)
