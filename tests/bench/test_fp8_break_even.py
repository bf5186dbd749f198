"""The FP8 break-even benchmark's reading of its own table: the fewest rows per expert from
which FP8 stays faster (the timing itself needs a Hopper GPU)."""

from benchmarks.fp8_break_even import FEW_ROWS, break_even
from te_mixtral.experts.device_mxfp8 import runs_fp8
from te_mixtral.experts.options import FP8Options


def test_the_break_even_is_where_fp8_stays_faster():
    # FP8 ahead at 768, behind at 1024 again, ahead from 1536 on: it pays from 1536.
    assert break_even([(512, 0.94), (768, 1.02), (1024, 0.99), (1536, 1.2), (4096, 1.5)]) == 1536
    assert break_even([(1024, 1.16), (512, 0.94), (4096, 1.55)]) == 1024  # any order
    assert break_even([(16, 1.3), (64, 1.1)]) == 16  # faster everywhere: the smallest measured
    assert break_even([(512, 1.1), (1024, 1.0)]) is None  # level at the largest is not faster
    assert break_even([]) is None


def test_the_few_rows_points_reach_the_default_threshold():
    # The one-expert sweep shows the default's switch: points under it run BF16, its last runs FP8.
    default = FP8Options().min_rows_per_expert
    assert FEW_ROWS[0] == 16 and runs_fp8(FEW_ROWS[-1], 1, default) and not runs_fp8(FEW_ROWS[-2], 1, default)
