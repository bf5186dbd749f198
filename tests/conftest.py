"""Shared test setup: markers skip GPU tests on machines without the hardware; the runs and
commands that test modules plan (`launch_planned`, `planned_command`) are done once, and on a
machine without a GPU in the background from the session's start (background.py)."""

from pathlib import Path

import pytest
import torch

from te_mixtral.measure.report import package_version
from te_mixtral.te_support import _release

REPO = Path(__file__).resolve().parents[1]


# Triton before 3.7 turns a reduction's result into a Python int through a one-element NumPy
# array, which NumPy 2.4 refuses (triton-lang/triton#9171): its interpreter then stops at
# every loop whose bound is a reduction, as our grouped GEMMs' and casts' are. Where that is
# the case (the GPU image: Triton 3.6), the GPU tests run the compiled kernels instead.
_TRITON, _NUMPY = package_version("triton"), package_version("numpy")
interpreter_runs_reduced_loop_bounds = pytest.mark.skipif(
    _TRITON is not None and _release(_TRITON) < (3, 7) and _release(_NUMPY) >= (2, 4),
    reason="Triton < 3.7's interpreter cannot run these kernels under NumPy >= 2.4 (triton-lang/triton#9171)")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count()
    blackwell = gpus > 0 and torch.cuda.get_device_capability(0)[0] >= 10
    for item in items:
        if "cuda" in item.keywords and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
        if "blackwell" in item.keywords and not blackwell:
            item.add_marker(pytest.mark.skip(reason="needs an sm_100+ GPU"))
    if _in_background():
        # The modules that read planned work go last (each in its own order), so that the rest
        # of the suite runs while that work is done (`_planned_in_background`); of those, the
        # ones that wait for planned commands after the ones that wait for launches only: the
        # background does the commands last (all but the interpreter run, which is longer than
        # any launch), and meanwhile these tests' own launches run beside them.
        launches, commands = set(_planning(items, "launch_planned")), set(_planning(items, "planned_command"))
        items.sort(key=lambda item: (getattr(item, "module", None) in launches | commands,
                                     getattr(item, "module", None) in commands))


def _in_background() -> bool:
    # On a GPU machine the planned runs would train on the GPUs, which GPU tests measure:
    # there each piece of planned work is done when a test needs it.
    return torch.cuda.device_count() == 0


def _planning(items, fixture: str) -> list:
    """The modules of `items` that have a test to run which uses `fixture`, in their order."""
    def skipped(item) -> bool:
        return any(mark.name == "skip" or (mark.name == "skipif" and mark.args and mark.args[0] is True)
                   for mark in item.iter_markers())

    modules = [item.module for item in items if fixture in getattr(item, "fixturenames", ()) and not skipped(item)]
    return list(dict.fromkeys(modules))


def _planned_runs(items) -> dict[int, list[list[str]]]:
    """{nproc: [arguments, ...]}: the runs that modules whose tests use `launch_planned` list in
    `PLANNED_RUNS`."""
    planned = {}
    for module in _planning(items, "launch_planned"):
        for nproc, runs in getattr(module, "PLANNED_RUNS", {}).items():
            planned.setdefault(nproc, set()).update(tuple(args) for args in runs)
    return {nproc: [list(args) for args in sorted(runs)] for nproc, runs in planned.items()}


def _planned_commands(items) -> list:
    """The `background.Command`s that modules whose tests use `planned_command` list in
    `PLANNED_COMMANDS`, their `background.InterpreterTests` one command for all, first: the
    session's longest piece of work."""
    from background import InterpreterTests, interpreter_command

    planned = list(dict.fromkeys(command for module in _planning(items, "planned_command")
                                 for command in getattr(module, "PLANNED_COMMANDS", [])))
    interpreted = _interpreter_tests(items)
    return ([interpreter_command(interpreted)] if interpreted else []) + \
        [command for command in planned if not isinstance(command, InterpreterTests)]


def _interpreter_tests(items) -> list:
    """The `background.InterpreterTests` of `_planned_commands`, before they are made one."""
    from background import InterpreterTests

    return [command for module in _planning(items, "planned_command")
            for command in getattr(module, "PLANNED_COMMANDS", []) if isinstance(command, InterpreterTests)]


