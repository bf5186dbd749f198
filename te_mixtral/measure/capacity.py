"""What one rank may use: a named GPU's memory, a size given as text, this CUDA device's, or
on the CPU the RAM this machine's ranks share. The other side of planning/memory.py's
estimate, which `check_fits` holds against it."""

import os
import re
from pathlib import Path

from te_mixtral.config import RunConfig
from te_mixtral.distributed.launcher_env import local_rank_from_env, local_world_size_from_env
from te_mixtral.errors import UserError, did_you_mean

GiB = 2**30

# Usable capacity of each GPU as CUDA reports it (`torch.cuda.get_device_properties(i)
# .total_memory`, what PyTorch's out-of-memory message calls "total capacity"), below the
# marketing figures (80 GB, 141 GB, 180 GB) and below nvidia-smi's total:
#   H100 80GB HBM3  85,017,493,504 bytes (79.18 GiB), read on one;
#   H200            139.8 GiB: nvidia-smi's 143,771 MiB less the ~480 MiB that the H100 shows
#                   between nvidia-smi (81,559 MiB) and CUDA (81,079 MiB), rounded down;
#   B200            178.35 GiB, CUDA's totalGlobalMem as quoted in pytorch/ao#4002.
# The GPUs most people rent, not read on one here (confirm on the hardware before trusting a
# near miss):
#   A100 80GB       79.15 GiB, the "total capacity" PyTorch's out-of-memory message reports on one;
#   L40S (48 GB)    44.52 GiB: nvidia-smi's 46,068 MiB less the H100's ~480 MiB, as for the H200;
#   RTX 4090 24GB   23.65 GiB, PyTorch's out-of-memory message's "total capacity" (24 GB cards: the
#                   A10 and L4 hold a little less; name their size, e.g. --gpu 22GiB).
GPUS = {
    "h100": 85_017_493_504,
    "h200": int(139.8 * GiB),
    "b200": int(178.35 * GiB),
    "a100-80gb": int(79.15 * GiB),
    "l40s": int(44.52 * GiB),
    "rtx4090": int(23.65 * GiB),
}


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gib|gb|mib|mb|tib|tb)\s*$", re.IGNORECASE)
_UNITS = {"gib": GiB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40, "tb": 10**12}
# The most memory one rank can use: what 64-bit addresses reach (16 EiB), the GPU's and the CPU's.
MAX_CAPACITY = 2**64


def parse_capacity(text: str) -> int:
    """Bytes of a GPU name (`h100`, `H200`, `b200`) or a size (`80GiB`, `141GB`, `24 GB`)."""
    name = text.strip().lower()
    if name in GPUS:
        return GPUS[name]
    match = _SIZE.match(name)
    size = float(match.group(1)) * _UNITS[match.group(2).lower()] if match else 0.0
    if size > MAX_CAPACITY:  # infinite too: digits past a float's range
        raise UserError(f"--gpu {text.strip()} is more memory than one device can address (64-bit addresses: at most "
                        f"16 EiB)")
    if int(size) <= 0:  # no size, or no memory at all
        raise UserError(f"--gpu must name a GPU ({', '.join(GPUS)}) or a size such as 80GiB or 141GB, got '{text}'"
                        f"{did_you_mean(name, GPUS)}")
    return int(size)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo: what the kernel can give without swapping."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def capacity(cfg: RunConfig, device: str) -> tuple[int | None, str]:
    """What one rank may use, and its name: `cfg.gpu` if set, else this device's memory (the
    CUDA device's total, or on the CPU the available RAM shared by this machine's ranks);
    None when planning for a GPU this machine does not have."""
    if cfg.gpu is not None:
        return parse_capacity(cfg.gpu), cfg.gpu
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None, ""
        props = torch.cuda.get_device_properties(local_rank_from_env())
        return props.total_memory, props.name
    local_ranks = local_world_size_from_env()
    shared = f" shared by {local_ranks} ranks" if local_ranks > 1 else ""
    return available_ram() // local_ranks, f"this machine's available RAM{shared}"
