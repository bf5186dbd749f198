"""Resume: a run stopped after N of 2N steps and resumed from its checkpoint trains exactly
like the run that was never stopped (CPU, EP=2 over two gloo ranks), with fp32 parameters and
torch's AdamW, with bf16 parameters whose fp32 master lives in MasterAdamW's remainders, and
with LoRA adapters (dropout on) over a frozen base, and over a frozen NF4 base. Each pair
trains in the session's two-rank launch, the resumed run building everything anew from its
arguments and the checkpoint (launch.STOPPED_AT); and a user's resume, the app started anew
(`python run_finetune_ep.py ... --resume`), continues the fp32 run exactly too, in one process."""

import json
import shutil

import pytest
from conftest import some_slow
from launch import RUN_DIR, STOPPED_AT, run_app, run_cli, train_and_save

from te_mixtral.training.dcp_index import read_index

N = 3
# 60 of the embedded text's 75 documents: 5 % of them held out is three, 14 global batches to
# evaluate at each checkpoint (of all 75, four: 82 batches).
COMMON = ["--ep-size", "2", "--steps", str(2 * N), "--timing_warmup_steps", "1", "--batch_size", "4",
          "--seq_len", "64", "--log_every", "1", "--max_documents", "60", "--eval-fraction", "0.05",
          "--eval-every", str(N), "--checkpoint-every", str(N)]


# LoRA with dropout: the adapters' AdamW state and the dropout RNG must both carry over. Over
# an NF4 base (tier custom_grouped), which the resumed run quantises again from the seed. With a
# padded exchange too short at first (ep_capacity 1), raised by a step run again before the
# checkpoint: the dropout masks are drawn over the padded rows, so the resumed run must pad as
# the run never stopped did.
OPTIMIZERS = {"fp32-adamw": [], "bf16-master-adamw": ["--dtype", "bf16", "--optimizer", "master_adamw"],
              "lora": ["--lora.rank", "4", "--lora.dropout", "0.1"],
              "lora-padded-exchange": ["--tier", "custom_grouped", "--ep_capacity", "1", "--lora.rank", "4",
                                       "--lora.dropout", "0.1"],
              "lora-nf4": ["--tier", "custom_grouped", "--lora.rank", "4", "--lora.base", "nf4"]}


def whole_run(optimizer: str) -> list[str]:
    return [*COMMON, *OPTIMIZERS[optimizer], "--checkpoint-dir", f"{RUN_DIR}/ckpt"]


def stopped_and_resumed(optimizer: str) -> list[str]:
    return [STOPPED_AT, str(N), *COMMON, *OPTIMIZERS[optimizer]]


ONE_PROCESS = ["--ep-size", "1"]
# The default run resumes the fp32 and the LoRA runs (the LoRA one the refusals below need too);
# the others, as the user's own resume in a new process, are for the slow tests (the README's
# commands resume in a new process in every run: tests/test_readme_commands.py).
SLOW_OPTIMIZERS = ("bf16-master-adamw", "lora-nf4")
# Trained with the other modules' runs of the same rank count (conftest.py's launch_planned);
# the one-process run never stopped is test_resume_reshard.py's too.
PLANNED_RUNS = {1: [pytest.param([*whole_run("fp32-adamw"), *ONE_PROCESS], marks=pytest.mark.slow)],
                2: some_slow(map(stopped_and_resumed, OPTIMIZERS), list(map(stopped_and_resumed, SLOW_OPTIMIZERS)))}


def steps_logged(output_dir) -> list[int]:
    """The steps a run's log (steps.jsonl) holds a training step's line for."""
    records = map(json.loads, (output_dir / "steps.jsonl").read_text().splitlines())
    return [r["step"] for r in records if "loss" in r]  # not its evaluations' lines


def assert_resumed_equals_whole(resumed, whole):
    want = json.loads((whole / "results.json").read_text())
    got = json.loads((resumed / "results.json").read_text())
    assert got["losses"] == want["losses"]  # bit for bit: same data, LR, optimizer state, RNG
    assert got["evals"] == want["evals"]
    assert got["summary"]["timed_steps"] == N - 1  # the resumed process warms up again
    # Only the remaining steps ran: the resumed run's log starts after its checkpoint.
    assert steps_logged(resumed) == list(range(N + 1, 2 * N + 1))
    assert (resumed / "ckpt" / "latest").read_text().strip() == "step-000006"


