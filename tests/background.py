"""Work a session plans when it is collected, done by two threads of its own from its start
while other tests run (conftest.py's `_planned_in_background`): the planned launches of
training runs (`launch_planned`), one per rank count, and the commands modules list in
`PLANNED_COMMANDS`. On a machine of a few cores this pays: a launch rarely keeps two cores busy
(its launcher imports alone, gloo's ranks wait on each other), a command rarely more than one,
and most tests beside them keep one; and with two at a time, neither core waits for the other
while the session's last tests wait for this work. Each thread takes the next piece of work
when it is done with one, the longest first as far as known: the commands marked `long` (the
interpreter run, the README's commands), then the launches by their runs times ranks, then
the other commands.

Each piece of work gets the environment this process had when it was planned, and is used
only where this process's environment is still that one (else it is done again, when needed).
"""

import os
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import launch
from conftest import REPO


@dataclass(frozen=True)
class Command:
    """A subprocess a test runs from the repository root: `argv`, with `env` set on top of
    this process's environment (a None value unsets the variable). RUN_DIR in either stands for
    an empty folder of the command's own. A module lists the commands its tests run in
    `PLANNED_COMMANDS`, and its tests run them through conftest.py's `planned_command`. A `long`
    one (a minute of CPU or more) starts before the planned launches, so that it is done by
    the time the session's last tests wait for it."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str | None], ...] = ()
    timeout: float = 600
    long: bool = False

    def _argv(self, folder: Path) -> list[str]:
        return [a.replace(launch.RUN_DIR, str(folder)) for a in self.argv]

    def _environ(self, folder: Path, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        for name, value in self.env:
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value.replace(launch.RUN_DIR, str(folder))
        return env

    def run(self, folder: Path) -> subprocess.CompletedProcess:
        """Run it now, RUN_DIR standing for `folder`."""
        return subprocess.run(self._argv(folder), cwd=REPO, env=self._environ(folder, dict(os.environ)),
                              capture_output=True, text=True, timeout=self.timeout)


@dataclass(frozen=True)
class InterpreterTests:
    """A test module's `test_interpreter*` tests, which run with TRITON_INTERPRET=1: set before
    triton is first imported, so not in this process (tests/README.md). A module lists
    `interpreter_run(__file__)` in its PLANNED_COMMANDS; the session runs those of every module
    in one fresh pytest (`interpreter_command`: one start-up, not one per module)."""

    test_file: str


def interpreter_run(test_file: str) -> InterpreterTests:
    return InterpreterTests(test_file)


def interpreter_command(planned: list[InterpreterTests], slow: bool) -> Command:
    """The `test_interpreter*` tests of the modules `planned`, in one fresh pytest with
    TRITON_INTERPRET=1, each test's outcome listed (-rA) for `assert_passed`; those marked slow
    too where `slow` (the session that plans it runs them: conftest.py's `keeps_slow`)."""
    files = sorted({tests.test_file for tests in planned})
    runslow = ["--runslow"] if slow else []
    return Command((sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *runslow, *files, "-k",
                    "test_interpreter"), (("TRITON_INTERPRET", "1"),), long=True)


def assert_passed(result: subprocess.CompletedProcess, test_file: str | None = None) -> None:
    """A pytest run ran tests of which none failed; with `test_file`, of a run of several
    modules (`interpreter_command`): that module's tests ran, and none of them failed."""
    if test_file is None:
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
        assert " passed" in result.stdout and " failed" not in result.stdout
        return
    module = Path(test_file).resolve().relative_to(REPO).as_posix()
    outcomes = [line.split(" ", 1) for line in result.stdout.splitlines()
                if line.startswith(("PASSED ", "FAILED ", "ERROR ")) and module in line]
    failed = [line for outcome, line in outcomes if outcome != "PASSED"]
    assert result.returncode in (0, 1) and outcomes and not failed, \
        "\n".join(failed) + "\n" + result.stdout[-6000:] + result.stderr[-3000:]


class PlannedInBackground:
    """The planned launches ({nproc: [arguments, ...]}) and commands, done by `threads` threads
    started as soon as this is made (see the module)."""

    def __init__(self, runs: dict[int, list[list[str]]], commands: list[Command], folder: Path, threads: int = 2):
        launch.fix_inductor_cache_dir()
        self.environ = dict(os.environ)
        self._launched = {nproc: threading.Event() for nproc in runs}
        self._trained: dict[int, dict[tuple, Path]] = {}  # the launches that succeeded: {nproc: {key: folder}}
        self._ran = {command: threading.Event() for command in commands}
        self._outcomes: dict[Command, tuple[subprocess.CompletedProcess, Path]] = {}
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()  # those running now
        self._stopping = False
        by_size = sorted(runs, key=lambda nproc: -nproc * len(runs[nproc]))
        numbered = list(enumerate(commands))
        self._jobs = [*((self._command, (i, c, folder)) for i, c in numbered if c.long),
                      *((self._launch, (nproc, runs[nproc], folder)) for nproc in by_size),
                      *((self._command, (i, c, folder)) for i, c in numbered if not c.long)]
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job, args = self._jobs.pop(0)
            try:
                job(*args)
            except Exception:  # noqa: BLE001 - its test does it again, and reports; the next one still runs
                traceback.print_exc()

    def _run(self, argv: list[str], env: dict[str, str], stdout, stderr, timeout: float) -> tuple[list, int | None]:
        """Run `argv` to its end, or until `timeout` (then None) or `stop`; (its arguments,
        its exit code)."""
        with self._lock:
            if self._stopping:
                return argv, None
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)
            self._procs.add(proc)
        try:
            return proc.args, proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
            return proc.args, None
        finally:
            with self._lock:
                self._procs.discard(proc)

    def _launch(self, nproc: int, planned: list[list[str]], folder: Path) -> None:
        try:
            todo = {launch._run_key(args, nproc, self.environ): folder / f"{nproc}-{i}"
                    for i, args in enumerate(planned)}
            for where in todo.values():
                where.mkdir()
            argv = launch.app_command(launch._runs_args(todo, folder / f"runs{nproc}.json"), nproc,
                                      launch.TRAIN_WORKER)
            with open(folder / f"launch{nproc}.log", "w") as log:  # a failed launch's output, for whoever looks
                _, code = self._run(argv, {**self.environ, "OMP_NUM_THREADS": "1"}, log, log, 300 * len(todo))
            if code == 0:
                self._trained[nproc] = todo
        finally:
            self._launched[nproc].set()

    def _command(self, i: int, command: Command, folder: Path) -> None:
        try:
            where = folder / f"command{i}"
            where.mkdir()
            with open(folder / f"command{i}.out", "w") as out, open(folder / f"command{i}.err", "w") as err:
                argv, code = self._run(command._argv(where), command._environ(where, self.environ), out, err,
                                       command.timeout)
            if code is not None:
                done = subprocess.CompletedProcess(argv, code, (folder / f"command{i}.out").read_text(),
                                                   (folder / f"command{i}.err").read_text())
                self._outcomes[command] = done, where
        finally:
            self._ran[command].set()

    def changed_environment(self) -> list[str]:
        """The variables this process's environment now holds otherwise than when the work was
        planned (those a run's key holds: `launch._run_key`)."""
        now, then = (dict(launch._run_key([], 0, environ)[2]) for environ in (None, self.environ))
        return sorted(name for name in now.keys() | then.keys() if now.get(name) != then.get(name))

    def _same_environment(self) -> bool:
        return not self.changed_environment()

    def wait(self, nproc: int) -> bool:
        """Wait for the launch of `nproc` ranks and cache its runs (see the module); whether
        there was one. A failed launch caches nothing: each test then launches its own runs."""
        if nproc not in self._launched:
            return False
        self._launched[nproc].wait()
        if nproc in self._trained and self._same_environment():
            launch._cached_runs.update(self._trained[nproc])
        return True

    def command(self, command: Command) -> tuple[subprocess.CompletedProcess, Path] | None:
        """Wait for `command` and give what it printed and its folder; None where it was not
        planned, did not finish, or ran in another environment."""
        if command not in self._ran:
            return None
        self._ran[command].wait()
        return self._outcomes.get(command) if self._same_environment() else None

    def stop(self) -> None:
        """End what is still running, if anything (an interrupted session), and the threads."""
        with self._lock:
            self._stopping = True
            running = list(self._procs)
        for proc in running:
            if proc.poll() is None:
                _end(proc)
        for thread in self._threads:
            thread.join()


def _end(proc: subprocess.Popen) -> None:
    proc.terminate()  # torchrun passes SIGTERM on to its workers; SIGKILL would leave them running
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
