"""Shared test setup: markers skip GPU tests on machines without the hardware; the default run
leaves out the tests marked slow (`--runslow` keeps them); the runs and commands that test
modules plan (`launch_planned`, `planned_command`) are done once, and on a machine without a
GPU in the background from the session's start (background.py)."""

import os
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


def some_slow(values, slow) -> list:
    """`values` to parametrize a test with, those in `slow` marked slow: the default run keeps
    the others (a test's representatives; its variants run with --runslow)."""
    return [pytest.param(value, marks=pytest.mark.slow) if value in slow else value for value in values]


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true",
                     help="also run the tests marked slow, which the default run leaves out (tests/README.md)")


def keeps_slow(config) -> bool:
    """Whether this session runs the tests marked slow: with --runslow, or where the command
    line picks tests by marker itself (`-m cuda`: the expression decides)."""
    return config.getoption("--runslow") or bool(config.getoption("markexpr"))


def _named(config) -> list[str]:
    """The node ids of the tests the command line names one by one (`path::test`)."""
    here, root = config.invocation_params.dir, config.rootpath
    return [Path(os.path.relpath(here / path, root)).as_posix() + "::" + name
            for path, _, name in (arg.partition("::") for arg in config.args) if name]


def _deselect_slow(config, items) -> None:
    """Leave the tests marked slow out of a default run, but for those named one by one."""
    if keeps_slow(config):
        return
    named = _named(config)
    slow = [item for item in items if item.get_closest_marker("slow") and not any(
        item.nodeid == n or item.nodeid.startswith((n + "[", n + "::")) for n in named)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        left_out = set(slow)
        items[:] = [item for item in items if item not in left_out]


def pytest_collection_modifyitems(config, items):
    _deselect_slow(config, items)
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
        # background does the commands last (all but the long ones, the interpreter run and the
        # README's commands, which take longer than any launch), and meanwhile these tests' own
        # launches run beside them.
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


def _kept(entries, config) -> list:
    """Of a module's planned work (a list of its `PLANNED_RUNS`, its `PLANNED_COMMANDS`), what
    this session plans: an entry written `pytest.param(work, marks=pytest.mark.slow)` is work
    that only tests marked slow use, planned where those run (`keeps_slow`)."""
    kept = []
    for entry in entries:
        marks = getattr(entry, "marks", None)  # a pytest.param's
        if marks is None:
            kept.append(entry)
        elif keeps_slow(config) or not any(mark.name == "slow" for mark in marks):
            kept.append(entry.values[0])
    return kept


def _planned_runs(session) -> dict[int, list[list[str]]]:
    """{nproc: [arguments, ...]}: the runs that modules whose tests use `launch_planned` list in
    `PLANNED_RUNS`."""
    planned = {}
    for module in _planning(session.items, "launch_planned"):
        for nproc, runs in getattr(module, "PLANNED_RUNS", {}).items():
            planned.setdefault(nproc, set()).update(tuple(args) for args in _kept(runs, session.config))
    return {nproc: [list(args) for args in sorted(runs)] for nproc, runs in planned.items() if runs}


def _planned_commands(session) -> list:
    """The `background.Command`s that modules whose tests use `planned_command` list in
    `PLANNED_COMMANDS`, their `background.InterpreterTests` one command for all, first."""
    from background import InterpreterTests

    planned = list(dict.fromkeys(command for module in _planning(session.items, "planned_command")
                                 for command in _kept(getattr(module, "PLANNED_COMMANDS", []), session.config)))
    interpreted = _interpreter_tests(session)
    return ([_interpreter_command(session, interpreted)] if interpreted else []) + \
        [command for command in planned if not isinstance(command, InterpreterTests)]


def _interpreter_tests(session) -> list:
    """The `background.InterpreterTests` of `_planned_commands`, before they are made one."""
    from background import InterpreterTests

    return [command for module in _planning(session.items, "planned_command")
            for command in getattr(module, "PLANNED_COMMANDS", []) if isinstance(command, InterpreterTests)]


def _interpreter_command(session, planned: list):
    """`background.interpreter_command`, its pytest keeping the tests marked slow where this
    session does."""
    from background import interpreter_command

    return interpreter_command(planned, keeps_slow(session.config))


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

    runs, commands = _planned_runs(request.session), _planned_commands(request.session)
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


@pytest.fixture(autouse=True)
def _environment_kept(_planned_in_background):
    # Planned work is used where the environment is still the one it was done in; a test that
    # leaves it changed would have every later test do its work again, in the foreground.
    changed = _planned_in_background and _planned_in_background.changed_environment()
    yield
    if _planned_in_background and (now := _planned_in_background.changed_environment()) != changed:
        pytest.fail(f"the test left this process's environment changed ({', '.join(sorted(set(now) ^ set(changed)))}):"
                    " later tests would do their planned work again", pytrace=False)


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
        planned = [args for args in _planned_runs(request.session).get(nproc, [])
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
    from background import InterpreterTests

    ran = {}

    def run(command):
        if isinstance(command, InterpreterTests):
            command = _interpreter_command(request.session, _interpreter_tests(request.session) or [command])
        if _planned_in_background is not None and (done := _planned_in_background.command(command)):
            return done
        if command not in ran:
            folder = tmp_path_factory.mktemp("command")
            ran[command] = command.run(folder), folder
        return ran[command]

    return run
