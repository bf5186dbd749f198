"""A frozen base's expert weights in FP8: quantised once as they load, no BF16 copy kept.

Shape suffixes: see te_mixtral/__init__.py.

With LoRA the base never changes, so the `device_mxfp8` tier's Hopper recipe
(fp8_hopper.py) can hold each stacked expert weight as its FP8 fprop operand alone: E4M3
values [L, N, I] and one float32 scale per row (per expert and output channel, over I), a
byte per element where BF16 takes two. That is what puts Mixtral-8x7B's 32 layers on one
H100: its experts take 45 GB in FP8, 90 in BF16.

The stack fills row block by row block as a checkpoint loads, and a seeded initialisation
is the BF16 base's quantisation: what every frozen format shares (frozen.py).

The backward reads the weight in its dgrad orientation, [L, I, N] scaled over N. It is cast
per layer from the FP8 values when the backward reaches it (`fp8_cast.requantize_transposed`)
and freed after: the dgrad sees the weight rounded twice, where a trained weight's dgrad copy
is cast once from BF16 (docs/lora.md states what the FP8 base costs against a BF16 one).

"""

import weakref

import torch

from te_mixtral.experts.quant.fp8_hopper import quantize_rowwise
from te_mixtral.experts.quant.frozen import FrozenWeight


class FrozenFP8Weight(FrozenWeight):
    """One stacked expert weight [L, N, I] as FP8 values and row scales [L, N]."""

    format = "FP8"

    def __init__(self, shape: tuple[int, ...], value_dtype=torch.float8_e4m3fn):
        """Empty (filled by `copy_` or `normal_` on its rows). `value_dtype` float32 keeps
        the scaled values unrounded: a test's data-flow check."""
        super().__init__(shape, {"values": ((shape[-1],), value_dtype), "scale": ((), torch.float32)})
        self._dgrad_scale = None  # (values, weakly; (their version, scale's version); the dgrad copy's scales)

    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rowwise(rows, value_dtype=self.values.dtype)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return (self.values.float() * self.scale[..., None]).to(dtype)

    def fprop_operand(self):
        """(values, scales) as `fp8_hopper.FP8HopperGemms.fprop` reads a weight."""
        return (self.values, self.scale), None

    def dgrad_operand(self, requantize_transposed):
        """The dgrad orientation, as `FP8HopperGemms.dgrad` reads it, made now by
        `requantize_transposed` (fp8_cast's, in the values' dtype). Its scales depend on the
        values alone: found once and kept (a few KB) until the values change, so later calls
        cast without first reading the weight for them."""
        versions = (self.values._version, self.scale._version)
        known = self._dgrad_scale
        if known is not None and not (known[0]() is self.values and known[1] == versions):
            known = None  # new values (a load, a move to another device): find the scales again
        operand = requantize_transposed(self.values, self.scale, out_dtype=self.values.dtype,
                                        scale_GI=None if known is None else known[2])
        # A weak reference: replaced values (a move to another device) are not kept alive by it.
        self._dgrad_scale = (weakref.ref(self.values), versions, operand[1])
        return None, operand

    def extra_repr(self) -> str:
        return f"{tuple(self.shape)}, {self.values.dtype}, row scales"
