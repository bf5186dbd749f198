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
])
def test_bad_arguments_get_one_line(argv, says, capsys):
    assert grid.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    assert grid.main(["--experts", "2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