@pytest.mark.parametrize("optimizer", some_slow(OPTIMIZERS, SLOW_OPTIMIZERS))
def test_stop_and_resume_equals_one_run(tmp_path, optimizer, launch_planned):
    launch_planned(2)
    train_and_save(tmp_path, stopped_and_resumed(optimizer), nproc=2)
    whole = tmp_path / "whole"
    assert sorted(p.name for p in (whole / "ckpt").iterdir()) == ["latest", "step-000003", "step-000006"]
    saved = read_index(whole / "ckpt" / "step-000003" / ".metadata").state_dict_metadata
    if optimizer.startswith("lora"):  # what trains, and nothing of the frozen base, which the resume makes again
        assert saved and all(".adapters." in name for name in saved), sorted(saved)[:5]
    else:
        assert "model.model.embed_tokens.weight" in saved
    capacity = [json.loads((run / "results.json").read_text()).get("ep_capacity") for run in (whole, tmp_path)]
    if optimizer == "lora-padded-exchange":  # the case it is there for: the capacity raised before the checkpoint
        assert min(capacity[0]["steps_run_again"]) <= N, capacity
    assert_resumed_equals_whole(tmp_path, whole)
    assert capacity[1] == capacity[0]  # the resumed run went on at the raised capacity, and lists the run's reruns


@pytest.mark.slow
def test_a_users_resume_in_a_new_process_equals_one_run(tmp_path, launch_planned):
    whole = tmp_path / "whole"
    launch_planned(1)
    train_and_save(whole, [*whole_run("fp32-adamw"), *ONE_PROCESS], nproc=1)

    # The state a run killed right after its step-N checkpoint leaves behind.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "ckpt", resumed / "ckpt")
    shutil.rmtree(resumed / "ckpt" / "step-000006")
    (resumed / "ckpt" / "latest").write_text("step-000003\n")
    proc = run_app([*COMMON, *ONE_PROCESS, "--checkpoint-dir", str(resumed / "ckpt"), "--output-dir", str(resumed),
                    "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {resumed / 'ckpt' / 'step-000003'} (step {N} of {2 * N})" in proc.stdout
    assert "step    4/6" in proc.stdout and "step    3/6" not in proc.stdout  # only the remaining steps ran
    assert_resumed_equals_whole(resumed, whole)


def test_lora_resume_needs_the_same_base(tmp_path, launch_planned):
    """A LoRA checkpoint holds the adapters alone; resuming over another base (made from
    another seed, or held in another format) would pair them with weights they were not
    trained on, and is refused."""
    launch_planned(2)
    train_and_save(tmp_path / "lora", stopped_and_resumed("lora"), nproc=2)
    whole = tmp_path / "lora" / "whole"
    # Refused as the checkpoint is read, on any layout: one process (EP 1) shows it in seconds.
    proc = run_cli([*COMMON, *OPTIMIZERS["lora"], "--ep-size", "1", "--seed", "7", "--checkpoint-dir",
                    str(whole / "ckpt"), "--output-dir", str(tmp_path / "other"), "--resume"])
    assert proc.returncode != 0
    assert "holds LoRA adapters trained over the base made from seed 1234, not 7: resume with --seed 1234" in proc.stderr
    # The same base held in another format (NF4 here) is another base too; steps left to train.
    proc = run_cli([*COMMON, *OPTIMIZERS["lora"], "--ep-size", "1", "--tier", "custom_grouped", "--lora.base", "nf4",
                    "--steps", str(2 * N + 1), "--checkpoint-dir", str(whole / "ckpt"), "--output-dir",
                    str(tmp_path / "nf4"), "--resume"])
    assert proc.returncode != 0
    assert ("holds LoRA adapters trained over the base held in lora.base default, not nf4: resume with --lora.base "
            "default") in proc.stderr, proc.stderr[-2000:]
