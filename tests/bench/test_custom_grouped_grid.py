"""The BF16 grid benchmark's cases and its refusals (the timing itself needs a GPU)."""

import pytest
import torch

from benchmarks import custom_grouped_grid as grid


@pytest.mark.parametrize("experts", [2, 3, 4, 8])
@pytest.mark.parametrize("per_expert", [16, 100, 4096])
def test_every_split_keeps_the_rows_and_has_its_shape(experts, per_expert):
    total = experts * per_expert
    uniform, skewed, empty = (grid.split_sizes(kind, experts, per_expert) for kind in grid.SPLITS)
    assert uniform == [per_expert] * experts
    for sizes in (skewed, empty):
        assert len(sizes) == experts and sum(sizes) == total and min(sizes) >= 0
    # one expert takes 70 %, plus what rounding the others left over
    assert skewed[0] == max(skewed) and abs(skewed[0] - 0.7 * total) <= experts
    assert empty[-1] == 0 and min(empty[:-1]) > 0  # exactly one expert gets nothing


def test_uneven_splits_need_two_experts():
    assert grid.split_sizes("uniform", 1, 64) == [64]
    assert grid.split_sizes("skewed", 1, 64) is None and grid.split_sizes("empty", 1, 64) is None


@pytest.mark.parametrize("argv,says", [
    (["--splits", "uniform,lopsided"], "--splits takes uniform, skewed, empty"),
    (["--tiles", "huge"], "no tile table 'huge'"),
    (["--tokens", "16,x"], "take positive integers"),
    (["--experts", "0"], "take positive integers"),
    (["--tiers", "loop,fast"], "--tiers takes none or any of loop, grouped_linear, device_mxfp8"),
])
def test_bad_arguments_get_one_line(argv, says, capsys):
    assert grid.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    assert grid.main(["--experts", "2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_bytes_are_each_gemms_operands_read_once_and_results_written_once():
    """`op_bytes` and each GEMM's `gemm_elements` against the op's six GEMMs one by one
    (docs/kernels.md's table), at Mixtral-8x7B widths over an uneven split with an empty expert."""
    from benchmarks.custom_grouped_ops import OPS, gemm_elements, gemm_flops, op_bytes, op_flops

    sizes, D, F = [40, 0, 24], 4096, 14336
    R, L = sum(sizes), len(sizes)
    x = y = dy = dx = R * D
    h = dh = R * 2 * F
    act = R * F
    w1, w2 = L * 2 * F * D, L * D * F
    gemms = [  # (read, written) elements
        (x + w1, h + act),          # gate_up + SwiGLU
        (act + w2, y),              # down
        (dy + w2 + h, dh + act),    # down dgrad + SwiGLU' (dh in place of h), act again
        (dy + act, w2),             # down wgrad
        (dh + w1, dx),              # gate_up dgrad
        (dh + x, w1),               # gate_up wgrad
    ]
    assert [gemm_elements(op, sizes, D, F) for op in OPS] == gemms
    assert op_bytes(sizes, D, F) == 2 * sum(read + written for read, written in gemms)
    assert [gemm_flops(op, sizes, D, F) for op in OPS] == [2 * R * D * F * n for n in (2, 1, 1, 1, 2, 2)]
    assert op_flops(sizes, D, F) == 2 * R * D * F * (2 + 1 + 1 + 1 + 2 + 2)


def test_every_kernel_a_point_runs_is_compiled_first():
    """The precompile jobs hold every GEMM of the table ours runs at each point and of each
    `--tiles` table, with the point's expert count (its own compile) and rows per expert."""
    from benchmarks.custom_grouped_ops import OPS, table_at
    from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, regime

    points = [[16], [64, 64], [1024] * 8, [1000] * 8]  # the last two: the same kernels
    jobs = grid.kernel_jobs(["previous"], points)
    for sizes in points[:3]:
        L, per_expert = len(sizes), sizes[0]
        for table in (CONFIGS[regime(sum(sizes), L)], table_at("previous", sum(sizes), L)):
            for op in OPS:
                assert (op, table[op], per_expert, L) in jobs
    assert len(jobs) == len({(op, str(config), L) for op, config, _, L in jobs})  # each kernel once


def test_previous_tables_run_only_where_they_differ():
    """`--tiles previous` adds a column where the tables before the few-rows ones chose
    another table (few rows per expert), not where they are today's."""
    from benchmarks.custom_grouped_ops import PREVIOUS, table_at

    assert table_at("previous", 64, 1) == PREVIOUS["small, 1 expert"]
    assert table_at("previous", 32, 2) == PREVIOUS["split-K"]
    assert "ours, previous" in grid.point_ops({"ours": None}, ["previous"], [16, 16])
    assert "ours, previous" not in grid.point_ops({"ours": None}, ["previous"], [4096] * 4)


def test_a_point_line_and_the_summary_name_a_failed_op(capsys):
    timed = {"split": "uniform", "tokens": 64, "experts": 2, "sizes": [64, 64], "floor_ms": 0.5,
             "compute_floor_ms": 0.1, "ms": {"ours": 0.6, "grouped_mm": 0.7}, "gpu_ms": {"ours": 0.55, "grouped_mm": 0.6},
             "rel_diff": {"ours": 4e-3, "grouped_mm": 0.0}, "errors": {"TE": "RuntimeError: no"}, "best_peer": "grouped_mm",
             "ratio": 0.7 / 0.6, "gpu_ratio": 0.6 / 0.55, "floor_ratio": 1.2, "roofline_ratio": 1.2}
    failed = {"split": "uniform", "tokens": 16, "experts": 1, "sizes": [16], "floor_ms": 0.3, "compute_floor_ms": 0.01,
              "ms": {"grouped_mm": 0.7}, "gpu_ms": {"grouped_mm": 0.6}, "rel_diff": {"grouped_mm": 0.0},
              "errors": {"ours": "CompilationError: out of resources"}}
    assert "TE FAILED: RuntimeError: no" in grid.point_line(timed) and "x1.20" in grid.point_line(timed)
    assert "diff 4.0e-03" in grid.point_line(timed)
    assert "ours FAILED: CompilationError" in grid.point_line(failed)
    grid.print_summary([timed, failed], "8x7b", [1, 2], ["uniform"], [16, 64])
    out = capsys.readouterr().out
    assert "| uniform | 64 | — | 1.17 |" in out and "2 points with an op that failed" in out
    assert "0 of 1 points of at most 512 rows per expert above 1.3x the bandwidth floor" in out


def test_each_tier_gets_its_own_ratios_and_tables(capsys):
    """A tier's ratio is the best peer's step time over its own, its floor ratio its own
    step time over the floor; the summary prints its tables and names its misses."""
    ms = {"ours": 0.5, "grouped_mm": 0.6, "TE": 0.4, "loop tier": 2.0, "device_mxfp8 tier": 0.52}
    tiers = grid.tier_ratios(ms, 0.4, 0.25)
    assert tiers == {"loop": {"ratio": 0.2, "floor_ratio": 8.0},
                     "device_mxfp8": {"ratio": 0.4 / 0.52, "floor_ratio": 0.52 / 0.25}}
    point = {"split": "uniform", "tokens": 64, "experts": 2, "sizes": [64, 64], "floor_ms": 0.25,
             "compute_floor_ms": 0.1, "ms": ms, "gpu_ms": ms, "rel_diff": {}, "errors": {}, "best_peer": "TE",
             "ratio": 0.8, "gpu_ratio": 0.8, "floor_ratio": 2.0, "roofline_ratio": 2.0, "tiers": tiers}
    grid.print_summary([point], "8x7b", [2], ["uniform"], [64], ["loop", "device_mxfp8"])
    out = capsys.readouterr().out
    assert "loop tier: floor_ratio" in out and "| uniform | 64 | 8.00 |" in out and "| uniform | 64 | 2.08 |" in out
    assert "device_mxfp8 tier: 1 of 1 points below 0.97 of the best peer" in out
    assert "loop tier: 1 of 1 points of at most 512 rows per expert above 1.3x the bandwidth floor: uniform 64 x 2 x8.00" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals on a machine without a GPU")
def test_a_tier_that_cannot_run_is_left_out_with_its_reason(capsys):
    assert list(grid.tier_ops(["loop", "grouped_linear", "device_mxfp8"], "8x7b")) == ["loop tier"]
    out = capsys.readouterr().out
    assert out.count("skipped") == 2 and "tier grouped_linear skipped:" in out and "tier device_mxfp8 skipped:" in out


def test_device_mxfp8_is_timed_with_its_run_defaults():
    """The tier as a run builds it: the default break-even (so BF16 kernels at few rows),
    the mode the GPU picks, the family's widths."""
    from te_mixtral.experts.options import FP8Options
    from te_mixtral.experts.registry import make_tier

    tier = make_tier("device_mxfp8", grid.run_config("device_mxfp8", "8x22b"))
    assert tier.min_rows_per_expert == FP8Options().min_rows_per_expert > grid.FLOOR_ROWS
    assert tier.requested_mode == "auto" and tier.model_dims == (6144, 16384)
