"""Start the app the way users do: `python run_finetune_ep.py` or `torchrun`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import REPO


def run_app(args: list[str], nproc: int = 1, timeout: float = 300, script: str = "run_finetune_ep.py"):
    """Run the entry point (or a test worker script) and return the CompletedProcess."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(launcher + [str(REPO / script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(proc, *fragments):
    """The run failed with one `te_mixtral: error:` line holding every fragment, and no traceback
    from our code; return the error lines (one per rank)."""
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("te_mixtral: error:")]
    assert lines, proc.stderr[-2000:]
    # torchrun's own agent prints a traceback of its ChildFailedError; none may come from our code.
    assert "run_finetune_ep.py\", line" not in proc.stderr and "te_mixtral/" not in proc.stderr, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines


def train_and_save(out: Path, args: list[str], nproc: int = 1) -> tuple[dict, list[dict], list[list[dict]]]:
    """Train through tests/workers/train_and_save.py into `out`: the run's results.json, and
    for each rank its final weights and the gradients it held after each all-reduce of them."""
    proc = run_app([str(out / "weights"), *args, "--output-dir", str(out)], nproc=nproc,
                   script="tests/workers/train_and_save.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    weights = [torch.load(out / "weights" / f"rank{r}.pt") for r in range(nproc)]
    grads = [torch.load(out / "weights" / f"grads{r}.pt") for r in range(nproc)]
    return results, weights, grads


# A short run that expert-parallel tests repeat in several layouts and compare.
EP_STEPS = 5
EP_ARGS = ["--steps", str(EP_STEPS), "--timing_warmup_steps", "1", "--batch_size", "4", "--seq_len", "64",
           "--log_every", "1"]


def train_ep(tmp_path: Path, name: str, nproc: int, ep: int, *extra: str) -> tuple[list[float], list[dict]]:
    """Train the short run (`EP_ARGS`, then `extra`) at EP=`ep` on `nproc` ranks: each step's
    loss, and each rank's weights (whole, as an unsharded rank holds them)."""
    results, weights, _ = train_and_save(tmp_path / name, [*EP_ARGS, "--ep-size", str(ep), *extra], nproc)
    return results["losses"], weights

