"""A frozen base's expert weights in FP8: quantised once as they load, no BF16 copy kept.

Shape suffixes: see te_mixtral/__init__.py.

With LoRA the base never changes, so the `device_mxfp8` tier's Hopper recipe
(fp8_hopper.py) can hold each stacked expert weight as its FP8 fprop operand alone: E4M3
values [L, N, I] and one float32 scale per row (per expert and output channel, over I), a
byte per element where BF16 takes two. That is what puts Mixtral-8x7B's 32 layers on one
H100: its experts take 45 GB in FP8, 90 in BF16.

Rows quantise independently, so a weight fills row block by row block: a Hugging Face
checkpoint's w1, w3 and w2 tensors land in their rows of the stack as they are read
(`FrozenFP8Weight[expert, rows].copy_(tensor)`, what training/hf_checkpoint.py does with any
weight), and the whole model is never in memory in BF16. A seeded initialisation draws each
expert in the dtype a BF16 base would (`normal_`), so the FP8 base is the BF16 base's
quantisation and the two can be compared on one run.

The backward reads the weight in its dgrad orientation, [L, I, N] scaled over N. It is cast
per layer from the FP8 values when the backward reaches it (`fp8_cast.requantize_transposed`)
and freed after: the dgrad sees the weight rounded twice, where a trained weight's dgrad copy
is cast once from BF16 (docs/lora.md states what the FP8 base costs against a BF16 one).

The values are buffers, not parameters, and not in the state dict: a LoRA checkpoint holds
the adapters, and a resumed run reads the base again from `--model` or the seed.
"""

import weakref

import torch
from torch import nn

from te_mixtral.experts.quant.fp8_hopper import quantize_rowwise


class FrozenFP8Weight(nn.Module):
    """One stacked expert weight [L, N, I] as FP8 values and row scales [L, N]."""

    def __init__(self, shape: tuple[int, ...], value_dtype=torch.float8_e4m3fn):
        """Empty (filled by `copy_` or `normal_` on its rows). `value_dtype` float32 keeps
        the scaled values unrounded: a test's data-flow check."""
        super().__init__()
        self.register_buffer("values", torch.empty(shape, dtype=value_dtype), persistent=False)
        self.register_buffer("scale", torch.empty(shape[:-1], dtype=torch.float32), persistent=False)
        # What a seeded initialisation draws in: the dtype a BF16 (or fp32) base would be made in.
        self.source_dtype = torch.get_default_dtype()
        self._dgrad_scale = None  # (values, weakly; (their version, scale's version); the dgrad copy's scales)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def numel(self) -> int:
        return self.values.numel()

    def __getitem__(self, index) -> "FP8Rows":
        return FP8Rows(self.values[index], self.scale[index], self.source_dtype)

    def copy_(self, weight: torch.Tensor) -> "FrozenFP8Weight":
        self[:].copy_(weight)
        return self

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        """The weight the FP8 GEMMs multiply by, in `dtype` (a merged export's base)."""
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


class FP8Rows:
    """Whole rows of a `FrozenFP8Weight` (an index that keeps the last dim), which a loader
    fills like a tensor: `copy_` quantises what it is given, `normal_` draws it first."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, source_dtype: torch.dtype):
        self.values, self.scale, self.source_dtype = values, scale, source_dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @torch.no_grad()
    def copy_(self, weight: torch.Tensor) -> "FP8Rows":
        if weight.shape != self.values.shape:
            raise ValueError(f"cannot fill FP8 rows of shape {tuple(self.shape)} from {tuple(weight.shape)}")
        values, scale = quantize_rowwise(weight.to(self.values.device), value_dtype=self.values.dtype)
        self.values.copy_(values)
        self.scale.copy_(scale)
        return self

    def normal_(self, mean: float, std: float, generator: torch.Generator | None = None) -> "FP8Rows":
        drawn = torch.empty(self.shape, dtype=self.source_dtype, device=self.values.device)
        return self.copy_(drawn.normal_(mean, std, generator=generator))