@pytest.fixture(scope="session", autouse=True)
def _tokenizer_cache(tmp_path_factory):
    # One tokenizer cache per test session: trained once, never in the user's home. Session
    # scope, so that module fixtures which launch runs see it too.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TE_MIXTRAL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        yield


@pytest.fixture(scope="session", autouse=True)
def _launch_cache(tmp_path_factory, _tokenizer_cache):
    # Runs that several tests launch alike (same arguments, ranks and environment) run once.
    import launch  # here, not at the top: launch imports this module

    launch.RUN_CACHE_DIR = tmp_path_factory.mktemp("launched_runs")
    yield
    launch.RUN_CACHE_DIR = None
    launch._cached_runs.clear()


@pytest.fixture(scope="session", autouse=True)
def _planned_in_background(request, tmp_path_factory, _launch_cache):
    # The planned launches and commands start with the session, in the background (background.py).
    from background import PlannedInBackground

    runs, commands = _planned_runs(request.session.items), _planned_commands(request.session.items)
    if not (runs or commands) or not _in_background():
        yield None
        return
    with pytest.MonkeyPatch.context() as patch:
        # With work in the background, one OpenMP thread in this process and in those it starts
        # (as the app's own launches have): OpenMP's threads spin while they wait for each
        # other, and while the background keeps the cores busy, each wait lasts a time slice.
        patch.setenv("OMP_NUM_THREADS", "1")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        planned = PlannedInBackground(runs, commands, tmp_path_factory.mktemp("planned"))
        yield planned
        planned.stop()
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def launch_planned(request, tmp_path_factory, _planned_in_background):
    """`launch_planned(nproc)`: train, in ONE launch, every `nproc`-rank run that the collected
    test modules list in their module-level `PLANNED_RUNS` ({nproc: [arguments, ...]}, the
    arguments as given to `launch.train_and_save_many`, or [launch.WORKER, script, *arguments]
    for `launch.run_worker`). A module's own `train_and_save*` and `run_worker` calls then
    find their runs in the session cache, so modules that each need a few runs on the
    same rank count share one start-up. Call it before those calls; a run it did not plan, or
    planned under another environment, is simply launched by the call as before. Without a
    GPU the launches started with the session (`_planned_in_background`): this waits for them."""
    import launch

    launched = set()

    def run(nproc: int) -> None:
        if nproc in launched:
            return
        launched.add(nproc)
        if _planned_in_background is not None and _planned_in_background.wait(nproc):
            return
        # Here the runs may train on GPUs, over NCCL, which the worker scripts' gloo groups
        # cannot share a process group with: those run alone (`launch.run_worker`).
        planned = [args for args in _planned_runs(request.session.items).get(nproc, [])
                   if args[:1] != [launch.WORKER]]
        if planned:
            folder = tmp_path_factory.mktemp(f"planned{nproc}")
            try:
                launch.launch_many([(folder / str(i), args) for i, args in enumerate(planned)], nproc)
            except AssertionError:
                # One failing run fails the whole launch, and nothing of it is cached: each
                # module then launches its own runs, so the test whose run fails reports it.
                pass

    return run


@pytest.fixture(scope="session")
def planned_command(request, tmp_path_factory, _planned_in_background):
    """`planned_command(command)`: (CompletedProcess, folder) of a `background.Command` that the
    test's module lists in `PLANNED_COMMANDS`: run in the background from the session's start
    where that happens (`_planned_in_background`), else now. For a `background.InterpreterTests`,
    those of the session's one run of every module's (`background.assert_passed` picks out the
    module's own)."""
    from background import InterpreterTests, interpreter_command

    ran = {}

    def run(command):
        if isinstance(command, InterpreterTests):
            command = interpreter_command(_interpreter_tests(request.session.items) or [command])
        if _planned_in_background is not None and (done := _planned_in_background.command(command)):
            return done
        if command not in ran:
            folder = tmp_path_factory.mktemp("command")
            ran[command] = command.run(folder), folder
        return ran[command]

    return run
