"""`python -m te_mixtral.torchrun ...`: torchrun, with the ranks' exit code passed on.

torchrun takes the same arguments (`--standalone --nproc_per_node=2 run_finetune_ep.py
--ep-size 2`), but exits 1 whenever a rank fails, whatever that rank's own exit code: its
elastic agent turns every failure into one `ChildFailedError`. A script that launches with
torchrun (or with `accelerate launch`, which runs torchrun's launcher inside) therefore
cannot tell bad input (2) from a lost peer (3), a diverged run (4), a full disk (5) or
Ctrl-C (130), nor any of them from a failed loss check (1): the codes of
`te_mixtral.errors.ExitCode` that `python run_finetune_ep.py` returns.

This module runs torchrun's own launcher (`torch.distributed.run.run`) in this process
and exits with the code a failed rank exited with: rank 0's if it failed by itself (rank 0
is the rank that reports: a peer's death is its LOST_A_PEER), else the lowest failed
rank's. Ranks the launcher stopped itself with SIGTERM once another had failed do not
count (unless that is all there is); a rank killed by a signal counts as 128 + the signal,
as shells count it. torchrun's summary of the failure is printed as torchrun prints it,
without the launcher's own traceback.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def _shell_code(exitcode: int) -> int:
    """A process's exit status as a shell reports it: a negative one is a signal's number."""
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: list[str]) -> int:
    """Launch as torchrun would; return the exit code the failed ranks meant."""
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        failed = {rank: f.exitcode for rank, f in e.failures.items() if f.exitcode != -signal.SIGTERM}
        return _shell_code(failed[min(failed)] if failed else -signal.SIGTERM)
    except SignalException as e:  # the launcher itself was stopped (Ctrl-C: SIGINT)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
