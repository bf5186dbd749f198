"""The `grouped_linear` tier refuses, in one line, to run where it cannot; `te_support`
reports what is missing. Real checks on this machine, nothing mocked: CPU tests run where
there is no GPU, so the refusals are what they can see."""

import pytest
import torch

from te_mixtral.errors import TierUnavailable, UserError
from te_mixtral.experts.grouped_linear import MIN_TE_VERSION
from te_mixtral.experts.registry import make_tier
from te_mixtral.te_support import (
    TEUnavailable,
    _release,
    require_te,
    te_available,
    te_version,
)

PREFIX = "tier 'grouped_linear' needs NVIDIA Transformer Engine on a CUDA GPU: "


def test_registry_imports_tier_without_transformer_engine():
    # The module must import on a machine without TE: the registry imports it by name.
    assert make_tier("grouped_linear").name == "grouped_linear"


def test_cpu_device_is_refused_in_one_line():
    with pytest.raises(TierUnavailable) as info:
        make_tier("grouped_linear").check_available(torch.device("cpu"))
    message = str(info.value)
    assert message == PREFIX + "the device is cpu"
    assert "\n" not in message
    assert isinstance(info.value, UserError)  # the entry point prints it without traceback


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda_is_refused():
    with pytest.raises(TierUnavailable) as info:
        make_tier("grouped_linear").check_available(torch.device("cuda"))
    assert str(info.value).startswith(PREFIX + "CUDA is not available")
    assert "\n" not in str(info.value)


@pytest.mark.skipif(te_version() is not None, reason="Transformer Engine is installed here")
def test_missing_transformer_engine_is_named():
    assert not te_available()
    with pytest.raises(TEUnavailable) as info:
        require_te(MIN_TE_VERSION)
    assert "not installed" in info.value.reason
    assert "\n" not in str(info.value)


@pytest.mark.skipif(te_version() is None, reason="Transformer Engine is not installed here")
def test_too_old_transformer_engine_is_named():
    with pytest.raises(TEUnavailable) as info:
        require_te("999.0")
    assert info.value.reason == f"Transformer Engine {te_version()} is installed, 999.0 or newer is needed"


@pytest.mark.parametrize(
    "version, release",
    [("2.20.2", (2, 20, 2)), ("2.11", (2, 11, 0)), ("2.20.2.dev0+cu13", (2, 20, 2)), ("3", (3, 0, 0))],
)
def test_release_parsing(version, release):
    assert _release(version) == release


def test_minimum_version_compares_numerically():
    # 2.9 < 2.11 < 2.20 as releases, though not as strings.
    assert _release("2.9") < _release(MIN_TE_VERSION) <= _release("2.20.2")
