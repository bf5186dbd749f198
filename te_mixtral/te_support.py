"""Finding NVIDIA Transformer Engine, and saying plainly why it cannot be used.

Transformer Engine (TE) is optional: the plain-PyTorch paths run without it, and a machine
without a GPU cannot even import it usefully. Everything that needs TE (the `grouped_linear`
expert tier, the model's TE layer backend) asks here first, so every such check gives the
same kind of one-line reason: not installed, failed to import, or too old.

Pitfalls this module exists for:
- Importing `transformer_engine.pytorch` can fail in more ways than `ImportError`: a wheel
  built for another CUDA or torch raises `OSError` or `RuntimeError` from the C++
  extension's loader. Any exception counts as "TE cannot be used", with its first line kept
  as the reason.
- The import is tried once per process (cached): a failed import leaves half-initialised
  modules behind, and trying again only produces a more confusing error.
- The version is read from the installed package's metadata, the same place TE reads its
  own `__version__`, so it is known even when the import itself fails.
"""

import functools
import importlib
import importlib.metadata
import re
from types import ModuleType

from te_mixtral.errors import UserError


class TEUnavailable(UserError):
    """Transformer Engine cannot be used here; `reason` says why, in a few words."""

    def __init__(self, reason: str):
        super().__init__(f"NVIDIA Transformer Engine cannot be used: {reason}")
        self.reason = reason


def te_version() -> str | None:
    """The installed Transformer Engine version (e.g. "2.20.2"), or None if not installed."""
    try:
        return importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; "2.20.2.dev0+cu13" -> (2, 20, 2)."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(part or 0) for part in match.groups())


@functools.cache
def _import_te() -> ModuleType | str:
    """`transformer_engine.pytorch`, or a one-line reason why it did not import."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # noqa: BLE001 - see the module docstring: any failure counts
        message = str(error).strip().splitlines()
        first_line = message[0] if message else ""
        return f"import transformer_engine.pytorch failed ({type(error).__name__}: {first_line})"


def require_te(min_version: str | None = None) -> ModuleType:
    """Return `transformer_engine.pytorch`, or raise `TEUnavailable` saying what is missing.

    `min_version` (e.g. "2.11") is the oldest release the caller was written against;
    releases before it are refused with the installed and needed versions in the message.
    """
    installed = te_version()
    if installed is None:
        raise TEUnavailable(
            "the transformer_engine package is not installed "
            "(pip install --no-build-isolation 'transformer_engine[pytorch]')"
        )
    if min_version is not None and _release(installed) < _release(min_version):
        raise TEUnavailable(
            f"Transformer Engine {installed} is installed, {min_version} or newer is needed"
        )
    module = _import_te()
    if isinstance(module, str):
        raise TEUnavailable(module)
    return module


def te_available(min_version: str | None = None) -> bool:
    """Whether `require_te(min_version)` would succeed."""
    try:
        require_te(min_version)
    except TEUnavailable:
        return False
    return True
