"""`train.sharding: fsdp` (FSDP2, te_mixtral/distributed/parallelize.py) trains exactly like the
unsharded reference, while each rank keeps only its share of the optimizer state."""

import json

import pytest
import torch
from conftest import REPO
from launch import EP_ARGS, EP_STEPS, train_ep_many

from te_mixtral.config import load_config
from te_mixtral.distributed.layout import is_expert_param
from te_mixtral.measure.memory import estimate_memory

WORLD = 4
ADAMW_STATE_BYTES = 8  # fp32 exp_avg and exp_avg_sq per parameter

# name: (ep, *extra arguments), as train_ep_many takes them.
RUNS = {"none-ep2": (2,), "fsdp-ep2": (2, "--sharding", "fsdp"),
        "none-ep4": (4,), "fsdp-ep4": (4, "--sharding", "fsdp"),
        "none-batch8": (2, "--batch_size", "8"),
        "fsdp-accum": (2, "--batch_size", "8", "--sharding", "fsdp", "--grad_accum_steps", "2"),
        "fsdp-accum-each": (2, "--batch_size", "8", "--sharding", "fsdp", "--grad_accum_steps", "2",
                            "--fsdp_reduce", "micro_batch")}
# Launched with the other modules' four-rank runs (conftest.py's launch_planned).
PLANNED_RUNS = {WORLD: [[*EP_ARGS, "--ep-size", str(ep), *extra] for ep, *extra in RUNS.values()]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch_planned):
    """Every four-rank run of this module, trained in one launch: (folder, {name: (losses, weights)})."""
    folder = tmp_path_factory.mktemp("sharding")
    launch_planned(WORLD)
    return folder, train_ep_many(folder, WORLD, RUNS)


def held_bytes(folder, name, part):
    """What each rank held of `part` ("parameters" or "optimizer state") after training, or
    its "syncs": whether each micro-batch's backward communicated."""
    return [json.loads((folder / name / "weights" / f"held{r}.json").read_text())[part] for r in range(WORLD)]


def optimizer_bytes(folder, name):
    return held_bytes(folder, name, "optimizer state")


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4], ids=["ep2xdp2", "ep4"])
def test_fsdp_equals_unsharded(runs, ep):
    folder, trained = runs
    ref_losses, ref = trained[f"none-ep{ep}"]
    losses, sharded = trained[f"fsdp-ep{ep}"]

    assert len(losses) == EP_STEPS
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]  # it learned, so equal weights say something
    for rank, (got, want) in enumerate(zip(sharded, ref)):
        assert got.keys() == want.keys()
        for name in want:
            # Reduce-scatter and all-reduce add the ranks' gradients in different orders;
            # atol for embedding rows in Adam's eps regime (see test_expert_parallel.py).
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")

    # Unsharded, every rank holds the state of all dense weights and of its EP rank's experts.
    # Sharded, the dense state is split over the world and each expert's over its W/EP replicas.
    dense = sum(t.numel() for name, t in ref[0].items() if not is_expert_param(name))
    experts = sum(t.numel() for name, t in ref[0].items() if is_expert_param(name))
    assert optimizer_bytes(folder, f"none-ep{ep}") == [ADAMW_STATE_BYTES * (dense + experts)] * WORLD
    state = optimizer_bytes(folder, f"fsdp-ep{ep}")
    assert sum(state) == ADAMW_STATE_BYTES * (dense + experts * ep)  # the shards partition it
    share = ADAMW_STATE_BYTES * (dense / WORLD + experts / (WORLD // ep))
    for rank_bytes in state:  # uneven dim-0 splits of small tensors leave a little over
        assert abs(rank_bytes - share) < 0.05 * share, (state, share)


@pytest.mark.slow
@pytest.mark.parametrize("name, syncs", [("fsdp-accum", [False, True]), ("fsdp-accum-each", [True, True])],
                         ids=["reduce-once-a-step", "reduce-every-micro-batch"])
def test_fsdp_with_accumulation_equals_one_unsharded_batch(runs, name, syncs):
    """Under fsdp with `fsdp_reduce: step`, only a step's last micro-batch reduce-scatters and
    the earlier ones add into FSDP's whole gradients; with `micro_batch` each one reduce-scatters
    and FSDP adds the shards. Either way two micro-batches train like one batch of both."""
    folder, trained = runs
    assert held_bytes(folder, name, "syncs") == [syncs * EP_STEPS] * WORLD
    ref_losses, ref = trained["none-batch8"]
    losses, sharded = trained[name]
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    for rank, (got, want) in enumerate(zip(sharded, ref)):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["none-ep2", "fsdp-ep2", "none-ep4", "fsdp-ep4", "fsdp-accum", "fsdp-accum-each"])
def test_memory_estimate_counts_what_each_rank_holds(runs, name):
    """The estimate's weights, gradients and optimizer state at the optimizer step against
    the bytes each rank of a real four-rank run held, its own shards where FSDP shards."""
    folder, _ = runs
    ep, *extra = RUNS[name]
    overrides = {"ep_size": str(ep), **dict(zip(extra[::2], extra[1::2]))}
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {k.lstrip("-"): v for k, v in overrides.items()}, WORLD)
    step = estimate_memory(cfg, WORLD, device="cpu").phases["optimizer step"]
    gradients = [sum(g.nbytes for g in torch.load(folder / name / "weights" / f"grads{r}.pt")[-1].values())
                 for r in range(WORLD)]
    for part, held in (("parameters", held_bytes(folder, name, "parameters")), ("gradients", gradients),
                       ("optimizer state", optimizer_bytes(folder, name))):
        for rank_bytes in held:  # uneven dim-0 splits of small tensors leave a little over
            assert abs(rank_bytes - step[part]) <= 0.05 * step[part], (name, part, held, step[part])
