"""A frozen LoRA base's expert weights in NF4 (nf4.py): 4.5 bits per value, no BF16 copy.

Shape suffixes: see te_mixtral/__init__.py.

`lora.base nf4` holds each stacked expert weight [L, N, I] as packed NF4 codes
[L, N, ceil(I/2)] and one float32 absmax per block of 64 values along I, [L, N, ceil(I/64)]:
0.56 bytes per weight where BF16 takes 2, so Mixtral-8x7B's experts take 25 GB, not 90.
It fills row block by row block as the checkpoint loads, and a seeded initialisation is the
BF16 base's quantisation (frozen.py).

The `custom_grouped` tier's Triton GEMMs read the packed codes and dequantise each tile of
the weight in registers inside their reduction loop, in the forward (x @ W.T) and the dgrad
(dy @ W) alike (kernels/grouped_gemm.py); with many rows per expert one kernel dequantises
the weight whole into a transient BF16 copy before each GEMM instead (kernels/nf4_decode.py);
elsewhere the weight is dequantised whole and multiplied in torch (`dequantized`), the same
numbers.
"""

import torch

from te_mixtral.experts.kernels.nf4_operand import NF4Operand
from te_mixtral.experts.quant.frozen import FrozenWeight
from te_mixtral.experts.quant.nf4 import (
    blocks,
    code_table,
    dequantize_nf4,
    packed_width,
    quantize_nf4,
)


class FrozenNF4Weight(FrozenWeight):
    """One stacked expert weight [L, N, I] as NF4 codes, two to a byte, and block scales."""

    format = "NF4"

    def __init__(self, shape: tuple[int, ...]):
        super().__init__(shape, {"packed": ((packed_width(shape[-1]),), torch.uint8),
                                 "scale": ((blocks(shape[-1]),), torch.float32)})
        self._code = None

    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_nf4(rows)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_nf4(self.packed, self.scale, self.row_width, dtype)

    def operand(self) -> NF4Operand:
        """What the grouped GEMMs read in place of a dense weight."""
        if self._code is None or self._code.device != self.packed.device:
            self._code = code_table(self.packed.device)
        return NF4Operand(self.packed, self.scale, self._code, self.shape)

    def extra_repr(self) -> str:
        return f"{tuple(self.shape)}, NF4, absmax per 64 values"
