"""`train.sharding: fsdp` (FSDP2, te_mixtral/distributed/parallelize.py) trains exactly like the
unsharded reference, while each rank keeps only its share of the optimizer state."""

import json

import pytest
import torch
from conftest import REPO
from launch import EP_ARGS, EP_STEPS, train_ep_many

from te_mixtral.config import load_config
from te_mixtral.distributed.layout import is_expert_param
from te_mixtral.planning.memory import estimate_memory

WORLD = 4
ADAMW_STATE_BYTES = 8  # fp32 exp_avg and exp_avg_sq per parameter
# What summing in another order may move a weight by over EP_STEPS steps. An embedding row's
# first step, when its token first appears, updates by lr * g / (|g| + eps): where a gradient
# entry cancels down to about Adam's eps (1e-8), a rounding difference dg of the sum moves that
# update by lr * dg / eps, a tenth of a step at dg = 1e-9. Measured up to 1.04e-5 (one element
# of model.embed_tokens.weight, identical on torch 2.11 and 2.13, with MKL's other code path,
# MKL_CBWR=COMPATIBLE); a lost or doubled micro-batch is caught by the gradients instead
# (`assert_same_first_gradients`), since Adam's update hardly depends on a gradient's scale.
WEIGHT_ATOL = 1e-4

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


def assert_same_first_gradients(folder, name, ref_name):
    """The first step's gradients, after the reduction, on each rank of run `name` (its own
    shards where FSDP shards) equal the same entries of reference run `ref_name`'s: both start
    from the same weights, so they differ only in the order of their sums: within 1e-5 of each
    tensor's largest entry (measured 5e-7), where a lost, doubled or halved micro-batch moves
    entries by a good part of it. A sharded parameter is its dim-0 chunk: dense ones
    over the world, experts over the W / EP replicas of their EP rank (rank = replica * EP + ep_rank)."""
    ep = RUNS[name][0]
    for rank in range(WORLD):
        got = torch.load(folder / name / "weights" / f"grads{rank}.pt")[0]
        want = torch.load(folder / ref_name / "weights" / f"grads{rank}.pt")[0]
        assert got.keys() == want.keys()
        for key, whole in want.items():
            shards, index = (WORLD // ep, rank // ep) if is_expert_param(key) else (WORLD, rank)
            if got[key].shape != whole.shape:  # sharded
                whole = torch.chunk(whole, shards, dim=0)[index]
            scale = want[key].abs().max().item()
            torch.testing.assert_close(got[key], whole, rtol=0, atol=1e-5 * scale, msg=f"rank {rank}: {key}")


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
    assert_same_first_gradients(folder, f"fsdp-ep{ep}", f"none-ep{ep}")
    for rank, (got, want) in enumerate(zip(sharded, ref)):
        assert got.keys() == want.keys()
        for name in want:
            # Reduce-scatter and all-reduce add the ranks' gradients in different orders.
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=WEIGHT_ATOL, msg=f"rank {rank}: {name}")

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
    assert_same_first_gradients(folder, name, "none-batch8")
    for rank, (got, want) in enumerate(zip(sharded, ref)):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=WEIGHT_ATOL, msg=f"rank {rank}: {key}")


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
