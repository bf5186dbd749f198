"""Fine-tune a Mixtral-style MoE model with expert parallelism.

    python run_finetune_ep.py --help     # example commands and every config key (te_mixtral/cli.py)
"""

import sys

from te_mixtral.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
