"""torchrun worker: train like run_finetune_ep.py, then save this rank's weights, whole
(sharded ones gathered: what the rank would hold without sharding), the gradients it held
after each step's gradient reduction and after each step's clipping, and the bytes of its
optimizer state as it holds them.

Usage: torchrun ... tests/workers/train_and_save.py WEIGHTS_DIR [run_finetune_ep.py arguments]
   or: torchrun ... tests/workers/train_and_save.py --runs RUNS.json
where RUNS.json lists [WEIGHTS_DIR, [arguments]] pairs: several runs, one after another, in
one launch (start-up, not training, is most of a short CPU run's time). Each run builds its
own model, optimizer and layout; only the process group is shared.

Writes WEIGHTS_DIR/rank{r}.pt (the state dict) and WEIGHTS_DIR/grads{r}.pt: one dict of
gradients per call of the loop's `reduce_gradients`, so the list's length is how many
times the gradients were communicated; WEIGHTS_DIR/clipped{r}.pt: the same after each call
of the loop's `clip_gradients`, times the clip factor the optimizer applies itself (where it
does): the gradients the optimizer stepped with.
"""

import json
import sys
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config
from te_mixtral.distributed.layout import init_layout, shutdown, world_size_from_env
from te_mixtral.distributed.parallelize import reduce_gradients
from te_mixtral.training import loop
from te_mixtral.training.optimizer import clip_gradients

reduced, clipped = [], []


def local_grads(model) -> dict:
    return {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in model.named_parameters() if p.grad is not None}


def recording_reduce_gradients(model, layout, sharding):
    reduce_gradients(model, layout, sharding)
    reduced.append(local_grads(model))


def recording_clip_gradients(optimizer, model, max_norm, layout):
    total_norm, grad_scale = clip_gradients(optimizer, model, max_norm, layout)
    grads = local_grads(model)
    clipped.append(grads if grad_scale is None else {name: g * grad_scale for name, g in grads.items()})
    return total_norm, grad_scale


def init_layout_once(ep_size, device, timeout_s):
    """The loop's `init_layout`, starting the process group only on the first run: later runs
    build their layout (mesh and groups) on the same group. A group destroyed and started
    again in one process can hang at its rendezvous."""
    if not dist.is_initialized():
        return init_layout(ep_size, device, timeout_s)
    with patch.object(dist, "init_process_group", lambda *args, **kwargs: None):
        return init_layout(ep_size, device, timeout_s)


def train_and_save(weights_dir: Path, argv: list[str]) -> int:
    reduced.clear()
    clipped.clear()
    args, overrides = parse_args(argv)
    cfg = load_config(args.config, overrides, world_size=world_size_from_env())
    result = loop.train(cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    weights_dir.mkdir(parents=True, exist_ok=True)
    weights = {name: value.full_tensor() if isinstance(value, DTensor) else value
               for name, value in result.model.state_dict().items()}
    torch.save(weights, weights_dir / f"rank{rank}.pt")
    state = [value.to_local() if isinstance(value, DTensor) else value
             for per_param in result.optimizer.state.values() for value in per_param.values()]
    (weights_dir / f"optimizer{rank}.json").write_text(json.dumps(sum(t.nbytes for t in state if t.dim() > 0)))
    torch.save(reduced, weights_dir / f"grads{rank}.pt")
    torch.save(clipped, weights_dir / f"clipped{rank}.pt")
    return result.exit_code


if sys.argv[1] == "--runs":
    runs = json.loads(Path(sys.argv[2]).read_text())
else:
    runs = [(sys.argv[1], sys.argv[2:])]
loop.reduce_gradients = recording_reduce_gradients  # the loop's own calls, wrapped
loop.clip_gradients = recording_clip_gradients
loop.init_layout = init_layout_once
exit_codes = [train_and_save(Path(weights_dir), argv) for weights_dir, argv in runs]
shutdown(wait_for_peers=True)
sys.exit(max(exit_codes))
