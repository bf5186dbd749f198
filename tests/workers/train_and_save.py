"""torchrun worker: train like run_finetune_ep.py, then save this rank's weights and the
gradients it held after each step's gradient all-reduce.

Usage: torchrun ... tests/workers/train_and_save.py WEIGHTS_DIR [run_finetune_ep.py arguments]

Writes WEIGHTS_DIR/rank{r}.pt (the state dict) and WEIGHTS_DIR/grads{r}.pt: one dict of
gradients per call of the loop's `all_reduce_gradients`, so the list's length is how many
times the gradients were communicated.
"""

import sys
from pathlib import Path

import torch

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config
from te_mixtral.distributed.layout import (
    all_reduce_gradients,
    shutdown,
    world_size_from_env,
)
from te_mixtral.training import loop

reduced = []


def recording_all_reduce_gradients(model, layout):
    all_reduce_gradients(model, layout)
    reduced.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})


weights_dir = Path(sys.argv[1])
args, overrides = parse_args(sys.argv[2:])
cfg = load_config(args.config, overrides, world_size=world_size_from_env())
loop.all_reduce_gradients = recording_all_reduce_gradients  # the loop's own call, wrapped
result = loop.train(cfg)
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
weights_dir.mkdir(parents=True, exist_ok=True)
torch.save(result.model.state_dict(), weights_dir / f"rank{rank}.pt")
torch.save(reduced, weights_dir / f"grads{rank}.pt")
shutdown()
sys.exit(result.exit_code)
