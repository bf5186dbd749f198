"""Errors a user can act on, and how they are reported.

Anything raised as a `UserError` is printed by the entry point as one line
(`te_mixtral: error: ...`), followed by a non-zero exit and no traceback. Every rank runs
the same checks on the same inputs before the first collective, so every rank fails the
same way and no rank is left waiting in a collective.

One line per job, not one per rank: what every rank raises alike, rank 0 says (`report_line`).
The other ranks wait `PEER_GRACE_S` before they say it, so that they say it only where rank
0 did not fail the same way: torchrun stops every rank as soon as one exits non-zero. A
problem of one rank's own (`only_here`: a file that rank could not write or verify) is said
at once by that rank; the line that points at it from the other ranks (`see_elsewhere`:
"... on another rank (see its error)") is said by rank 0 alone, which waits for the other's
line before it exits.

A crash (an error no line of ours describes: out of memory, a bug) is a traceback, and in a
job of several processes the crashed rank then ends at once (`end_at_once`).

The exit code says what kind of failure it was, so that a script can tell a run to fix
from one to retry (docs/checkpoints.md lists them). torchrun and `accelerate launch` exit 1
for any failure; `python -m te_mixtral.torchrun` passes the code on (te_mixtral/torchrun.py).
"""

import difflib
import os
import sys
import time
import traceback
from enum import IntEnum
from typing import NoReturn


class ExitCode(IntEnum):
    OK = 0
    LOSS_CHECK_FAILED = 1  # the run finished, its losses are off the reference's
    BAD_INPUT = 2  # refused: a config value, a path, a tier this machine cannot run
    LOST_A_PEER = 3  # a collective failed: another rank died or hung
    DIVERGED = 4  # a non-finite loss, gradient or weight: stopped, results.json kept
    WRITE_FAILED = 5  # a checkpoint, export or results.json could not be written (a full disk)
    INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells report 128 + the signal number

# torchrun stops every rank as soon as one exits non-zero (it looks every 0.1 s): a rank
# that waits this long after rank 0 failed alike is stopped before it repeats rank 0's line.
# Counted from this rank's own failure, and ranks do not reach a check at the same moment:
# on a loaded 2-core machine rank 0 reached one more than 3 s after the others.
PEER_GRACE_S = 10.0
# How long rank 0 waits for a line another rank prints at once (`see_elsewhere`).
OWN_LINE_S = 3.0

# Which ranks raise an error (`UserError.scope`), and so which ranks say it (`report_line`).
ALIKE, ONLY_HERE, SEE_ELSEWHERE = "alike", "only here", "see elsewhere"


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


def report_line(message: str, exit_code: int, world_size: int, main_rank: bool, scope: str = ALIKE) -> int:
    """Print `message` as the job's one line where it is this rank's to print (module
    docstring) and return `exit_code`; `world_size` is how many ranks the launcher started
    and `main_rank` whether this is rank 0 (`distributed.launcher_env`)."""
    if world_size == 1 or scope == ONLY_HERE:
        print_error(message, exit_code)
    elif main_rank:
        print_error(message, exit_code)
        if scope == SEE_ELSEWHERE:  # the rank the line points at prints its own: let it
            time.sleep(OWN_LINE_S)
    elif scope == ALIKE:
        time.sleep(PEER_GRACE_S)  # stopped here by the launcher where rank 0 failed alike
        print_error(message, exit_code)
    return exit_code


def report_error(error: Exception, world_size: int, main_rank: bool) -> int:
    """`report_line` an error: its message, its exit code (`BAD_INPUT` for an exception that
    names none) and its scope."""
    return report_line(str(error), int(getattr(error, "exit_code", ExitCode.BAD_INPUT)), world_size, main_rank,
                       getattr(error, "scope", ALIKE))


def only_here(error: "UserError") -> "UserError":
    """Mark `error` as this rank's own problem, which the other ranks did not meet."""
    error.scope = ONLY_HERE
    return error


def see_elsewhere(error: "UserError") -> "UserError":
    """Mark `error` as the line that points at another rank's problem."""
    error.scope = SEE_ELSEWHERE
    return error


def closest(word: str, choices, cutoff: float = 0.6) -> str | None:
    """The choice a mistyped `word` most likely meant (`custom_groupd`, `grouped-linear`,
    `fp8_hopper`), for a refusal to name; None where none is close."""
    close = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(word: str, choices, cutoff: float = 0.6) -> str:
    """' (did you mean X?)' for the choice `closest` to a mistyped `word`, to follow it in a
    refusal; '' where none is close."""
    close = closest(word, choices, cutoff)
    return f" (did you mean {close}?)" if close else ""


def end_at_once(error: BaseException) -> NoReturn:
    """Print a crashed rank's traceback and end its process at once, with Python's own exit
    code for an uncaught error (1), without tearing its process groups down: NCCL's teardown
    waits on its communicators, whose peers wait in a collective for this rank until
    dist_timeout_s (five minutes by default), so the job would hang that long before torchrun
    stopped it. Once this process has ended, torchrun stops the other ranks within seconds."""
    traceback.print_exception(error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def first_line(error: Exception) -> str:
    """The first line of an exception's message (or its type's name): enough to say why a
    library call failed inside a one-line `UserError`."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class UserError(Exception):
    """Bad input: a config value, a path, a tier this machine cannot run."""

    exit_code = ExitCode.BAD_INPUT
    scope = ALIKE  # raised on every rank alike, unless marked `only_here` or `see_elsewhere`


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
    # Every rank gets the signal and says at once where it stopped: waiting `PEER_GRACE_S` for
    # the launcher to stop it would only hold the job that long after rank 0 has left.
    scope = ONLY_HERE


class TierUnavailable(UserError):
    """The requested expert tier cannot run on this machine (no CUDA, no TE, no MXFP8...)."""
