"""The loss check (`te_mixtral/measure/loss_check.py`): what passes, what fails and how the
table names it."""

import math
import subprocess
import sys

import pytest
from conftest import REPO

from te_mixtral.errors import UserError
from te_mixtral.measure.loss_check import TOLERANCES, check_losses

LOSSES = [10.4, 9.8, 9.1, 8.7, 8.2, 7.9]


def test_identical_losses_pass():
    for precision in TOLERANCES:
        result = check_losses(LOSSES, LOSSES, precision)
        assert result.passed and result.max_rel_diff == 0.0


def test_within_tolerance_passes():
    assert check_losses([LOSSES[0] * (1 + 1e-3)] + [x * 1.01 for x in LOSSES[1:]], LOSSES, "bf16").passed
    assert check_losses([x * (1 + 5e-6) for x in LOSSES], LOSSES, "fp32").passed


@pytest.mark.parametrize("precision, factor", [("bf16", 1.12), ("fp32", 1 + 1e-3)])
def test_one_bad_step_fails_and_is_named(precision, factor):
    run = list(LOSSES)
    run[3] *= factor
    result = check_losses(run, LOSSES, precision)
    assert not result.passed
    assert result.worst_step == 3
    assert result.max_rel_diff == pytest.approx(factor - 1)
    row = result.table().splitlines()[2 + 3]  # header, rule, steps 0..2, then step 3
    assert row.split()[0] == "3" and row.endswith("FAIL")
    assert sum(line.endswith("FAIL") for line in result.table().splitlines()) == 1


def test_bf16_noise_passes_but_a_shifted_curve_fails():
    """Steps scattered both ways by 6 % pass; every step 4 % high (a bug's signature) fails."""
    scattered = [x * (1.06 if i % 2 else 0.94) for i, x in enumerate(LOSSES)]
    scattered[0] = LOSSES[0]
    assert check_losses(scattered, LOSSES, "bf16").passed
    shifted = [LOSSES[0]] + [x * 1.04 for x in LOSSES[1:]]
    result = check_losses(shifted, LOSSES, "bf16")
    assert not result.passed and result.max_rel_diff <= TOLERANCES["bf16"].per_step
    assert result.mean_diff > TOLERANCES["bf16"].mean


def test_first_step_is_held_to_the_forward_pass_rounding():
    run = [LOSSES[0] * 1.01] + LOSSES[1:]
    result = check_losses(run, LOSSES, "bf16")
    assert not result.passed and result.first_step_diff == pytest.approx(0.01)
    assert result.table().splitlines()[2].endswith("FAIL")


def test_nan_fails():
    run = list(LOSSES)
    run[2] = math.nan
    result = check_losses(run, LOSSES, "bf16")
    assert not result.passed and result.worst_step == 2
    assert "non-finite loss at step 2" in result.table()


def test_nan_in_reference_or_after_it_fails():
    assert not check_losses(LOSSES, [math.nan] + LOSSES[1:], "bf16").passed
    diverged = check_losses(LOSSES + [math.inf], LOSSES, "bf16")  # past the reference's end
    assert not diverged.passed and diverged.worst_step == len(LOSSES)


def test_shorter_reference_compares_its_steps():
    result = check_losses(LOSSES, LOSSES[:3], "fp32")
    assert result.passed
    assert "3 steps" in result.table()


def test_zero_steps_and_unknown_precision_are_errors():
    with pytest.raises(UserError, match="nothing to compare"):
        check_losses(LOSSES, [], "bf16")
    with pytest.raises(UserError, match="no loss tolerance"):
        check_losses(LOSSES, LOSSES, "fp16")


def test_loss_check_does_not_import_torch():
    code = "import sys, te_mixtral.measure.loss_check; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
