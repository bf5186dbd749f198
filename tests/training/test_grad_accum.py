"""Gradient accumulation: N micro-batches of b samples train exactly like one batch of N*b.

Every run here trains the same global batches (8 samples a step) through the real loop
(tests/workers/train_and_save.py), in one micro-batch or in N, in one process and over gloo
ranks. The worker records the gradients after each call of the loop's gradient all-reduce,
so the tests see both how often gradients were communicated and what they summed to.
"""

import launch
import pytest
import torch

STEPS = 2
COMMON = ["--steps", str(STEPS), "--timing_warmup_steps", "1", "--batch_size", "8", "--seq_len", "64",
          "--log_every", "1"]
# The micro-batch counts each layout (nproc, ep) trains: its reference (1) and those it is compared with.
ACCUMS = {(1, 1): (1, 2, 4), (2, 2): (1, 2, 4), (4, 2): (1, 2)}


def run_args(ep: int, accum: int) -> list[str]:
    return [*COMMON, "--ep-size", str(ep), "--grad_accum_steps", str(accum)]


# Launched with the other modules' runs of the same rank count (conftest.py's launch_planned); the
# four-rank ones for the slow test only.
PLANNED_RUNS = {nproc: [run_args(ep, n) if nproc < 4 else pytest.param(run_args(ep, n), marks=pytest.mark.slow)
                        for n in accums] for (nproc, ep), accums in ACCUMS.items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, launch_planned):
    """`trained(nproc, ep, accum)`: one run's (results, weights, gradients), each run once per
    module; the first run of a layout brings all of that layout's, in one launch."""
    runs = {}

    def run(nproc: int, ep: int, accum: int):
        if (nproc, ep, accum) not in runs:
            keys = [(nproc, ep, n) for n in ACCUMS[(nproc, ep)]]
            outs = [tmp_path_factory.mktemp(f"w{nproc}-ep{ep}-n{n}") for _, _, n in keys]
            launch_planned(nproc)
            trained = launch.train_and_save_many([(out, run_args(ep, n)) for out, (_, _, n) in zip(outs, keys)],
                                                 nproc)
            runs.update(zip(keys, trained))
        return runs[(nproc, ep, accum)]

    return run


def assert_same_training(trained, nproc, ep, accum):
    one_batch, accumulated = trained(nproc, ep, 1), trained(nproc, ep, accum)
    (losses, weights, grads), (want_losses, want_weights, want_grads) = (
        (r[0]["losses"], r[1], r[2]) for r in (accumulated, one_batch))

    # The gradients are communicated once per optimizer step, not once per micro-batch.
    assert [len(g) for g in grads] == [STEPS] * nproc
    # The first step starts from the same weights: the summed gradients of N micro-batches
    # are one big batch's, on every rank, every parameter.
    assert losses[0] == pytest.approx(want_losses[0], rel=1e-6, abs=0)
    for rank in range(nproc):
        got, want = grads[rank][0], want_grads[rank][0]
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=f"rank {rank}: {name}")
    # A mis-scaled loss (each micro-batch divided by its own targets) would be off by ~N:
    # make sure the gradients are not all tiny, so the tolerance above could catch it.
    assert max(g.abs().max().item() for g in want_grads[0][0].values()) > 1e-2
    # The rest of the run follows: the second step's loss and the final weights agree
    # (atol as tests/distributed/test_expert_parallel.py: Adam magnifies rounding in its eps regime).
    assert losses[1] == pytest.approx(want_losses[1], rel=1e-5)
    for rank in range(nproc):
        for name, want in want_weights[rank].items():
            torch.testing.assert_close(weights[rank][name], want, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("accum", [2, 4])
def test_micro_batches_equal_one_batch(trained, accum):
    assert_same_training(trained, 1, 1, accum)


@pytest.mark.parametrize("accum", [2, 4])
def test_micro_batches_equal_one_batch_ep2(trained, accum):
    assert_same_training(trained, 2, 2, accum)


@pytest.mark.slow
def test_micro_batches_equal_one_batch_ep2xdp2(trained):
    assert_same_training(trained, 4, 2, 2)


def test_throughput_counts_every_micro_batch(trained):
    """tokens/s and FLOPs are per optimizer step, over all its micro-batches."""

    def per_step(summary):
        step_s = summary["median_step_ms"] / 1e3
        return summary["tokens_per_s"] * step_s, summary["tflops_per_gpu"] * 1e12 * step_s

    one_batch, accumulated = (trained(1, 1, accum)[0]["summary"] for accum in (1, 2))
    assert accumulated["timed_steps"] == one_batch["timed_steps"] == STEPS - 1  # one time per optimizer step
    tokens, flops = per_step(accumulated)
    want_tokens, want_flops = per_step(one_batch)
    # tokens/s times step seconds is floating-point: 512 may come back as 511.99999999999994.
    assert tokens == pytest.approx(want_tokens, rel=1e-9) and want_tokens == pytest.approx(8 * 64, rel=1e-9)
    # Micro-batches split at sample edges, which are document edges: the same documents, the
    # same attention pairs, the same FLOPs.
    assert flops == pytest.approx(want_flops, rel=1e-9) and want_flops > 0
