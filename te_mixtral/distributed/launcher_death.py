"""A rank ends with its launcher: torchrun (and `accelerate launch`, which runs torchrun's
launcher inside) starts each process in a session of its own (`start_new_session`), so a
signal to the launcher's process group, or to the launcher alone, never reaches the ranks.
Killed by SIGKILL (a `kill -9 -- -PGID`, a batch system ending a job, the OOM killer), the
launcher cannot stop them, and they train on with nobody to report to, holding their folders'
locks (te_mixtral/folder_lock.py): the next run there is refused as "in use by another run".

So each rank asks Linux for a parent-death signal as it starts (`prctl(PR_SET_PDEATHSIG)`):
when the process that started it ends, it is sent SIGKILL. SIGKILL, not SIGTERM: nothing is
left to report to, a handler some library installed must not keep the rank alive, and a run
is built to be killed at any write (tests/training/test_killed_runs.py). torch offers no such
setting (its SubprocessHandler only starts the new session).

Pitfall: the signal comes only for a parent alive when it is set. A launcher that died
between starting the rank and the `prctl` left it to another parent already (init, or a
subreaper), so the rank compares its parent before and after, and ends itself where it
changed. A launcher that died before the rank's first line of Python (the parent read
first) is not seen; that window is the interpreter's start-up. And Linux sends it when the
thread that started the process ends, not the whole process: torch's agent starts its ranks
from its main thread.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_launcher() -> None:
    """Under torchrun on Linux, have this process killed when the launcher that started it
    ends (the module docstring); elsewhere, nothing."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # refused (a seccomp filter): the rank runs as it did without it
    if os.getppid() != launcher:  # the launcher died before the signal was set: it will never come
        os.kill(os.getpid(), signal.SIGKILL)
