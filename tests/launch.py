"""Start the app the way users do: `python run_finetune_ep.py` or `torchrun`."""

import os
import subprocess
import sys

from conftest import REPO


def run_app(args: list[str], nproc: int = 1, timeout: float = 300, script: str = "run_finetune_ep.py"):
    """Run the entry point (or a test worker script) and return the CompletedProcess."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(launcher + [str(REPO / script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
