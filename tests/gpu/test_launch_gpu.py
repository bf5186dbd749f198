"""Launching on a GPU machine: every process torchrun starts needs a GPU of its own among those
its machine shows it (te_mixtral/distributed/layout.py `require_a_gpu_of_its_own`)."""

import os
import subprocess
import sys

import pytest
from conftest import REPO
from launch import assert_one_line_error

from te_mixtral.errors import ExitCode

pytestmark = pytest.mark.cuda


def test_more_processes_than_visible_gpus_is_one_line_from_the_process_without_one():
    # Two processes, one GPU shown: rank 1 would take GPU 1, which is not there (before: a
    # traceback from torch.cuda.get_device_properties, run by the memory estimate).
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    proc = subprocess.run([sys.executable, "-m", "te_mixtral.torchrun", "--standalone", "--nproc_per_node=2",
                           "run_finetune_ep.py", "--ep-size", "2", "--device", "cuda", "--steps", "1"], cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": first, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-3000:]
    lines = assert_one_line_error(proc, f"rank 1 is process 1 of 2 on its machine, which shows it 1 GPU "
                                        f"(CUDA_VISIBLE_DEVICES='{first}'): each process needs a GPU of its own")
    assert len(lines) == 1, proc.stderr[-3000:]  # rank 1's own; rank 0, waiting for it, is stopped by torchrun
