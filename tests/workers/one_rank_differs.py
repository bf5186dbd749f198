"""torchrun worker: `run_finetune_ep.py` whose command line differs on rank 1, as on a second
machine whose copy of the config file differs.

Usage: torchrun --nproc_per_node=2 tests/workers/one_rank_differs.py ARGS... --rank1 EXTRA...
Every rank runs ARGS; rank 1 runs EXTRA after them.
"""

import os
import sys

from te_mixtral.cli import main

args = sys.argv[1:]
cut = args.index("--rank1")
sys.exit(main(args[:cut] + (args[cut + 1:] if os.environ["RANK"] == "1" else [])))
