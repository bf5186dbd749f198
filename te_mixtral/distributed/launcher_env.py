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


def local_rank_from_env() -> int:
    """This process's number among those torchrun started on its machine (0 when run without
    it): the GPU it takes, of those the machine shows it (CUDA_VISIBLE_DEVICES)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size_from_env() -> int:
    """How many processes torchrun started on this machine (1 when run without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def restart_from_env() -> tuple[int, int]:
    """Which attempt of its job this process is, and how many restarts torchrun allows
    (`--max-restarts`): (0, 0) outside torchrun and in a job torchrun never restarts."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


def launch_id_from_env() -> str | None:
    """The id torchrun gives every process of one launch, in every attempt (`--rdzv-id`, or a
    fresh one of `--standalone`); None outside torchrun, and where it is torchrun's default
    "none", which names no launch."""
    launch = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if launch in (None, "", "none") else launch
