"""Expert parallelism computes the same gradients as one process, parameter by parameter.

Equal losses and equal weights after a few steps are not enough: AdamW divides each update
by the root of the gradient's second moment, so expert gradients scaled by a constant (say
divided by the EP size, the classic averaging bug) train almost the same weights, and such a
bug passes a loss check. Here one step of the real loop (tests/workers/train_and_save.py)
runs on the same global batch at EP=1 and in an expert-parallel layout, and every rank's
gradients are compared with the single process's, shard by shard, twice: after the
gradient reduction and after the global-norm clipping (a small `grad_clip`, so it scales).

Odd sizes on purpose: 6 experts top-3 at EP=2 and EP=3 (3 ranks), and 4 experts at
EP=2 x DP=2 (4 ranks: experts replicated over two EP groups). EP=2 also runs with its
exchanges overlapped in three chunks of tokens (`--ep_chunks 3`), and padded to a capacity
too small for step 1 (`--ep_capacity 0.5`, so the step runs again), whose gradients must be
the plain path's. A rank of an EP group of size
EP holds experts ep_rank*L .. (ep_rank+1)*L - 1, L = E / EP (distributed/layout.py).
"""

import launch
import pytest
import torch

from te_mixtral.distributed.layout import is_expert_param

GRAD_CLIP = 0.05  # below the gradient norm of the first step, so clipping scales every gradient
COMMON = ["--steps", "1", "--timing_warmup_steps", "0", "--batch_size", "12", "--seq_len", "64",
          "--grad_clip", str(GRAD_CLIP)]
SIX_TOP3 = ["--model.num_experts", "6", "--model.num_experts_per_tok", "3"]
FOUR_TOP2 = ["--model.num_experts", "4", "--model.num_experts_per_tok", "2"]
OVERLAPPED = ["--ep_chunks", "3"]
# Padded exchanges with room for half the even share: step 1 always outgrows it (a rank's
# largest share is at least its mean), drops rows, and must run again with room enough.
PADDED = ["--tier", "custom_grouped", "--ep_capacity", "0.5"]
EXCHANGES = (OVERLAPPED, PADDED)  # ways of exchanging that must change no gradient
LAYOUTS = [(SIX_TOP3, 2, 2), (SIX_TOP3, 3, 3), (FOUR_TOP2, 4, 2), (SIX_TOP3 + OVERLAPPED, 2, 2),
           (SIX_TOP3 + PADDED, 2, 2)]  # (model, nproc, ep)


def run_args(model_args: list[str], ep: int) -> list[str]:
    return [*COMMON, *model_args, "--ep-size", str(ep)]


# The default run keeps the two-rank layouts; EP=3 and EP=2 x DP=2 (and the one-process run of
# the latter's model), each a launch of its own, are for the slow tests.
SLOW_LAYOUTS = LAYOUTS[1:3]
# Launched with the other modules' runs of the same rank count (conftest.py's launch_planned).
PLANNED_RUNS = {1: [run_args(SIX_TOP3, 1), pytest.param(run_args(FOUR_TOP2, 1), marks=pytest.mark.slow)]}
for _model, _nproc, _ep in LAYOUTS:
    _args = run_args(_model, _ep)
    PLANNED_RUNS.setdefault(_nproc, []).append(
        pytest.param(_args, marks=pytest.mark.slow) if (_model, _nproc, _ep) in SLOW_LAYOUTS else _args)


