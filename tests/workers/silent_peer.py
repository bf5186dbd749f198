"""torchrun worker (4 ranks, EP=2 x DP=2): every process group a run makes after the world's
gives up on a silent peer after the run's dist_timeout_s, as the world group does. Rank 3
stays alive and says nothing (as a rank stopped, or stuck in a kernel, does); the other ranks
all-reduce on each of their groups that holds it: the layout's EP and expert-replica groups
and the gradient reducer's own (te_mixtral/distributed/overlap.py). torch gives a group made
after the world group its own default timeout (30 minutes for gloo, 10 for NCCL), not the
world's.

Usage: torchrun --nproc_per_node=4 tests/workers/silent_peer.py OUT_DIR TIMEOUT_S
Writes OUT_DIR/rank{r}.json on ranks 0-2: for each group holding rank 3, [name, whether the
all-reduce raised, seconds it took]. Rank 3 waits for those files (at most WAIT_S), then
leaves; so without the timeouts the others wait WAIT_S, not half an hour.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from te_mixtral.distributed.layout import init_layout, mesh_layout
from te_mixtral.distributed.overlap import GradientReducer

SILENT, WAIT_S = 3, 40
out_dir, timeout_s = Path(sys.argv[1]), int(sys.argv[2])
# Started with time to spare (ranks busy importing on a loaded machine reach it seconds apart),
# then the layout's groups made again as a run makes them, with the timeout under test.
init_layout(2, "cpu", 120)
layout = mesh_layout(2, "cpu", timedelta(seconds=timeout_s))
# A dense weight and an expert one (its name holds `.experts.`) give the reducer both its groups.
model = nn.Module()
model.attention, model.mlp = nn.Linear(2, 2), nn.Module()
model.mlp.experts = nn.Linear(2, 2)
reducer = GradientReducer(model, layout)
groups = {"ep": layout.ep_group, "expert replicas": layout.expert_replica_group,
          **{f"reducer {kind}": queue.buckets[0].group for kind, queue in reducer.queues.items()}}

if layout.rank == SILENT:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not all((out_dir / f"rank{r}.json").exists() for r in range(SILENT)):
        time.sleep(0.1)
else:
    # All at once, each on its own group (a group of live ranks has nothing to wait for).
    start = time.monotonic()
    works = {name: dist.all_reduce(torch.ones(1), group=group, async_op=True)
             for name, group in groups.items() if SILENT in dist.get_process_group_ranks(group)}
    record = []
    for name, work in works.items():
        try:
            work.wait()
            raised = False
        except RuntimeError:
            raised = True
        record.append([name, raised, time.monotonic() - start])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{layout.rank}.json.tmp").write_text(json.dumps(record))
    (out_dir / f"rank{layout.rank}.json.tmp").rename(out_dir / f"rank{layout.rank}.json")
sys.stdout.flush()
os._exit(0)  # not destroy_process_group: its teardown would wait on the peer these gave up on
