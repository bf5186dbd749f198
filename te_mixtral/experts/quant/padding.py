"""Pad each expert's rows to a multiple of an alignment, on the device, without a host sync.

Shape suffixes: see te_mixtral/__init__.py.

Low-precision grouped GEMMs want every expert's row count rounded up:

- MXFP8 (TE on Blackwell, and our CPU emulation): the weight-gradient GEMM reduces over
  an expert's rows, so the activations and output gradients are scaled in blocks of 32
  *rows*. A block must not straddle two experts, so every expert starts on a multiple of
  32 (see `te_mxfp8.py` for where TE states this).
- FP8 rowwise on Hopper with `torch._scaled_grouped_mm` (the recipe's reference GEMM): in
  the weight-gradient GEMM the expert boundary moves along the FP8 operands' contiguous
  dim, which its TMA loads need 16-byte aligned (16 FP8 values), and the CUTLASS kernel
  rejects an empty group there. The tier's own Triton GEMMs and casts take any split, so
  the tier asks for no padding (`align` 1, `min_rows` 0), and then nothing is copied.

TE's own `Fp8Padding` takes the split sizes as a Python list, which means copying them to
the host (a sync) every layer. Here the padded row positions are computed on the device. The one
thing the host must know is the padded row count Q, so Q is a *static* bound that holds
for any split: each expert gains at most `align - 1` rows (or `min_rows` if it had none),
so Q = R + L * max_gain rounded down to the alignment always suffices. Whatever is left
over (the "slack", at most about L * align rows) is given to the last expert as extra
zero rows: they produce outputs nobody reads and add nothing to weight gradients.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PaddedRows:
    """Where every input row sits once each expert's row count is rounded up."""

    rows_Q: int  # padded row count: a host int, the same for any split
    splits_L: torch.Tensor  # int64 padded rows per expert; multiples of align; sum == rows_Q
    offsets_L: torch.Tensor  # int32 running end of each expert's rows (grouped_mm's `offs`)
    dest_R: torch.Tensor | None  # int64 padded row that input row r moves to; None: it stays


def _round_up(n, align: int):
    return (n + align - 1) // align * align


def padded_rows(tokens_per_expert_L: torch.Tensor, rows_R: int, align: int, min_rows: int = 0) -> PaddedRows:
    """Where each of `rows_R` rows split as `tokens_per_expert_L` goes once padded, on its device.

    Every expert's rows become a multiple of `align`, and at least `min_rows` (rounded up
    to `align`) even for an expert with no rows.
    """
    if align < 1 or min_rows < 0:
        raise ValueError(f"need align >= 1 and min_rows >= 0, got {align} and {min_rows}")
    counts_L = tokens_per_expert_L.to(torch.int64)
    if align == 1 and min_rows == 0:  # every row stays where it is: no copy, no index
        return PaddedRows(rows_R, counts_L, counts_L.cumsum(0).to(torch.int32), dest_R=None)
    num_experts = counts_L.numel()
    min_rows = _round_up(min_rows, align)

    splits_L = _round_up(counts_L, align).clamp(min=min_rows)
    max_gain = max(align - 1, min_rows)
    rows_Q = (rows_R + num_experts * max_gain) // align * align
    # The slack goes to the last expert, so the splits sum to exactly rows_Q. (Not
    # `splits_L[-1] += ...`: assigning a Python number into a CUDA tensor copies it from
    # the host, a synchronising copy that set_sync_debug_mode("error") rejects.)
    is_last_L = torch.arange(num_experts, device=counts_L.device) == num_experts - 1
    splits_L = splits_L + is_last_L * (rows_Q - splits_L.sum())

    ends_L = counts_L.cumsum(0)
    padded_ends_L = splits_L.cumsum(0)
    shift_L = (padded_ends_L - splits_L) - (ends_L - counts_L)  # padded start - start
    rows = torch.arange(rows_R, device=counts_L.device)
    expert_R = torch.searchsorted(ends_L, rows, right=True)
    return PaddedRows(
        rows_Q=rows_Q,
        splits_L=splits_L,
        offsets_L=padded_ends_L.to(torch.int32),
        dest_R=rows + shift_L[expert_R],
    )


def pad_rows(x_RD: torch.Tensor, padded: PaddedRows) -> torch.Tensor:
    """x_QD: the rows of x_RD at their padded places, zeros elsewhere (differentiable)."""
    if padded.dest_R is None:
        return x_RD
    return x_RD.new_zeros(padded.rows_Q, x_RD.shape[1]).index_copy(0, padded.dest_R, x_RD)


def unpad_rows(y_QD: torch.Tensor, padded: PaddedRows) -> torch.Tensor:
    """y_RD: the rows of y_QD that hold real rows, in input order (differentiable)."""
    if padded.dest_R is None:
        return y_QD
    return _UnpadRows.apply(y_QD, padded.dest_R)


class _UnpadRows(torch.autograd.Function):
    """`index_select`, whose backward copies the gradient rows back instead of adding them:
    the rows are distinct, so a copy is exact, and it needs no atomics (torch's own backward,
    `index_add`, took 0.59 ms where `index_copy` of the same [Q, D] rows took 0.22, at
    4 experts x 4096 rows of Mixtral-8x7B on an H100)."""

    @staticmethod
    def forward(ctx, y_QD, dest_R):
        ctx.save_for_backward(dest_R)
        ctx.rows_Q = y_QD.shape[0]
        return y_QD.index_select(0, dest_R)

    @staticmethod
    def backward(ctx, dy_RD):
        (dest_R,) = ctx.saved_tensors
        return dy_RD.new_zeros(ctx.rows_Q, *dy_RD.shape[1:]).index_copy_(0, dest_R, dy_RD), None
