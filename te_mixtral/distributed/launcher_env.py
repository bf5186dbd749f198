"""What the launcher (torchrun, or accelerate launch through it) tells each process in its
environment, read without torch: the command line is checked before torch is imported, so
that a bad flag is refused in a fraction of a second, not after the seconds torch takes."""

import os


def world_size_from_env() -> int:
    """How many processes torchrun started (1 when run without it): the one place that
    reads it, usable before torch.distributed is initialised."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def main_rank_from_env() -> bool:
    """Whether this process is rank 0 (or alone), before torch.distributed is initialised:
    where a message printed on every rank would be printed once per rank."""
    return os.environ.get("RANK", "0") == "0"
