"""`python -m te_mixtral.torchrun ...`: torchrun, with the ranks' exit code passed on and
one line for a failed job.

torchrun takes the same arguments (`--standalone --nproc_per_node=2 run_finetune_ep.py
--ep-size 2`), but exits 1 whenever a rank fails, whatever that rank's own exit code: its
elastic agent turns every failure into one `ChildFailedError`. A script that launches with
torchrun (or with `accelerate launch`, which runs torchrun's launcher inside) therefore
cannot tell bad input (2) from a lost peer (3), a diverged run (4), a full disk (5) or
Ctrl-C (130), nor any of them from a failed loss check (1): the codes of
`te_mixtral.errors.ExitCode` that `python run_finetune_ep.py` returns. And torchrun prints,
after the rank's one line, its agent's log of the failure, a traceback of that
`ChildFailedError` and a summary of every rank's failure: 20 to 40 lines for one bad flag.
No exit code of a rank keeps torchrun quiet: any code but 0 ends that way.

This module runs torchrun's own launcher (`torch.distributed.run.run`) in this process
and exits with the code a failed rank exited with: rank 0's if it failed by itself (rank 0
is the rank that reports: a peer's death is its LOST_A_PEER), else the lowest failed
rank's. Ranks the launcher stopped itself with SIGTERM once another had failed do not
count (unless that is all there is); a rank killed by a signal counts as 128 + the signal,
as shells count it. It prints nothing of the launcher's: the failed rank has said why in
its own line (te_mixtral/errors.py), or in its traceback where it crashed. Only a rank
killed by a signal, which could say nothing, gets a line here.

torchrun's own argument errors (an unknown option, `--nproc_per_node=0`) are one line and
exit 2, as argparse's convention has it, instead of a usage screen or a traceback. So are
machine counts and ranks that contradict each other, which torchrun accepts: `--standalone`
with `--nnodes` above 1 waits for machines that can never join (its rendezvous is on
localhost), a `--node-rank` outside `--nnodes` waits for ever in the static rendezvous, and
one given to any other rendezvous is ignored (torchrun says so in its agent's log, which
this module silences).

Our own app's command line (run_finetune_ep.py's) is checked here before any rank starts, as
each rank would check it first (the config loaded and validated, for the world size torchrun
will start): bad input the ranks found would be found again by every restart torchrun makes
(`--max-restarts` restarts after any failure), each time with the same line. What the config
alone cannot tell (a data set that is not there, a tier this machine cannot run) is left to
the ranks, as is an elastic `--nnodes MIN:MAX`, whose world size is not known yet.

With `--max-restarts`, each restarted attempt gets a rendezvous store of its own
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, unless the environment sets it): torchrun's default
shares one store across attempts, and a restarted process group may then read the dead
attempt's addresses from it and fail to connect (gloo's "connectFullMesh failed"; a race, so
not on every restart). The restarted run itself continues from its launch's checkpoint
(te_mixtral/training/restart.py).
"""

import logging
import os
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, get_args_parser, parse_min_max_nnodes, run

from te_mixtral.cli import load_command_line
from te_mixtral.errors import ExitCode, UserError, first_line, report_error

PROG = "te_mixtral.torchrun"

# The app's entry script, whose command line is checked before launching (module docstring).
APP = Path(__file__).resolve().parent.parent / "run_finetune_ep.py"


class _ArgumentError(Exception):
    """torchrun refused its arguments."""


def _refuse(message: str):
    raise _ArgumentError(message)


def _shell_code(exitcode: int) -> int:
    """A process's exit status as a shell reports it: a negative one is a signal's number."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _refuse_contradictions(args) -> None:
    """Refuse the machine counts and ranks torchrun accepts but cannot honour (module docstring)."""
    try:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        return  # torchrun's own check says what is wrong with it
    if args.standalone and max_nodes > 1:
        _refuse(f"--standalone runs on this machine alone, and --nnodes {args.nnodes} asks for up to {max_nodes}: "
                f"drop --standalone and give every machine the same --rdzv-endpoint HOST:PORT and --rdzv-id")
    static = args.rdzv_backend == "static" and not args.standalone
    if args.node_rank != 0 and not static:
        _refuse(f"--node-rank {args.node_rank} is read by the static rendezvous alone (--master-addr, --master-port); "
                f"{'--standalone' if args.standalone else f'--rdzv-backend {args.rdzv_backend}'} numbers the machines "
                f"itself: drop --node-rank")
    if not 0 <= args.node_rank < max_nodes:
        _refuse(f"--node-rank {args.node_rank} is not one of --nnodes {args.nnodes}'s (0 to {max_nodes - 1}): the "
                f"rendezvous would wait for ever for the machines it numbers")


def _check_the_app(args) -> None:
    """Check our app's command line as its ranks will first check it, raising their UserError
    (module docstring); another script, or a world size not known yet, is left alone."""
    if args.module or args.no_python or Path(args.training_script).resolve() != APP:
        return
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
        per_node = determine_local_world_size(args.nproc_per_node)
    except (RuntimeError, ValueError):
        return  # torchrun's own check says what is wrong with them
    if min_nodes == max_nodes and min_nodes * per_node > 0:  # else torchrun refuses the counts itself
        load_command_line(args.training_script_args, min_nodes * per_node)


def _quiet_agent() -> None:
    """Silence the log of torchrun's agent (each failed rank, the SIGTERM it sends the
    others): the failed rank has said why. Its loggers set their own levels (torch's
    `elastic.utils.logging.get_logger`), so each is set, not their parent."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: list[str]) -> int:
    """Launch as torchrun would; return the exit code the failed ranks meant."""
    parser = get_args_parser()
    parser.prog = PROG
    parser.error = _refuse  # argparse's usage screen and exit, as one line
    try:
        args = parser.parse_args(argv)
        _refuse_contradictions(args)
        _check_the_app(args)
        if args.max_restarts > 0:
            os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see the module docstring
        _quiet_agent()
        run(args)
    except UserError as e:  # the app's, said as a rank says it
        return report_error(e, 1, True)
    except _ArgumentError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    except (ValueError, AssertionError) as e:  # how torchrun refuses what its arguments mean, before any rank starts
        print(f"{PROG}: error: torchrun refused its arguments ({first_line(e)}): check --nproc-per-node, --nnodes "
              f"and the rest against `torchrun --help`", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    except ChildFailedError as e:
        failed = {rank: f.exitcode for rank, f in e.failures.items() if f.exitcode != -signal.SIGTERM}
        rank = min(failed) if failed else min(e.failures)
        exitcode = failed[rank] if failed else -signal.SIGTERM
        if exitcode < 0:  # killed: the rank could say nothing itself
            print(f"{PROG}: error: rank {rank} was killed by {_signal_name(-exitcode)} (the out-of-memory killer "
                  f"sends SIGKILL)", file=sys.stderr, flush=True)
        return _shell_code(exitcode)
    except SignalException as e:  # the launcher itself was stopped (Ctrl-C: SIGINT)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
