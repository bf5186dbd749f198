"""Errors a user can act on.

Anything raised as a `UserError` is printed by the entry point as one line
(`te_mixtral: error: ...`) on every rank, followed by a non-zero exit and no traceback.
Every rank runs the same checks on the same inputs before the first collective, so every
rank fails the same way and no rank is left waiting in a collective.
"""


class UserError(Exception):
    """Bad input: a config value, a path, a tier this machine cannot run."""


class TierUnavailable(UserError):
    """The requested expert tier cannot run on this machine (no CUDA, no TE, no MXFP8...)."""
