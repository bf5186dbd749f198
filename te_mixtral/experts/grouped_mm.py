"""Per-expert GEMMs through torch's grouped GEMM (`F.grouped_mm`), with its alignment rule
handled: the custom_grouped tier's path off the GPU, and LoRA's adapter GEMMs on it.

Shape suffixes: see te_mixtral/__init__.py. `offs_L` is the int32 cumulative row ends
of the experts (grouped_mm's offsets), made on the device: no host sync.

grouped_mm wants 16-byte aligned row strides: an odd I, N (or adapter rank) is zero-padded,
padding that contributes exactly zero; a no-op at real model shapes.
"""

import torch
import torch.nn.functional as F


def offsets(tokens_per_expert_L: torch.Tensor) -> torch.Tensor:
    """grouped_mm's offsets of the experts' rows: their int32 cumulative ends, on the device."""
    return torch.cumsum(tokens_per_expert_L, 0, dtype=torch.int32)


def _align(t: torch.Tensor) -> int:
    return max(1, 16 // t.element_size())


def grouped_matmul(x_RI: torch.Tensor, w_LNI: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    """y_RN = x_RI @ w_LNI[e].T over each expert e's rows."""
    n = w_LNI.shape[1]
    pad_i, pad_n = -x_RI.shape[1] % _align(x_RI), -n % _align(x_RI)
    if pad_i:
        x_RI, w_LNI = F.pad(x_RI, (0, pad_i)), F.pad(w_LNI, (0, pad_i))
    if pad_n:
        w_LNI = F.pad(w_LNI, (0, 0, 0, pad_n))
    y_RN = F.grouped_mm(x_RI, w_LNI.transpose(-2, -1), offs=offs_L)
    return y_RN[:, :n] if pad_n else y_RN


def grouped_wgrad(a_RM: torch.Tensor, b_RN: torch.Tensor, offs_L: torch.Tensor) -> torch.Tensor:
    """w_LMN = a_RM[rows of e].T @ b_RN[rows of e] for every expert e (a weight gradient's form)."""
    m, n = a_RM.shape[1], b_RN.shape[1]
    pad_m, pad_n = -m % _align(a_RM), -n % _align(b_RN)
    if pad_m:
        a_RM = F.pad(a_RM, (0, pad_m))
    if pad_n:
        b_RN = F.pad(b_RN, (0, pad_n))
    return F.grouped_mm(a_RM.t(), b_RN, offs=offs_L)[:, :m, :n]
