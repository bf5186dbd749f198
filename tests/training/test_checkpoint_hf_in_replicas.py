"""HF checkpoints in, with data-parallel replicas of the experts: 4 ranks at EP=2.

With more ranks than the EP size, ranks 2 and 3 hold the same experts as ranks 0 and 1
(distributed/layout.py). An import that picks experts by the global rank instead of the EP
rank, or that reads only on the first replica, shows only here: every rank's weights are
compared with the checkpoint's, tensor by tensor, dense weights whole and experts as the
rank's slice.
"""

import json

import pytest
import torch
from launch import RUN_DIR, WORKER, run_worker
from transformers import MixtralForCausalLM

from te_mixtral.distributed.layout import is_expert_param

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
NPROC, EP = 4, 2
SCRIPT = "tests/workers/load_hf.py"
# A random HF Mixtral, written by rank 0, then loaded by every rank (per-expert tensors on disk).
ARGS = [f"{RUN_DIR}/out", "--ep-size", str(EP), "--random", json.dumps(SMALL), f"{RUN_DIR}/hf"]
PLANNED_RUNS = {NPROC: [[WORKER, SCRIPT, *ARGS]]}  # run in the session's four-rank launch


@pytest.mark.slow
def test_every_rank_of_every_replica_loads_its_share(tmp_path, launch_planned):
    launch_planned(NPROC)
    proc = run_worker(tmp_path, SCRIPT, ARGS, nproc=NPROC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # transformers reads the checkpoint back: the stacked in-memory names, which ours follow.
    want = MixtralForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for rank in range(NPROC):
        (got,) = torch.load(tmp_path / "out" / f"weights{rank}.pt").values()
        assert got.keys() <= want.keys(), sorted(got.keys() - want.keys())
        assert any(is_expert_param(name) for name in got)
        for name, tensor in got.items():
            full = want[name]
            expected = full.chunk(EP)[rank % EP] if is_expert_param(name) else full
            assert torch.equal(tensor, expected), f"rank {rank}: {name}"
