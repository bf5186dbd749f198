"""Errors a user can act on, and how they are reported.

Anything raised as a `UserError` is printed by the entry point as one line
(`te_mixtral: error: ...`) on every rank, followed by a non-zero exit and no traceback.
Every rank runs the same checks on the same inputs before the first collective, so every
rank fails the same way and no rank is left waiting in a collective.
"""

import sys
import time

# torchrun stops every rank as soon as one exits non-zero. The others check the same input
# and fail the same way moments later; this long lets each of them say so itself.
PEER_GRACE_S = 3.0


def report_error(error: Exception, world_size: int) -> int:
    """Print `error` as the one-line message and return the exit code (2); `world_size` is
    how many ranks torchrun started (`distributed.layout.world_size_from_env`)."""
    print(f"te_mixtral: error: {error}", file=sys.stderr, flush=True)
    if world_size > 1:
        time.sleep(PEER_GRACE_S)
    return 2


def first_line(error: Exception) -> str:
    """The first line of an exception's message (or its type's name): enough to say why a
    library call failed inside a one-line `UserError`."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class UserError(Exception):
    """Bad input: a config value, a path, a tier this machine cannot run."""


class TierUnavailable(UserError):
    """The requested expert tier cannot run on this machine (no CUDA, no TE, no MXFP8...)."""
