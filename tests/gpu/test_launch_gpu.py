"""Launching on a GPU machine: every process torchrun starts needs a GPU of its own among those
its machine shows it (te_mixtral/distributed/layout.py `require_a_gpu_of_its_own`); a rank that
crashes ends the job at once (te_mixtral/errors.py `end_at_once`)."""

import os
import re
import subprocess
import sys
import time

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


@pytest.mark.multigpu
def test_a_rank_that_crashes_ends_the_job_within_seconds_not_at_the_collectives_timeout():
    # Before, a rank out of GPU memory printed its traceback, then hung in NCCL's teardown while
    # its peer waited in an all-to-all for it: the job ended dist_timeout_s later (seen on two
    # H200s: five minutes, then SIGABRT). Now the crashed rank ends at once and torchrun stops its peer.
    timeout_s = 90
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "tests/workers/crash_in_forward.py", "--ep-size", "2", "--device", "cuda", "--steps", "2",
                           "--dist-timeout-s", str(timeout_s), "--plots", "false"], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout_s + 240)
    ended = time.time()
    crashed = float(re.search(r"crashed at ([\d.]+)", proc.stderr).group(1))
    assert proc.returncode != 0
    assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 12.45 GiB (the test's)" in proc.stderr
    assert ended - crashed < timeout_s / 3, (f"the job ended {ended - crashed:.0f} s after rank 1 crashed "
                                             f"({ended - started:.0f} s in all)", proc.stderr[-3000:])