@pytest.fixture(scope="module")
def gradients(tmp_path_factory, launch_planned):
    """`gradients(model_args, nproc, ep)`: per rank, (reduced, clipped) gradients of step 1;
    `gradients.summaries[(model_args, nproc, ep)]`: the run's throughput summary."""
    runs = {}

    def run(model_args: list[str], nproc: int, ep: int):
        key = (tuple(model_args), nproc, ep)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"w{nproc}-ep{ep}")
            launch_planned(nproc)
            results, _, reduced = launch.train_and_save(out, run_args(model_args, ep), nproc)
            run.summaries[key] = results["summary"]
            run.results[key] = results
            clipped = [torch.load(out / "weights" / f"clipped{r}.pt") for r in range(nproc)]
            # One reduction a step, and one more for a step run again; the last is applied.
            calls = 1 + len(results.get("ep_capacity", {}).get("steps_run_again", []))
            assert [len(g) for g in reduced] == [len(g) for g in clipped] == [calls] * nproc
            runs[key] = [(r[-1], c[-1]) for r, c in zip(reduced, clipped)]
        return runs[key]

    run.summaries, run.results = {}, {}
    return run


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within 1e-5 of the tensor's own scale: rounding of sums taken in another order passes,
    any rescaling or missing contribution does not."""
    assert got.shape == want.shape, what
    scale = want.abs().max().item()
    assert scale > 0, f"{what}: no gradient at EP=1, so the comparison would prove nothing"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=what)


def assert_same_gradients(gradients, model_args: list[str], nproc: int, ep: int) -> None:
    # One process exchanges nothing: its reference is the same model's plain run.
    single = next((model_args[:-len(way)] for way in EXCHANGES if model_args[-len(way):] == way), model_args)
    (want_reduced, want_clipped), = gradients(single, 1, 1)
    # The clipping must really scale, or the clipped comparison repeats the reduced one.
    norm = torch.stack([g.norm() for g in want_reduced.values()]).norm().item()
    assert norm > 2 * GRAD_CLIP, norm
    per_rank = gradients(model_args, nproc, ep)
    for rank, stages in enumerate(per_rank):
        ep_rank = rank % ep
        for stage, got, want in zip(("reduced", "clipped"), stages, (want_reduced, want_clipped)):
            assert got.keys() == want.keys()
            for name, full in want.items():
                shard = full.chunk(ep)[ep_rank] if is_expert_param(name) else full
                assert_close_relative(got[name], shard, f"rank {rank}, {stage}: {name}")


def test_six_experts_top3_ep2(gradients):
    assert_same_gradients(gradients, SIX_TOP3, nproc=2, ep=2)


@pytest.mark.slow
def test_six_experts_top3_ep3(gradients):
    assert_same_gradients(gradients, SIX_TOP3, nproc=3, ep=3)


@pytest.mark.slow
def test_four_experts_ep2_dp2(gradients):
    assert_same_gradients(gradients, FOUR_TOP2, nproc=4, ep=2)


def test_overlapped_exchanges_ep2(gradients):
    assert_same_gradients(gradients, SIX_TOP3 + OVERLAPPED, nproc=2, ep=2)


def test_padded_exchanges_ep2_run_a_short_step_again(gradients):
    """No host sync for split sizes: every exchange padded, step 1's too small, so run again;
    the applied gradients are the single process's all the same."""
    assert_same_gradients(gradients, SIX_TOP3 + PADDED, nproc=2, ep=2)
    capacity = gradients.results[(tuple(SIX_TOP3 + PADDED), 2, 2)]["ep_capacity"]
    assert capacity["steps_run_again"] == [1] and capacity["final"] > 1, capacity


@pytest.mark.parametrize("model_args,nproc,ep", [
    pytest.param(*layout, marks=pytest.mark.slow if layout in SLOW_LAYOUTS else ()) for layout in LAYOUTS[:3]],
    ids=["ep2", "ep3", "ep2xdp2"])
def test_summary_counts_the_whole_global_step(gradients, model_args, nproc, ep):
    """tokens/s and TFLOP/s per GPU, times the step time they were computed with, give back
    the global step's tokens and the single process's model FLOPs: the same work is counted
    whatever the layout (timings differ, the counts may not)."""
    gradients(model_args, 1, 1)
    gradients(model_args, nproc, ep)
    one, many = (gradients.summaries[(tuple(model_args), n, e)] for n, e in ((1, 1), (nproc, ep)))

    def counts(summary, world):
        step_s = summary["median_step_ms"] / 1e3
        return (summary["tokens_per_s"] * step_s, summary["tokens_per_s_per_gpu"] * world * step_s,
                summary["tflops_per_gpu"] * 1e12 * world * step_s)

    tokens, tokens_from_per_gpu, flops = counts(many, nproc)
    want_tokens, _, want_flops = counts(one, 1)
    assert want_tokens == pytest.approx(12 * 64, rel=1e-9) and want_flops > 0
    assert tokens == pytest.approx(want_tokens, rel=1e-9)
    assert tokens_from_per_gpu == pytest.approx(want_tokens, rel=1e-9)
    assert flops == pytest.approx(want_flops, rel=1e-9)
