"""Fine-tune a Mixtral-style MoE model with expert parallelism.

    python run_finetune_ep.py --help     # example commands and every config key (te_mixtral/cli.py)
"""

import sys

if __name__ == "__main__":
    from te_mixtral.distributed.launcher_death import end_with_launcher

    end_with_launcher()  # first: a rank must not outlive a launcher killed as it starts
    try:  # torch takes seconds to import: a Ctrl-C then is no crash
        from te_mixtral.cli import main
    except KeyboardInterrupt:
        print("te_mixtral: error: interrupted while starting", file=sys.stderr, flush=True)
        sys.exit(130)  # errors.ExitCode.INTERRUPTED, which cannot be imported before what was interrupted
    sys.exit(main(sys.argv[1:]))
