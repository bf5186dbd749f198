"""quant/padding.py: rows padded per expert on the device, to a size the host knows without the split."""

import pytest
import torch
from quant_reference import random_splits

from te_mixtral.experts.quant import mxfp8
from te_mixtral.experts.quant.padding import pad_rows, padded_rows, unpad_rows
from te_mixtral.experts.quant.te_mxfp8 import MXFP8_ROW_ALIGN


@pytest.mark.parametrize("align, min_rows", [(32, 0), (16, 16), (1, 0), (32, 5)])
def test_padding_round_trip_with_fresh_random_splits(align, min_rows):
    gen = torch.Generator().manual_seed(align + min_rows)
    for trial in range(20):
        num_experts = int(torch.randint(1, 9, (1,), generator=gen))
        counts = random_splits(num_experts, 100, gen) if trial % 5 else torch.zeros(num_experts, dtype=torch.int64)
        rows = int(counts.sum())
        padded = padded_rows(counts, rows, align, min_rows)

        splits = padded.splits_L
        assert int(splits.sum()) == padded.rows_Q
        assert (splits % align == 0).all() and (splits >= counts).all()
        assert (splits[counts == 0][:-1] >= min_rows).all() if num_experts > 1 else True
        assert torch.equal(padded.offsets_L, splits.cumsum(0).to(torch.int32))
        # The padded size is a function of the row count alone: the host never needs the split.
        other_split = torch.tensor([rows] + [0] * (num_experts - 1))
        assert padded.rows_Q == padded_rows(other_split, rows, align, min_rows).rows_Q

        x_RD = torch.randn(rows, 3, generator=gen)
        x_QD = pad_rows(x_RD, padded)
        assert torch.equal(unpad_rows(x_QD, padded), x_RD)
        assert (x_QD is x_RD) == (align == 1 and min_rows == 0)  # nothing to pad: not even a copy
        starts = (padded.offsets_L.long() - splits).tolist()
        for e, (start, n) in enumerate(zip(starts, counts.tolist())):
            first = int(counts[:e].sum())
            assert torch.equal(x_QD[start:start + n], x_RD[first:first + n])  # in order, at the start
            assert x_QD[start + n:start + int(splits[e])].eq(0).all()  # then zeros


def test_padding_is_differentiable_and_mxfp8_alignment_is_the_block():
    padded = padded_rows(torch.tensor([3, 0, 33]), 36, align=MXFP8_ROW_ALIGN)
    x_RD = torch.randn(36, 4, requires_grad=True)
    dy = torch.randn(36, 4)
    unpad_rows(pad_rows(x_RD, padded) * 2, padded).backward(dy)
    assert torch.equal(x_RD.grad, 2 * dy)
    assert MXFP8_ROW_ALIGN == mxfp8.BLOCK_SIZE == 32
    assert padded.splits_L.tolist()[:2] == [32, 0] and padded.splits_L[2] >= 64


def test_unpadding_sends_each_gradient_row_back_to_its_padded_row():
    padded = padded_rows(torch.tensor([5, 0, 17, 2]), 24, align=16)
    y_QD = torch.randn(padded.rows_Q, 3, requires_grad=True)
    dy_RD = torch.randn(24, 3)
    unpad_rows(y_QD, padded).backward(dy_RD)
    expected = torch.zeros(padded.rows_Q, 3).index_add_(0, padded.dest_R, dy_RD)  # torch's own backward
    assert torch.equal(y_QD.grad, expected)
    assert y_QD.grad.abs().sum(1).ne(0).sum() == 24  # padding rows get no gradient

