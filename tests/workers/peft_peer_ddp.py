"""torchrun worker: benchmarks/peft_peer.py on two CPU processes (gloo), the tiny config.

Each rank trains on its own row, and DistributedDataParallel keeps the adapters equal on
both ranks, and moved from where they started. Exits non-zero on any mismatch.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, a folder of the repository
from benchmarks import peft_peer  # noqa: E402

built = []


def capturing(*args, **kwargs):
    built.append(peft_peer.build_peft_model_uncaptured(*args, **kwargs))
    return built[-1]


peft_peer.build_peft_model_uncaptured, peft_peer.build_peft_model = peft_peer.build_peft_model, capturing
args = argparse.Namespace(config=sys.argv[1], layers=None, rank=4, alpha=8.0, steps=3, warmup=1, doc_len=None,
                          gradient_checkpointing=True, json=None)
world = peft_peer.launched_world()
cfg = peft_peer.workload_config(args, world)
with peft_peer.process_group(world) as rank:
    initial = None
    result = peft_peer.run(args, cfg, torch.device("cpu"))
    adapters = torch.cat([p.detach().flatten() for p in built[0].parameters() if p.requires_grad])
    everyone = [torch.empty_like(adapters) for _ in range(world)]
    dist.all_gather(everyone, adapters)
    losses = [None] * world
    dist.all_gather_object(losses, result["loss"])
    assert all(torch.equal(a, everyone[0]) for a in everyone), "DDP left the ranks' adapters apart"
    assert losses[0] != losses[1], "both ranks trained on the same rows"
    assert result["workload"]["layout"] == f"DistributedDataParallel over {world} GPUs"
    assert result["workload"]["tokens_per_step"] == cfg.data.seq_len
    assert all(torch.isfinite(torch.tensor(loss)).all() for loss in losses)
print(f"rank {rank}: ok")
