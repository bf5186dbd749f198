"""torchrun worker: train like run_finetune_ep.py, then save this rank's weights.

Usage: torchrun ... tests/workers/train_and_save.py WEIGHTS_DIR [run_finetune_ep.py arguments]
"""

import sys
from pathlib import Path

import torch

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config
from te_mixtral.distributed.layout import shutdown, world_size_from_env
from te_mixtral.training.loop import train

weights_dir = Path(sys.argv[1])
args, overrides = parse_args(sys.argv[2:])
cfg = load_config(args.config, overrides, world_size=world_size_from_env())
result = train(cfg)
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
weights_dir.mkdir(parents=True, exist_ok=True)
torch.save(result.model.state_dict(), weights_dir / f"rank{rank}.pt")
shutdown()
sys.exit(result.exit_code)
