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


@pytest.fixture(autouse=True)
def _tokenizer_cache(tmp_path_factory, monkeypatch):
    # One tokenizer cache per test session: trained once, never in the user's home.
    monkeypatch.setenv("TE_MIXTRAL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
