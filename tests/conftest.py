"""Shared test setup: markers skip GPU tests on machines without the hardware."""

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
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    # The environment is part of a run's key, and torch sets TORCHINDUCTOR_CACHE_DIR in this
    # process the first time a test compiles; set it now, to the folder torch would, so the
    # runs launched before and after that test share their keys.
    cache_dir()
    launch.RUN_CACHE_DIR = tmp_path_factory.mktemp("launched_runs")
    yield
    launch.RUN_CACHE_DIR = None
    launch._cached_runs.clear()


@pytest.fixture(scope="session")
def launch_planned(request, tmp_path_factory, _launch_cache):
    """`launch_planned(nproc)`: train, in ONE launch, every `nproc`-rank run that the collected
    test modules list in their module-level `PLANNED_RUNS` ({nproc: [arguments, ...]}, the
    arguments as given to `launch.train_and_save_many`). A module's own `train_and_save*` calls
    then find their runs in the session cache, so modules that each need a few runs on the
    same rank count share one start-up. Call it before those calls; a run it did not plan, or
    planned under another environment, is simply launched by the call as before."""
    import launch

    launched = set()

    def run(nproc: int) -> None:
        if nproc in launched:
            return
        launched.add(nproc)
        modules = {item.module for item in request.session.items if getattr(item, "module", None)}
        planned = {tuple(args) for module in modules for args in getattr(module, "PLANNED_RUNS", {}).get(nproc, [])}
        if planned:
            folder = tmp_path_factory.mktemp(f"planned{nproc}")
            try:
                launch.train_and_save_many([(folder / str(i), list(args)) for i, args in enumerate(sorted(planned))],
                                           nproc)
            except AssertionError:
                # One failing run fails the whole launch, and nothing of it is cached: each
                # module then launches its own runs, so the test whose run fails reports it.
                pass

    return run
