"""What a catalog is made of: a `Launch` (one command a run starts, with how much of its output
to show), a `Note` (a line printed in its place), and the builders more than one catalog uses.
A catalog maps a run's name to a list of these; scripts/gpu_runs.py launches them."""

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Launch:
    """One command: `python3 ARGS`, under torchrun when `nproc` > 1 (or `program` ARGS).
    "{out}" in ARGS stands for OUT_DIR."""

    name: str  # its log is OUT_DIR/NAME.log; a failure is listed by this name
    nproc: int
    args: tuple[str, ...]
    program: tuple[str, ...] = ("python3",)
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    tail: int | None = 18  # lines shown at the end (per-step lines left out); None: all of it as it comes
    show: int = 0  # also show each "=== " heading of the log with this many lines after it (a table)
    timeout_s: int | None = None  # stopped past this many seconds (coreutils' timeout), a failure

    def command(self, out: Path) -> list[str]:
        program = list(self.program)
        if self.nproc > 1:
            program = ["torchrun", "--standalone", f"--nproc_per_node={self.nproc}"]
        if self.timeout_s:
            program = ["timeout", "--kill-after=10", str(self.timeout_s), *program]
        return program + [arg.replace("{out}", str(out)) for arg in self.args]


@dataclass(frozen=True)
class Note:
    """A line printed in place of a launch (a run left out, and why)."""

    text: str


# Every call's first launch: which GPUs the machine has.
GPUS = Launch("nvidia-smi", 1, ("--query-gpu=index,name,memory.total,driver_version", "--format=csv"),
              program=("nvidia-smi",), tail=None)


def pytest_gpu(name: str, *tests: str) -> list[Launch]:
    """pytest on `tests` (paths, markers, flags), quiet."""
    return [Launch(name, 1, ("-m", "pytest", "-q", *tests))]


def gemm_tiles(name: str, cases: str, *extra: str) -> Launch:
    """benchmarks/custom_grouped_gemms.py at `cases` (with `extra`'s arguments), its last lines
    (the sums, the picks) shown, its --json at OUT_DIR/NAME.json; it starts no tile but the
    tables' own after 200 s."""
    return Launch(name, 1, ("-m", "benchmarks.custom_grouped_gemms", "--cases", cases, *extra, "--budget-s", "200",
                            "--json", f"{{out}}/{name}.json"), tail=32)
