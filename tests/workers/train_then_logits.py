"""torchrun worker: train like run_finetune_ep.py, then run the trained (sharded) model once.

Usage: torchrun ... tests/workers/train_then_logits.py OUT.pt [run_finetune_ep.py arguments]

After training every rank runs one forward on fixed token ids (the experts are sharded, so
all must); rank 0 saves {"ids", "logits"} to OUT.pt for comparison with the HF export.
"""

import contextlib
import sys
from pathlib import Path

import torch

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config
from te_mixtral.distributed.launcher_env import world_size_from_env
from te_mixtral.distributed.layout import shutdown
from te_mixtral.model.layers import PackedSequences
from te_mixtral.training.loop import train

out = Path(sys.argv[1])
args, overrides = parse_args(sys.argv[2:])
cfg = load_config(args.config, overrides, world_size=world_size_from_env())
result = train(cfg)
device = next(result.model.parameters()).device
ids = (torch.arange(2 * 16).view(2, 16) * 7 % 101).to(device)
packed = PackedSequences(torch.arange(16, device=device).expand(2, 16),
                         torch.tensor([0, 16, 32], dtype=torch.int32, device=device), 16)
autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
            else contextlib.nullcontext())
with torch.no_grad(), autocast:
    logits = result.model(ids, packed)
if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
    torch.save({"ids": ids.cpu(), "logits": logits.float().cpu()}, out)
shutdown(wait_for_peers=True)
sys.exit(result.exit_code)
