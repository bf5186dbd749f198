"""Start the app the way users do: `python run_finetune_ep.py` or `torchrun`."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
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


# Where train_and_save keeps each distinct run it launched (set per session by conftest.py):
# a run with the same arguments, rank count and environment is launched once and copied.
RUN_CACHE_DIR: Path | None = None
_cached_runs: dict[tuple, Path] = {}


def _run_key(args: list[str], nproc: int) -> tuple:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))
    return nproc, tuple(args), env


def train_and_save_many(runs: list[tuple[Path, list[str]]], nproc: int = 1) -> list[tuple]:
    """`train_and_save` for several runs at once: those not run before in this session train
    one after another in a single launch (start-up is most of a short CPU run's time)."""
    todo = {}
    for out, args in runs:
        key = _run_key(args, nproc)
        if key not in _cached_runs and key not in todo:
            todo[key] = out if RUN_CACHE_DIR is None else Path(tempfile.mkdtemp(dir=RUN_CACHE_DIR))
    if todo:
        spec = [[str(where / "weights"), [*key[1], "--output-dir", str(where)]] for key, where in todo.items()]
        with tempfile.TemporaryDirectory() as scratch:
            spec_file = Path(scratch) / "runs.json"
            spec_file.write_text(json.dumps(spec))
            proc = run_app(["--runs", str(spec_file)], nproc=nproc, timeout=300 * len(spec),
                           script="tests/workers/train_and_save.py")
        assert proc.returncode == 0, proc.stderr[-3000:]
        if RUN_CACHE_DIR is not None:
            _cached_runs.update(todo)
    outputs = []
    for out, args in runs:
        where = todo.get(_run_key(args, nproc)) or _cached_runs[_run_key(args, nproc)]
        if where != out:
            shutil.copytree(where, out, dirs_exist_ok=True)
        results = json.loads((out / "results.json").read_text())
        weights = [torch.load(out / "weights" / f"rank{r}.pt") for r in range(nproc)]
        grads = [torch.load(out / "weights" / f"grads{r}.pt") for r in range(nproc)]
        outputs.append((results, weights, grads))
    return outputs


def train_and_save(out: Path, args: list[str], nproc: int = 1) -> tuple[dict, list[dict], list[list[dict]]]:
    """Train through tests/workers/train_and_save.py into `out`: the run's results.json, and
    for each rank its final weights and the gradients it held after each all-reduce of them."""
    return train_and_save_many([(out, args)], nproc)[0]


# A short run that expert-parallel tests repeat in several layouts and compare.
EP_STEPS = 5
EP_ARGS = ["--steps", str(EP_STEPS), "--timing_warmup_steps", "1", "--batch_size", "4", "--seq_len", "64",
           "--log_every", "1"]


def train_ep(tmp_path: Path, name: str, nproc: int, ep: int, *extra: str) -> tuple[list[float], list[dict]]:
    """Train the short run (`EP_ARGS`, then `extra`) at EP=`ep` on `nproc` ranks: each step's
    loss, and each rank's weights (whole, as an unsharded rank holds them)."""
    results, weights, _ = train_and_save(tmp_path / name, [*EP_ARGS, "--ep-size", str(ep), *extra], nproc)
    return results["losses"], weights



def train_ep_many(tmp_path: Path, nproc: int, runs: dict[str, tuple]) -> dict[str, tuple[list[float], list[dict]]]:
    """`train_ep` for several runs on `nproc` ranks, in one launch: `runs` maps a name (the
    folder under `tmp_path`) to `(ep, *extra)`; the answer maps it to (losses, weights)."""
    outputs = train_and_save_many([(tmp_path / name, [*EP_ARGS, "--ep-size", str(ep), *extra])
                                   for name, (ep, *extra) in runs.items()], nproc)
    return {name: (results["losses"], weights) for name, (results, weights, _) in zip(runs, outputs)}
