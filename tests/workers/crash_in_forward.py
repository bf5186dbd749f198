"""Not a torchrun worker of its own: run_finetune_ep.py, with rank 1 crashing in its first MoE
layer's forward as a CUDA out-of-memory error does (torch.OutOfMemoryError, which no line of
ours describes), after it printed the time it crashed at (`crashed at SECONDS`).

Usage: torchrun ... tests/workers/crash_in_forward.py [run_finetune_ep.py arguments]
"""

import os
import sys
import time

import torch

from te_mixtral.cli import main
from te_mixtral.model import moe

_forward = moe.MoEBlock.forward


def crashing_forward(self, x_BSD):
    if os.environ.get("RANK") == "1":
        print(f"crashed at {time.time()}", file=sys.stderr, flush=True)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.45 GiB (the test's)")
    return _forward(self, x_BSD)


moe.MoEBlock.forward = crashing_forward
sys.exit(main(sys.argv[1:]))
