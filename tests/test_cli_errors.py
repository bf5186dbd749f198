"""Bad input: one clear line, a non-zero exit, on every rank, no traceback, no hang."""

import pytest
from launch import assert_one_line_error, run_app


@pytest.mark.parametrize("args, fragment", [
    (["--no_such_key", "1"], "unknown config key 'no_such_key'"),
    (["--train.steps", "many"], "'train.steps' must be int"),
    (["--ep-size", "3"], "not divisible by ep_size (3)"),
    (["--batch_size", "6", "--grad_accum_steps", "4"],
     "train.batch_size (6) is not divisible by the world size (1) x train.grad_accum_steps (4)"),
    (["--grad_accum_steps", "0"], "train.grad_accum_steps must be at least 1, got 0"),
    (["--seq_len", "4096"], "exceeds model.max_position_embeddings"),
    (["--tier", "fastest"], "unknown tier 'fastest'"),
    (["--config", "configs/missing.yaml"], "cannot read config"),
    (["--loss-check", "no/such/results.json"], "does not exist"),
])
def test_bad_input_is_one_line(args, fragment, tmp_path):
    assert_one_line_error(run_app([*args, "--output-dir", str(tmp_path)]), fragment)


def test_tier_this_machine_cannot_run():
    # CI machines have no CUDA: the TE tier must refuse, not quietly run something else.
    proc = run_app(["--tier", "grouped_linear"])
    assert_one_line_error(proc, "grouped_linear")


@pytest.mark.slow
def test_every_rank_fails_cleanly():
    # world 2 is not divisible by EP=4 ... and 4 experts / EP 4 is fine: only the world check fails.
    proc = run_app(["--ep-size", "4"], nproc=2, timeout=120)
    lines = assert_one_line_error(proc, "world size (2) is not divisible by ep_size (4)")
    assert len(lines) == 2  # one per rank


@pytest.mark.slow
def test_hf_tier_is_single_process():
    proc = run_app(["--tier", "hf"], nproc=2, timeout=120)
    assert_one_line_error(proc, "single process")


def test_diverging_loss_stops_with_the_step(tmp_path):
    proc = run_app(["--steps", "6", "--lr", "1e6", "--grad_clip", "1e9", "--output-dir", str(tmp_path)])
    assert_one_line_error(proc, "the loss became", "at step")
    assert not (tmp_path / "results.json").exists()
