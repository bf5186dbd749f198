"""torchrun worker: benchmarks/torchtitan_peer.py's model on two CPU processes (gloo), built
as torchtitan's trainer builds it (`build_parallel`) at EP 1 (FSDP over both ranks) and EP 2
(each rank holds half the experts), the tiny config at one layer.

Each rank runs the forward and loss on its own row at both degrees: same seed, same
weights, so the same loss. Prints "ep N: ok" per degree; exits non-zero on any mismatch.
"""

import argparse
import sys

import torch
import torch.distributed as dist
from bench.titan_on_cpu import PATCHES, count_in_float

from benchmarks.peer_workload import random_rows, rows_per_gpu, workload_config
from benchmarks.torchtitan_peer import build_parallel, job_config, loss_of, titan_inputs
from te_mixtral.distributed.layout import shutdown

for module, name, value in PATCHES:
    setattr(module, name, value)
cfg = workload_config(argparse.Namespace(config=sys.argv[1], layers=1))
dist.init_process_group("gloo")  # torchtitan's init_distributed keeps it
rank, world = dist.get_rank(), dist.get_world_size()
tokens = rows_per_gpu(cfg, world) * cfg.data.seq_len  # one rank's row, as the peer counts it
(row,) = random_rows(cfg, 1, 50, torch.Generator().manual_seed(rank), "cpu", world)
losses = {}
for ep in (1, 2):
    model, amp = build_parallel(cfg.model, "flex", job_config(ep, "float32", tokens, cfg.train.seed),
                                torch.device("cpu"))
    count_in_float(model)
    w1 = model.layers["0"].moe.experts.w1
    mesh = "ep" if ep > 1 else "fsdp"
    assert mesh in w1.device_mesh.mesh_dim_names, (ep, w1.device_mesh)
    assert w1.shape == (cfg.model.num_experts, cfg.model.intermediate_size, cfg.model.hidden_size)
    with torch.no_grad():
        losses[ep] = loss_of(model, titan_inputs(row), amp).item()
    print(f"rank {rank} ep {ep}: loss {losses[ep]:.6f}", flush=True)
torch.testing.assert_close(losses[2], losses[1], rtol=1e-5, atol=1e-5)
for ep in losses:
    print(f"ep {ep}: ok")
shutdown(wait_for_peers=True)
