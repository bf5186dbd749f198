"""Errors a user can act on, and how they are reported.

Anything raised as a `UserError` is printed by the entry point as one line
(`te_mixtral: error: ...`) on every rank, followed by a non-zero exit and no traceback.
Every rank runs the same checks on the same inputs before the first collective, so every
rank fails the same way and no rank is left waiting in a collective.

The exit code says what kind of failure it was, so that a script can tell a run to fix
from one to retry (docs/checkpoints.md lists them). torchrun and `accelerate launch` exit 1
for any failure; `python -m te_mixtral.torchrun` passes the code on (te_mixtral/torchrun.py).
"""

import os
import sys
import time
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    LOSS_CHECK_FAILED = 1  # the run finished, its losses are off the reference's
    BAD_INPUT = 2  # refused: a config value, a path, a tier this machine cannot run
    LOST_A_PEER = 3  # a collective failed: another rank died or hung
    DIVERGED = 4  # a non-finite loss, gradient or weight: stopped, results.json kept
    WRITE_FAILED = 5  # a checkpoint, export or results.json could not be written (a full disk)
    INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells report 128 + the signal number

# torchrun stops every rank as soon as one exits non-zero. The others check the same input
# and fail the same way moments later; this long lets each of them say so itself.
PEER_GRACE_S = 3.0


def error_line(message: str, exit_code: int) -> str:
    """The one line a failure prints. Under a launcher (torchrun, `accelerate launch`), which
    exits 1 whatever failed, it names the rank's own exit code too; `python -m
    te_mixtral.torchrun` launches as torchrun does and exits with that code."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ  # set by torchrun's agent in every rank it starts
    return f"te_mixtral: error: {message}" + (f" [exit code {int(exit_code)}]" if launched else "")


def print_error(message: str, exit_code: int) -> None:
    """`error_line` on stderr in a single write: ranks share the launcher's stderr, and a
    print's text and newline, written apart (unbuffered), can interleave with another rank's."""
    sys.stderr.write(error_line(message, exit_code) + "\n")
    sys.stderr.flush()


def report_error(error: Exception, world_size: int) -> int:
    """Print `error` as the one-line message and return its exit code; `world_size` is
    how many ranks torchrun started (`distributed.launcher_env.world_size_from_env`)."""
    exit_code = int(getattr(error, "exit_code", ExitCode.BAD_INPUT))
    print_error(str(error), exit_code)
    if world_size > 1:
        time.sleep(PEER_GRACE_S)
    return exit_code


def first_line(error: Exception) -> str:
    """The first line of an exception's message (or its type's name): enough to say why a
    library call failed inside a one-line `UserError`."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class UserError(Exception):
    """Bad input: a config value, a path, a tier this machine cannot run."""

    exit_code = ExitCode.BAD_INPUT


def require(condition: bool, message: str) -> None:
    """A check of the user's input in one line: `UserError(message)` unless `condition`."""
    if not condition:
        raise UserError(message)


class Diverged(UserError):
    """The loss, the gradient norm or the weights stopped being finite."""

    exit_code = ExitCode.DIVERGED


class WriteFailed(UserError):
    """An output could not be written: the disk is full, or the folder went away."""

    exit_code = ExitCode.WRITE_FAILED


class Interrupted(UserError):
    """The user pressed Ctrl-C (SIGINT)."""

    exit_code = ExitCode.INTERRUPTED


class TierUnavailable(UserError):
    """The requested expert tier cannot run on this machine (no CUDA, no TE, no MXFP8...)."""
