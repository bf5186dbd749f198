"""The 4-bit format benchmark's quantisers on the CPU: each round-trips the values its format
can hold exactly, rounds as its format says, and errs less with smaller groups; the CLI runs
on a tiny shape."""

import json

import pytest
import torch

from benchmarks import four_bit_formats as fbf
from te_mixtral.experts.quant.nf4 import CODE, dequantize_nf4, quantize_nf4

GROUPS, ROWS = 6, 3  # a [3, 6 * group] weight per test


def levels_with_extreme(levels: torch.Tensor, extreme: torch.Tensor, group: int, generator) -> torch.Tensor:
    """[ROWS, GROUPS, group] values drawn from `levels`, each group holding one of `extreme`
    (the level that sets its scale) and the last group all zero."""
    values = levels[torch.randint(len(levels), (ROWS, GROUPS, group), generator=generator)]
    values[..., 0] = extreme[torch.randint(len(extreme), (ROWS, GROUPS), generator=generator)]
    values[:, -1] = 0
    return values


def representable(name: str, group: int, generator) -> torch.Tensor:
    """A float64 weight [ROWS, GROUPS * group] that format `name` holds exactly."""
    scale = torch.rand(ROWS, GROUPS, 1, generator=generator, dtype=torch.float64) * 2 + 0.01
    if name == "nf4":  # CODE[i] * absmax in float32, +-1 in every group
        code = torch.tensor(CODE)
        values = levels_with_extreme(code, code[[0, -1]], group, generator) * scale.float()
    elif name == "int4-sym":  # k * scale, k in -7..7, +-7 in every group, scale a float32
        values = levels_with_extreme(torch.arange(-7.0, 8.0), torch.tensor([-7.0, 7.0]), group, generator)
        values = values.double() * scale.float().double()
    elif name == "int4-asym":  # low + k * step, k in 0..15 with 0 and 15 in every group, float16 low and step
        k = levels_with_extreme(torch.arange(16.0), torch.tensor([15.0]), group, generator).double()
        k[..., 1] = 0
        low = (torch.rand(ROWS, GROUPS, 1, generator=generator, dtype=torch.float64) - 1).half().double()
        values = torch.where(k.eq(0).all(-1, keepdim=True) & (torch.arange(GROUPS) == GROUPS - 1)[:, None],
                             0.0, low + k * scale.half().double())
    else:  # mxfp4: +-E2M1 * 2^e, a 4 or a 6 in every group
        grid = torch.tensor(fbf.E2M1_GRID)
        values = levels_with_extreme(torch.cat((grid, -grid)), torch.tensor([4.0, -6.0, 6.0]), group, generator)
        values = values.double() * torch.exp2(torch.randint(-20, 20, (ROWS, GROUPS, 1), generator=generator))
    return values.double().flatten(-2)


@pytest.mark.parametrize("fmt", fbf.FORMATS, ids=lambda f: f.name)
def test_each_format_round_trips_its_own_values_exactly(fmt):
    generator = torch.Generator().manual_seed(1)
    for group in (fmt.group, 16):
        w = representable(fmt.name, group, generator)
        assert w[:, -group:].eq(0).all() and w.ne(0).any()
        assert torch.equal(fmt.round_trip(w, group), w), (fmt.name, group)


def errors_by_group(fmt) -> list[float]:
    """Relative errors of a Gaussian weight at groups of 64, 32, 16 and 8."""
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return [((fmt.round_trip(w, group) - w).norm() / w.norm()).item() for group in (64, 32, 16, 8)]


@pytest.mark.parametrize("fmt", fbf.FORMATS[:3], ids=lambda f: f.name)
def test_a_uniform_or_nf4_codes_error_falls_as_its_group_shrinks(fmt):
    errors = errors_by_group(fmt)
    assert all(larger > smaller for larger, smaller in zip(errors, errors[1:])), (fmt.name, errors)
    assert 0.02 < errors[-1] < 0.8 * errors[0] < 0.2


def test_mxfp4s_error_does_not_fall_as_its_group_shrinks():
    # Its levels are floating point: the error relative to each value hardly depends on the
    # scale, and the power-of-two scale (floor) puts each group's largest value in [4, 8),
    # where E2M1 has only 4 and 6 and saturates: a smaller group puts more values there.
    errors = errors_by_group(fbf.FORMATS[3])
    assert all(smaller < larger for smaller, larger in zip(errors, errors[1:])), errors
    assert 0.1 < errors[0] and errors[-1] < 1.1 * errors[0]


def test_nf4_is_the_shipped_code_on_whole_rows_and_stores_what_it_says():
    w = torch.randn(5, 640, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    packed, absmax = quantize_nf4(w)
    assert torch.equal(fbf.nf4_round_trip(w), dequantize_nf4(packed, absmax, 640, torch.float64))
    assert (packed.numel() + 4 * absmax.numel()) * 8 / w.numel() == fbf.FORMATS[0].bits_per_weight() == 4.5


def test_int4_symmetric_uses_minus_7_to_7_times_absmax_over_7():
    w = torch.tensor([[7.0, -7.0, 3.4, 3.6, -0.5, 0.5, -1.5, 2.5]], dtype=torch.float64)
    assert fbf.int4_symmetric_round_trip(w, 8).tolist() == [[7.0, -7.0, 3.0, 4.0, -0.0, 0.0, -2.0, 2.0]]


def test_mxfp4_rounds_to_nearest_even_and_saturates_as_the_spec_says():
    # amax 4 and 7.5: scale 2^(2 - 2) = 1; amax 8: 2^(3 - 2) = 2 (5, 7 and 0.5 halve to
    # midpoints). Midpoints go to the even mantissa (0, 1, 2, 4); 7.5 and 6.1 saturate to 6;
    # 0.3 rounds to the subnormal 0.5.
    w = torch.tensor([[4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0],
                      [7.5, -5.0, 0.3, -0.2, 2.9, 6.1, 0.0, 1.6],
                      [8.0, 1.0, 3.0, 5.0, 7.0, 11.0, -12.5, 0.5]], dtype=torch.float64)
    assert fbf.mxfp4_round_trip(w, 8).tolist() == [[4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0],
                                                   [6.0, -4.0, 0.5, -0.0, 3.0, 6.0, 0.0, 1.5],
                                                   [8.0, 1.0, 3.0, 4.0, 8.0, 12.0, -12.0, 0.0]]


def test_the_cli_runs_on_a_tiny_shape(tmp_path, capsys):
    out = tmp_path / "formats.json"
    assert fbf.main(["--rows", "2", "--tokens", "3", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["distribution"], r["format"]) for r in results] == [
        (d, f.name) for d in fbf.DISTRIBUTIONS for f in fbf.FORMATS]
    assert {r["format"]: r["bytes_per_weight"] for r in results} == {
        "nf4": 0.5625, "int4-sym": 0.5625, "int4-asym": 0.5625, "mxfp4": 0.53125}
    assert all(0.05 < r["weights"] < 0.25 and 0.05 < r["gemm_output"] < 0.25 for r in results)
    assert "speed not measured" in capsys.readouterr().out


def test_the_cli_refuses_no_rows_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        fbf.main(["--rows", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--rows and --tokens must be at least 1, got 0 and 256")
