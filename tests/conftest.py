"""Shared test setup: markers skip GPU tests on machines without the hardware."""

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


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

    launch.RUN_CACHE_DIR = tmp_path_factory.mktemp("launched_runs")
    yield
    launch.RUN_CACHE_DIR = None
    launch._cached_runs.clear()
