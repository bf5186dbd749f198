"""`train.sharding: fsdp` with `train.optimizer: master_adamw`: FSDP2's bf16 shards step exactly
as the unsharded parameters do, checkpoint and resume bit for bit (sharded, and unsharded from
the sharded checkpoint: each expert found where FSDP's cut of the EP cut put it), and export
the same HF checkpoint (4 gloo ranks, EP=2 x DP=2 with the experts' moments in 8 bits, their
block scales sharded with the experts, and EP=4; tests/workers/sharded_master_adamw.py)."""

import filecmp

import pytest
import torch
from launch import RUN_DIR, WORKER, run_worker

from te_mixtral.distributed.layout import is_expert_param

WORLD = 4
LAYOUTS = (2, 4)  # EP sizes; DP = WORLD / EP
SCRIPT = "tests/workers/sharded_master_adamw.py"
PLANNED_RUNS = {WORLD: [[WORKER, SCRIPT, RUN_DIR]]}  # run in the session's four-rank launch


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1)


def assert_same_bits(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name in want:
        for key in want[name]:
            a, b = got[name][key], want[name][key]
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), f"{what}: {name} {key}"


@pytest.mark.slow
def test_sharded_master_adamw(tmp_path, launch_planned):
    launch_planned(WORLD)
    proc = run_worker(tmp_path, SCRIPT, [RUN_DIR], nproc=WORLD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ep in LAYOUTS:
        for rank in range(WORLD):
            record = torch.load(tmp_path / f"ep{ep}" / f"rank{rank}.pt")
            where = f"EP={ep} rank {rank}"

            # The same backward, reduced by all-reduce (bf16 sums) and by FSDP's reduce-scatter
            # (fp32 sums, one rounding to bf16): a few bf16 ulps of the tensor's scale apart,
            # where a missing or doubled rank's share would be 25-100 % off.
            unsharded, sharded = record["grads"]
            for name, want in unsharded.items():
                scale = want.float().abs().max()
                torch.testing.assert_close(sharded[name].float(), want.float(), rtol=0, atol=2**-6 * scale,
                                           msg=f"{where}: gradient of {name}")

            # The clip norm summed over shards equals the unsharded one to fp32 rounding, and clips.
            for norm_unsharded, norm_sharded, clip in record["norms"]:
                assert abs(norm_sharded - norm_unsharded) <= 1e-6 * norm_unsharded, (where, record["norms"])
                assert clip < 1

            # The update is elementwise: given the same gradients and clip factor, each shard's
            # parameter, remainder, moments and step are the unsharded ones, bit for bit.
            assert_same_bits(record["sharded"], record["unsharded"], f"{where}, after two steps")
            # A resumed checkpoint steps on as the model it was saved from.
            assert record["resumed_step"] == 2
            assert_same_bits(record["resumed"], record["continued"], f"{where}, resumed and stepped")
            assert_same_bits(record["resumed_unsharded"], record["continued"], f"{where}, resumed unsharded")
            assert not torch.equal(record["continued"]["lm_head.weight"]["param"],
                                   record["sharded"]["lm_head.weight"]["param"])  # that step changed something

            # Each rank holds 1/W of the dense state and 1/DP of its experts' (uneven dim-0
            # splits of small tensors leave a little over).
            shapes = record["unsharded"]
            dense = sum(s["param"].numel() for name, s in shapes.items() if not is_expert_param(name))
            experts = sum(s["param"].numel() for name, s in shapes.items() if is_expert_param(name))
            numel_unsharded, numel_sharded = record["state_numel"]
            assert numel_unsharded == dense + experts
            share = dense / WORLD + experts / (WORLD // ep)
            assert abs(numel_sharded - share) < 0.1 * share, (where, numel_sharded, share)

        # The HF export of the sharded model is the unsharded model's, file for file.
        unsharded_hf, sharded_hf = tmp_path / f"ep{ep}" / "hf_unsharded", tmp_path / f"ep{ep}" / "hf_sharded"
        names = sorted(p.name for p in unsharded_hf.iterdir())
        assert names == sorted(p.name for p in sharded_hf.iterdir())
        assert sum(name.endswith(".safetensors") for name in names) == 3  # embeddings + 2 layers
        for name in names:
            assert filecmp.cmp(unsharded_hf / name, sharded_hf / name, shallow=False), (ep, name)
