"""NF4: QLoRA's 4-bit NormalFloat format, for a frozen LoRA base's expert weights.

Shape suffixes: see te_mixtral/__init__.py.

Each row of a weight is cut into blocks of 64 values (the last block of a row may be
shorter); a block keeps its absolute maximum as a float32 scale, and each value the index
of the nearest of 16 code values (`CODE`) to value / absmax, 4 bits, two to a byte. The
code values are QLoRA's (Dettmers et al., 2023; bitsandbytes' `get_4bit_type("nf4")`):
quantiles of a normal distribution, with exact 0 and +-1. Dequantised, a value is
CODE[index] * absmax, computed in float32 and then rounded to the GEMM's dtype.

Why NF4 and not INT4 with a scale per group. Pretrained weights are close to normally
distributed within a block, and NF4 places its 16 levels where such values fall (dense
near 0), so its error is lower than uniform INT4's at the same 4.5 bits per value; QLoRA
measured NF4 ahead of FP4 and INT4 for LoRA over the frozen base. It is also what people
fine-tune Mixtral with today (bitsandbytes), so benchmarks/nf4_accuracy.py compares like
with like. The one cost over INT4 is a table look-up in place of a subtraction when the
kernel dequantises: 16 values, held in registers and picked by a tree of selects on the
index bits, as bitsandbytes' kernels decode them.

Two departures from bitsandbytes, both for filling a stack row block by row block as a
checkpoint loads (frozen.py): blocks never cross rows (bitsandbytes blocks the flattened
tensor), and a row of odd width pads its last byte. The values nearest a midpoint between
two codes round down, as bitsandbytes' decision tree does. The scales are not quantised a
second time (QLoRA's double quantisation, 0.5 -> 0.127 bits per value): float32 scales keep
every block's absmax exact.
"""

import torch

BLOCK = 64  # values per absmax scale
CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def code_table(device=None) -> torch.Tensor:
    """The 16 code values, float32."""
    return torch.tensor(CODE, dtype=torch.float32, device=device)


def packed_width(width: int) -> int:
    """Bytes per packed row of `width` values."""
    return (width + 1) // 2


def blocks(width: int) -> int:
    """Scales per row of `width` values."""
    return (width + BLOCK - 1) // BLOCK


def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [..., ceil(I/2)] uint8, absmax [..., ceil(I/64)] float32) of w [..., I].
    Value 2k sits in byte k's high nibble, value 2k + 1 in its low one."""
    width = w.shape[-1]
    padded = torch.nn.functional.pad(w.float(), (0, blocks(width) * BLOCK - width))
    block_values = padded.unflatten(-1, (-1, BLOCK))
    absmax = block_values.abs().amax(-1)
    # An all-zero block: every value codes to 0 whatever the divisor.
    normed = block_values / torch.where(absmax == 0, 1.0, absmax)[..., None]
    code = code_table(w.device)
    index = torch.bucketize(normed, (code[1:] + code[:-1]) / 2, out_int32=True).to(torch.uint8).flatten(-2)
    index = index[..., :2 * packed_width(width)]
    packed = (index[..., 0::2] << 4) | index[..., 1::2]
    return packed.contiguous(), absmax.contiguous()


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, width: int, dtype=torch.float32) -> torch.Tensor:
    """w [..., width] in `dtype` from `quantize_nf4`'s parts: CODE[index] * absmax in float32,
    then rounded to `dtype` (what the kernel's dequantisation computes)."""
    index = torch.stack((packed >> 4, packed & 15), dim=-1).flatten(-2)[..., :width].long()
    scale = absmax.repeat_interleave(BLOCK, dim=-1)[..., :width]
    return (code_table(packed.device)[index] * scale).to(dtype)
