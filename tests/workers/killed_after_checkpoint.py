"""torchrun worker: `run_finetune_ep.py` whose rank 1 is killed (SIGKILL, as the out-of-memory
killer kills: no cleanup, no message) right after its step-N checkpoint, in torchrun's first
attempt only; the attempts torchrun restarts (`--max-restarts`) run unharmed.

Usage: torchrun --nproc_per_node=2 --max-restarts 1 tests/workers/killed_after_checkpoint.py N ARGS...
"""

import os
import signal
import sys

from te_mixtral.cli import main
from te_mixtral.training.checkpoint import Checkpointer

step, *args = sys.argv[1:]
save = Checkpointer.save


def save_then_die(self, state, *rest):
    path = save(self, state, *rest)
    if state.step == int(step) and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return path


Checkpointer.save = save_then_die
sys.exit(main(args))
