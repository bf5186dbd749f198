"""HF checkpoints in, with data-parallel replicas of the experts: 4 ranks at EP=2.

With more ranks than the EP size, ranks 2 and 3 hold the same experts as ranks 0 and 1
(distributed/layout.py). An import that picks experts by the global rank instead of the EP
rank, or that reads only on the first replica, shows only here: every rank's weights are
compared with the checkpoint's, tensor by tensor, dense weights whole and experts as the
rank's slice.
"""

import pytest
import torch
from hf_reference import random_hf_mixtral
from launch import run_app

from te_mixtral.distributed.layout import is_expert_param

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
NPROC, EP = 4, 2


@pytest.mark.slow
def test_every_rank_of_every_replica_loads_its_share(tmp_path):
    torch.manual_seed(0)
    hf = random_hf_mixtral(**SMALL)
    hf.save_pretrained(tmp_path / "hf")  # per-expert tensors on disk
    want = hf.state_dict()  # the stacked in-memory names, which ours follow

    out = tmp_path / "out"
    proc = run_app([str(out), "--ep-size", str(EP), str(tmp_path / "hf")], nproc=NPROC,
                   script="tests/workers/load_hf.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(NPROC):
        (got,) = torch.load(out / f"weights{rank}.pt").values()
        assert got.keys() <= want.keys(), sorted(got.keys() - want.keys())
        assert any(is_expert_param(name) for name in got)
        for name, tensor in got.items():
            full = want[name]
            expected = full.chunk(EP)[rank % EP] if is_expert_param(name) else full
            assert torch.equal(tensor, expected), f"rank {rank}: {name}"
