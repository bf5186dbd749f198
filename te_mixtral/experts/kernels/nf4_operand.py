"""A stacked weight in NF4 as the grouped GEMMs read it (`grouped_gemm.rows_gemm`).

Shape suffixes: see te_mixtral/__init__.py.

The kernels take it where they take a dense stacked weight [L, N, I]: they read its packed
codes and block scales and dequantise each weight tile in registers (te_mixtral/experts/quant/nf4.py
defines the format; quant/frozen_nf4.py holds a frozen base in it).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NF4Operand:
    packed: torch.Tensor  # [L, N, ceil(I/2)] uint8: value 2k in byte k's high nibble
    scale: torch.Tensor  # [L, N, ceil(I/64)] float32: each block's absmax
    code: torch.Tensor  # [16] float32: the code values
    shape: torch.Size  # [L, N, I], the dense weight's

    @property
    def device(self) -> torch.device:
        return self.packed.device
