"""Benchmarks whose tests are their GPU runs: a bad argument is refused on a CPU too, in one
line and exit 2 (argparse's usage above it where the script uses argparse's refusal), never
with a traceback, and before anything is built."""

import pytest

from benchmarks import (
    custom_grouped_bench,
    custom_grouped_host_time,
    expert_ffn,
    lora_fp8_base,
    nf4_accuracy,
    op_profile,
    optimizer_step,
)


def refusal(main, argv: list[str], capsys) -> str:
    """The line `main(argv)` refuses `argv` with (after argparse's usage, if any)."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusal
        code = exit_.code
    assert code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines and not any("Traceback" in line for line in lines), lines
    return lines[-1]


@pytest.mark.parametrize("main, argv, fragment", [
    (expert_ffn.main, ["--quick", "--device", "gpu0"], "argument --device: no device 'gpu0'"),
    (optimizer_step.main, ["--quick", "--device", "gpu0"], "argument --device: no device 'gpu0'"),
    (optimizer_step.main, ["--params", "nan"], "--params must be a number of parameters, 1 or more, got nan"),
    (optimizer_step.main, ["--params", "-1"], "--params must be a number of parameters, 1 or more, got -1"),
    (nf4_accuracy.main, ["--config", "configs/missing.yaml"], "cannot read config configs/missing.yaml"),
    (nf4_accuracy.main, ["--config", "configs/tiny.yaml", "--layers", "0"], "--layers takes 1 or more"),
    (nf4_accuracy.main, ["--config", "configs/tiny.yaml", "--tokens", "1"], "--tokens takes 2 or more"),
    (lora_fp8_base.main, ["--layers", "0"], "--layers takes 1 or more"),
    # CUDA-only scripts: a bad argument is named before the missing GPU is (before, only the GPU was).
    (custom_grouped_bench.main, ["--tokens", "64,many"], "--tokens takes positive integers joined by commas"),
    (custom_grouped_bench.main, ["--tokens", "0"], "--tokens takes positive integers joined by commas"),
    (custom_grouped_bench.main, ["--experts", "0"], "--experts takes 1 or more, got 0"),
    (custom_grouped_bench.main, ["--sweep", "--sweep-budget", "-1"], "--sweep-budget takes seconds above 0"),
    (custom_grouped_host_time.main, ["--cases", "4x"], "--cases takes LxR or R0+R1+... joined by commas; got 4x"),
    # A case of no expert, or of rows below 0, is no case (before: a traceback deep in the op).
    (custom_grouped_host_time.main, ["--cases", "0x64"], "--cases takes LxR or R0+R1+..."),
    (op_profile.main, ["--cases", "2x-8"], "--cases takes LxR or R0+R1+..."),
])
def test_a_bad_argument_is_one_line(main, argv, fragment, capsys):
    line = refusal(main, argv, capsys)
    assert fragment in line, line
