"""Start the app the way users do: `python run_finetune_ep.py` or `torchrun`; or, where the
property tested needs no process of its own, run the same command line in this one (`run_cli`)."""

import contextlib
import functools
import io
import json
import logging
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from unittest import mock

import torch
from conftest import REPO
from workers.token_cache import tokenize_once


def app_command(args: list[str], nproc: int = 1, script: str = "run_finetune_ep.py") -> list[str]:
    """The command line that starts `script` with `args` on `nproc` ranks, as users start it."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return launcher + [str(REPO / script), *args]


def run_app(args: list[str], nproc: int = 1, timeout: float = 300, script: str = "run_finetune_ep.py"):
    """Run the entry point (or a test worker script) and return the CompletedProcess."""
    return subprocess.run(app_command(args, nproc, script), cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=timeout)


def run_cli(args: list[str], cwd: Path = REPO, script: str = "run_finetune_ep.py") -> subprocess.CompletedProcess:
    """`run_app(args)` without a new process: `te_mixtral.cli.main(args)` in this one, as
    `python run_finetune_ep.py` would run it (from `cwd`, the repository root unless given;
    OMP_NUM_THREADS=1; what it prints and its exit code captured), then this process's state
    put back as it was. Another `script` of the repository's runs as `python SCRIPT` runs it
    (as `__main__`), the same way.

    Starting Python, torch and datasets costs seconds; a short run a fraction of that. Use
    `run_app` where a test needs the process itself: several ranks, signals, the entry script.
    A token stream made before is reused (tests/workers/token_cache.py)."""
    from te_mixtral.cli import main
    from te_mixtral.data import packing

    stdout, stderr = io.StringIO(), io.StringIO()
    threads, rng, argv = torch.get_num_threads(), torch.random.get_rng_state(), sys.argv
    sigint, before = signal.getsignal(signal.SIGINT), os.getcwd()
    try:
        os.chdir(cwd)  # not contextlib.chdir: that is Python 3.11+, the project supports 3.10
        with (mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}), contextlib.redirect_stdout(stdout),
              contextlib.redirect_stderr(stderr), warnings.catch_warnings(),
              mock.patch.object(packing, "token_stream", _token_stream())):
            torch.set_num_threads(1)
            sys.argv = [str(REPO / script), *args]
            _warn_as_python_does()
            try:
                if script == "run_finetune_ep.py":
                    code = main(list(args))
                else:
                    runpy.run_path(str(REPO / script), run_name="__main__")
                    code = 0
            except SystemExit as e:  # argparse, or anything calling sys.exit
                code = e.code or 0
                if not isinstance(code, int):  # sys.exit("message"): printed, exit code 1
                    print(code, file=sys.stderr)
                    code = 1
            except Exception:  # what the interpreter would print on its way out
                traceback.print_exc()
                code = 1
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        signal.signal(signal.SIGINT, sigint)  # training/loop.py installs its Ctrl-C handler
        sys.argv = argv
        os.chdir(before)
        _unbind_log_handlers({id(stdout): "stdout", id(stderr): "stderr"})
    # One process runs without torch.distributed; a group left behind would change later tests.
    assert not torch.distributed.is_initialized()
    return subprocess.CompletedProcess(["run_cli", *args], code, stdout.getvalue(), stderr.getvalue())


@functools.cache
def _token_stream():
    """`run_cli`'s runs' `packing.token_stream`: one for the session."""
    from te_mixtral.data import packing

    return tokenize_once(packing.token_stream)


def _warn_as_python_does() -> None:
    """Inside `warnings.catch_warnings()`: show warnings on (the captured) stderr, filtered as a
    fresh interpreter filters them, not as pytest does (which records them for its summary)."""
    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno, line))


class _CurrentStream:
    """Writes to whatever sys.stdout or sys.stderr is when written to."""

    def __init__(self, name: str):
        self.name = name

    def write(self, text: str) -> int:
        return getattr(sys, self.name).write(text)

    def flush(self) -> None:
        getattr(sys, self.name).flush()


def _unbind_log_handlers(captured: dict[int, str]) -> None:
    """A library first imported during a run (datasets, huggingface_hub) made its log handler
    then, holding that run's captured stream: point it at the current one instead, so that
    later runs capture what it logs and nothing is written into a finished run's buffer."""
    for logger in [logging.root, *logging.root.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in captured:
                handler.setStream(_CurrentStream(captured[id(handler.stream)]))


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

# In the arguments of a planned run (or command), stands for the folder it writes to (a
# training run's --output-dir), so that it can name paths inside it, `f"{RUN_DIR}/ckpt"`,
# before that folder exists.
RUN_DIR = "{run_dir}"
# A planned run [WORKER, SCRIPT, *arguments] is no training run: it runs that worker script of
# tests/workers (see `run_worker`).
WORKER = "--worker"
# A planned run [STOPPED_AT, N, *arguments] is two, in one launch: the run never stopped, into
# its folder's `whole`, then the same run resumed (`--resume`) from what that run would have
# left had it been killed right after its step-N checkpoint, into the folder itself (each with
# its checkpoints in its `ckpt`; tests/workers/train_and_save.py). `train_and_save` answers
# with the resumed run.
STOPPED_AT = "--stopped-at"

_inductor_cache_dir_fixed = False


def fix_inductor_cache_dir() -> None:
    """The environment is part of a run's key, and torch sets TORCHINDUCTOR_CACHE_DIR in this
    process the first time a test compiles: set it before the first key is made, to the folder
    torch would, so that runs launched before and after that test share their keys. (Not at
    every session's start: importing inductor takes a second or two, which a session that
    launches no runs, such as the Triton interpreter's, need not spend.)"""
    global _inductor_cache_dir_fixed
    if not _inductor_cache_dir_fixed:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        cache_dir()
        _inductor_cache_dir_fixed = True


def _run_key(args: list[str], nproc: int, environ: dict[str, str] | None = None) -> tuple:
    fix_inductor_cache_dir()
    # Left out: variables pytest and torch set in this process for themselves. torch.compile sets
    # _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR (an address) for good the first time a test compiles;
    # keyed on it, every run planned before that test would be launched again after it.
    env = tuple(sorted((k, v) for k, v in (os.environ if environ is None else environ).items()
                       if k != "PYTEST_CURRENT_TEST" and not k.startswith("_TORCHINDUCTOR_")))
    return nproc, tuple(args), env


def _job(args: tuple[str, ...], where: Path) -> list | dict:
    """A run as tests/workers/train_and_save.py's RUNS.json lists it, writing into `where`."""
    if args[:1] == (WORKER,):
        _, script, *rest = args
        return {"script": script, "argv": [a.replace(RUN_DIR, str(where / "out")) for a in rest],
                "output": str(where)}
    if args[:1] == (STOPPED_AT,):
        _, step, *rest = args
        return {"stopped_at": int(step), "checkpoints": [str(where / "whole" / "ckpt"), str(where / "ckpt")],
                "whole": _job((*rest, "--checkpoint-dir", str(where / "whole" / "ckpt")), where / "whole"),
                "resumed": _job((*rest, "--checkpoint-dir", str(where / "ckpt"), "--resume"), where)}
    return [str(where / "weights"), [*(a.replace(RUN_DIR, str(where)) for a in args), "--output-dir", str(where)]]


TRAIN_WORKER = "tests/workers/train_and_save.py"


def _runs_args(todo: dict[tuple, Path], spec_file: Path) -> list[str]:
    """The arguments of TRAIN_WORKER that train every run of `todo` ({key: folder}) into its
    folder, one after another, its RUNS.json written to `spec_file`."""
    spec_file.write_text(json.dumps([_job(key[1], where) for key, where in todo.items()]))
    return ["--runs", str(spec_file)]


def launch_many(runs: list[tuple[Path, list[str]]], nproc: int) -> dict[tuple, Path]:
    """Train the runs ([(folder, arguments)], training runs or WORKER scripts) not run before
    in this session, one after another in a single launch (start-up is most of a short CPU
    run's time), and cache them; {key: folder} of those it ran."""
    todo = {}
    for out, args in runs:
        key = _run_key(args, nproc)
        if key not in _cached_runs and key not in todo:
            todo[key] = out if RUN_CACHE_DIR is None else Path(tempfile.mkdtemp(dir=RUN_CACHE_DIR))
    if todo:
        with tempfile.TemporaryDirectory() as scratch:
            proc = run_app(_runs_args(todo, Path(scratch) / "runs.json"), nproc, 300 * len(todo), TRAIN_WORKER)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if RUN_CACHE_DIR is not None:
            _cached_runs.update(todo)
    return todo


def train_and_save_many(runs: list[tuple[Path, list[str]]], nproc: int = 1) -> list[tuple]:
    """`train_and_save` for several runs at once: those not run before in this session train
    one after another in a single launch (`launch_many`)."""
    todo = launch_many(runs, nproc)
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


def run_worker(out: Path, script: str, args: list[str], nproc: int, timeout: float = 300):
    """`run_app(args, nproc, script=script)` for a worker script of tests/workers, RUN_DIR in
    `args` standing for `out`. Where a module plans [WORKER, script, *args] on `nproc` ranks,
    it ran in the session's planned launch: its folder is copied to `out`, and the answer's
    stdout and stderr are each rank's, one after another (a launch that failed caches nothing,
    so a failing script runs here again, alone, and reports)."""
    key = _run_key([WORKER, script, *args], nproc)
    if key not in _cached_runs:
        return run_app([a.replace(RUN_DIR, str(out)) for a in args], nproc, timeout, script)
    where = _cached_runs[key]
    if (where / "out").exists():
        shutil.copytree(where / "out", out, dirs_exist_ok=True)
    stdout, stderr = ("".join((where / f"{name}{rank}").read_text() for rank in range(nproc))
                      for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess([script, *args], 0, stdout, stderr)


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
