"""torchrun worker (2 ranks, EP=1): a `GradientReducer` with small buckets against the
per-parameter all-reduce after backward (`layout.all_reduce_gradients`), on the same two
micro-batches of gradient accumulation, then a second step on the same reducer. On the CPU
over gloo; with `cuda`, one GPU a rank over NCCL, where the buckets are launched from the
backward's own stream.

Usage: torchrun --nproc_per_node=2 tests/workers/overlapped_reduction.py OUT_DIR [cpu|cuda]
Writes OUT_DIR/rank{r}.pt: what each bucket had launched after each backward, the number of
buckets per group, and both models' gradients after each step's reduction.
"""

import sys
from pathlib import Path

import torch

from te_mixtral.config import load_config
from te_mixtral.distributed.layout import all_reduce_gradients, init_layout, shutdown
from te_mixtral.distributed.overlap import GradientReducer
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.layers import TORCH, PackedSequences
from te_mixtral.model.mixtral import MixtralForCausalLM, causal_lm_loss, init_weights

out_dir = Path(sys.argv[1])
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
MODEL = {"vocab_size": "64", "hidden_size": "16", "intermediate_size": "24", "num_hidden_layers": "2",
         "num_attention_heads": "2", "num_key_value_heads": "1", "head_dim": "8", "num_experts": "4",
         "tokenizer_vocab_size": "64", "device": device, "ep_size": "1", "batch_size": "4"}
layout = init_layout(1, device, 120)
cfg = load_config(None, MODEL, world_size=2)


def build():
    with torch.device(device):
        model = MixtralForCausalLM(cfg.model, TORCH, layout, LoopTier())
    init_weights(model, 0, layout)
    return model


reference, model = build(), build()
reducer = GradientReducer(model, layout, bucket_bytes=2048)  # a bucket or two per layer's dense weights
packed = PackedSequences(torch.arange(16, device=device).expand(2, 16),
                         torch.tensor([0, 16, 32], dtype=torch.int32, device=device), 16)
gen = torch.Generator().manual_seed(100 + layout.rank)
steps = [[torch.randint(0, 64, (2, 17), generator=gen).to(device) for _ in range(2)],
         [torch.randint(0, 64, (2, 17), generator=gen).to(device)]]
record = {"buckets": {kind: len(queue.buckets) for kind, queue in reducer.queues.items()},
          "launched": [], "reference": [], "overlapped": []}
for micro_batches in steps:
    for m in (reference, model):
        m.zero_grad(set_to_none=True)
        for tokens in micro_batches:
            reducer.sync = tokens is micro_batches[-1]
            loss = causal_lm_loss(m(tokens[:, :-1], packed), tokens[:, 1:], torch.tensor(64.0, dtype=torch.float64, device=device))
            (loss + m.router_losses(layout).weighted(cfg.model)).backward()
            if m is model:
                record["launched"].append([bucket.work is not None for bucket in reducer.buckets])
    all_reduce_gradients(reference, layout)
    reducer.finish()
    for m, key in ((reference, "reference"), (model, "overlapped")):
        record[key].append({name: p.grad.cpu() for name, p in m.named_parameters()})
out_dir.mkdir(parents=True, exist_ok=True)
torch.save(record, out_dir / f"rank{layout.rank}.pt")
shutdown(wait_for_peers=True)
