"""Bad input: one clear line, a non-zero exit, on every rank, no traceback, no hang."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from background import Command
from conftest import REPO
from launch import RUN_DIR, app_command, assert_one_line_error, run_cli
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from te_mixtral.errors import ExitCode
from te_mixtral.training.same_job import first_difference


@pytest.mark.parametrize("args, fragment", [
    (["--no_such_key", "1"], "unknown config key 'no_such_key'"),
    (["--train.steps", "many"], "'train.steps' must be int"),
    (["--ep-size", "3"], "ep_size 3 splits each layer's experts over 3 processes, and this is one: launch 3 (or a "
                         "multiple) with torchrun"),
    (["--stpes", "3"], "unknown config key 'stpes' (did you mean --steps?)"),
    (["--lora_rank", "4"], "unknown config key 'lora_rank' (did you mean --lora.rank?)"),
    (["--save-adapter", ""], "save_adapter is an empty path"),
    (["--batch_size", "6", "--grad_accum_steps", "4"],
     "train.batch_size (6) is not divisible by the world size (1) x train.grad_accum_steps (4)"),
    (["--grad_accum_steps", "0"], "train.grad_accum_steps must be at least 1, got 0"),
    (["--seq_len", "4096"], "exceeds model.max_position_embeddings"),
    (["--tier", "fastest"], "unknown tier 'fastest'"),
    # A choice mistyped names the one meant, as a mistyped key does: before, only the list.
    (["--tier", "custom_groupd"], "unknown tier 'custom_groupd' (did you mean custom_grouped?); tiers: hf, "),
    (["--tier", "grouped-linear"], "unknown tier 'grouped-linear' (did you mean grouped_linear?); tiers: "),
    (["--recompute", "ful"], "train.recompute must be one of none, selective, full, got 'ful' (did you mean full?)"),
    (["--tier", "device_mxfp8", "--fp8.mode", "fp8_hopper"], "got 'fp8_hopper' (did you mean fp8-hopper?)"),
    (["--report-to", "tensorbord"], "got 'tensorbord' (did you mean tensorboard?)"),
    (["--lora.rank", "4", "--lora.targets", "q_proj,gate_proj"],
     "unknown projection 'gate_proj' (did you mean gate_up_proj?); known: q_proj, "),
    (["--estimate-memory", "1", "--gpu", "h20"], "or a size such as 80GiB or 141GB, got 'h20' (did you mean h200?)"),
    (["--tier", "hf", "--hidden_size", "70"],
     "model.hidden_size 70 not a multiple of 4 (4-byte parameters); use --tier hf_eager"),
    (["--tier", "hf", "--intermediate_size", "98", "--optimizer", "master_adamw", "--dtype", "bf16"],
     "model.intermediate_size 98 not a multiple of 8 (2-byte parameters); use --tier hf_eager"),
    (["--config", "configs/missing.yaml"], "cannot read config"),
    # A config's name mistyped, or given without its folder: the file meant is named, as a key's is.
    (["--config", "configs/tiny.yml"], "cannot read config configs/tiny.yml: No such file or directory (did you "
                                       "mean configs/tiny.yaml?)"),
    (["--config", "tiny-chat.yaml"], "(did you mean configs/tiny-chat.yaml?)"),
    (["--loss-check", "no/such/results.json"], "does not exist"),
    (["--moment_dtype", "fp32"], "train.moment_dtype is master_adamw's choice"),
    (["--checkpoint-dir", "README.md"], "checkpoint_dir README.md is a file, not a folder"),
    # A key that would change nothing in this run: before, each trained a step and exited 0.
    (["--steps", "1", "--lora.alpha", "32"], "lora.alpha applies to LoRA adapters: set lora.rank (LoRA is off)"),
    (["--steps", "1", "--generate-tokens", "10"], "generate_tokens is the length of generate's continuation"),
])
def test_bad_input_is_one_line(args, fragment, tmp_path):
    proc = run_cli([*args, "--output-dir", str(tmp_path)])
    assert proc.returncode == ExitCode.BAD_INPUT
    assert_one_line_error(proc, fragment)


@pytest.mark.parametrize("args, fragment", [
    # Before, a world past what torch.distributed can number was taken, and refused for train.batch_size.
    (["--estimate-memory", "1" + "0" * 20], f"--estimate-memory {'1' + '0' * 20}: more ranks than torch.distributed"),
    (["--estimate-memory", str(2**31)], "more ranks than torch.distributed can number (at most 2147483647"),
    *[(["--estimate-memory", ranks], f"--estimate-memory takes a number of ranks (1 or more), got {ranks}")
      for ranks in ("0", "-4", "nan", "inf", "1e3")],
    # Before, digits past a float's range made an infinite size: a traceback (OverflowError).
    (["--estimate-memory", "1", "--gpu", "9" * 400 + "GiB"], "--gpu 999"),
    (["--estimate-memory", "1", "--gpu", "99999999TiB"], "more memory than one device can address"),
    *[(["--estimate-memory", "1", "--gpu", size], f"--gpu must name a GPU (h100, h200, b200, a100-80gb, l40s, "
       f"rtx4090) or a size such as 80GiB or 141GB, got '{size}'") for size in ("nanGiB", "infGiB", "0GiB", "-8GiB")],
    # The estimate's sizes of the model and the batch, as every run's.
    *[(["--estimate-memory", "1", flag, value], fragment) for flag in ("--model.num_hidden_layers", "--batch_size")
      for value, fragment in (("0", "must be positive, got 0"), ("-2", "must be positive, got -2"),
                              (".nan", "must be int, got nan"), (".inf", "must be int, got inf"))],
])
def test_an_impossible_number_for_the_memory_estimate_is_one_line_naming_it(args, fragment):
    proc = run_cli(args)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-2000:]
    assert_one_line_error(proc, fragment)
    assert "memory per rank" not in proc.stdout  # no table


@pytest.mark.parametrize("args", [["--no_such_key", "1"], ["--train.steps", "many"], ["--ep-size", "3"]])
def test_a_bad_flag_is_refused_before_torch_is_imported(args):
    # Importing torch takes seconds; a typo should not wait for it. -X importtime lists every
    # module the entry script imported, on stderr.
    proc = subprocess.run([sys.executable, "-X", "importtime", "run_finetune_ep.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "te_mixtral.config" in imported and "torch" not in imported


@pytest.mark.parametrize("args, fragment", [
    (["--tier", "grouped_linear"], "tier 'grouped_linear' needs NVIDIA Transformer Engine on a CUDA GPU"),
    (["--backend", "te"], "backend 'te' needs a CUDA device"),
    (["--dataset", "no/such/chats.jsonl"], "data set path no/such/chats.jsonl does not exist"),
])
def test_what_this_machine_cannot_run_or_read_is_the_one_line_it_prints(args, fragment, tmp_path):
    # CI machines have no CUDA: the TE tier must refuse, not quietly run something else. (The
    # entry script's own exit code is proven by the launches above and the torchrun one below.)
    # Before, the memory estimate's line came first, and the data was read before the tier refused.
    proc = run_cli([*args, "--output-dir", str(tmp_path)])
    assert proc.returncode == ExitCode.BAD_INPUT
    assert_one_line_error(proc, fragment)
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stdout + proc.stderr


def our_torchrun(*args: str) -> Command:
    return Command((sys.executable, "-m", "te_mixtral.torchrun", *args), (("OMP_NUM_THREADS", "1"),), timeout=120)


# A data set that is not there: each rank finds it as it starts (the launcher checks the config alone).
BAD_SETTING = our_torchrun("--standalone", "--nproc_per_node=2", str(REPO / "run_finetune_ep.py"), "--ep-size", "2",
                           "--dataset", "no/such/chats.jsonl")
REFUSED = {our_torchrun("--no_such_option", "run_finetune_ep.py"): "unrecognized arguments: --no_such_option",
           our_torchrun("--nproc_per_node=many", "run_finetune_ep.py"): "Unsupported nproc_per_node value: many",
           our_torchrun("--standalone", "--nproc_per_node=0", "run_finetune_ep.py"): "torchrun refused its arguments"}
# Rank 1 reads another learning rate, as a second machine with another copy of the config would.
ONE_RANK_DIFFERS = our_torchrun("--standalone", "--nproc_per_node=2", str(REPO / "tests/workers/one_rank_differs.py"),
                                "--ep-size", "2", "--steps", "2", "--seq_len", "32", "--output-dir", RUN_DIR,
                                "--rank1", "--lr", "0.05")
PLANNED_COMMANDS = [BAD_SETTING, *REFUSED, ONE_RANK_DIFFERS]  # run from the session's start (conftest.py's planned_command)


def test_a_bad_setting_is_one_line_per_job_and_our_torchrun_passes_the_exit_code_on(planned_command):
    # torchrun itself would exit 1, as for any failure; `python -m te_mixtral.torchrun` is torchrun
    # exiting with the ranks' code, and saying nothing of its own.
    proc, _ = planned_command(BAD_SETTING)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-2000:]
    lines = assert_one_line_error(proc, "data set path no/such/chats.jsonl does not exist")
    assert proc.stderr.splitlines() == lines and len(lines) == 1, proc.stderr[-3000:]  # rank 0's, and nothing else
    assert lines[0].endswith("[exit code 2]")


def test_our_torchrun_refuses_a_bad_config_before_it_launches_anything(monkeypatch, capsys):
    # Before, the ranks found it, and with --max-restarts 2 torchrun started them twice again:
    # the same line three times. world 2 is not divisible by EP=4 (4 experts / EP 4 is fine).
    import te_mixtral.torchrun as torchrun

    launched = []
    monkeypatch.setattr(torchrun, "run", launched.append)
    assert torchrun.main(["--standalone", "--nproc_per_node=2", "--max-restarts", "2", str(REPO / "run_finetune_ep.py"),
                          "--ep-size", "4"]) == ExitCode.BAD_INPUT
    # The launcher exits with the code itself: no "[exit code 2]", which a rank's line adds.
    assert capsys.readouterr().err == ("te_mixtral: error: world size (2) is not divisible by ep_size (4): launch 4 processes (or a "
                                           "multiple), or give an --ep-size that divides 2\n")
    assert not launched
    # What the config alone cannot tell goes to the ranks: a script not ours, a world size not known yet.
    for args in (["--nproc_per_node=2", "--no-python", "true", "--ep-size", "4"],
                 ["--standalone", "--nproc_per_node=2", str(REPO / "tests/workers/one_rank_differs.py"), "--ep-size", "4"],
                 ["--nnodes", "1:2", "--rdzv-endpoint", "localhost:0", "--nproc_per_node=2",
                  str(REPO / "run_finetune_ep.py"), "--ep-size", "4"]):
        launched.clear()
        assert torchrun.main(args) == 0 and len(launched) == 1, capsys.readouterr().err


def test_our_torchrun_refuses_its_own_bad_arguments_in_one_line(planned_command):
    for command, fragment in REFUSED.items():
        proc, _ = planned_command(command)
        assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-2000:]
        assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("te_mixtral.torchrun: error: ")
        assert fragment in proc.stderr


@pytest.mark.parametrize("args, fragment", [
    # Before: torchrun waited for a second machine that could never join (--standalone's rendezvous is on
    # localhost, at a port of its own choosing), up to its 600 s join timeout.
    (["--standalone", "--nnodes", "2"], "--standalone runs on this machine alone, and --nnodes 2 asks for up to 2"),
    (["--standalone", "--nnodes", "1:2"], "--nnodes 1:2 asks for up to 2"),
    # Before: ignored (torchrun's warning that says so is among the agent's log we silence): a one-node job ran.
    (["--standalone", "--node-rank", "1"], "--node-rank 1 is read by the static rendezvous alone"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--node-rank", "1"], "by the static rendezvous alone"),
    # Before: the static rendezvous waited for ever for machine 3 of 1 (--nnodes 1 and a port: torchrun keeps it static).
    (["--nnodes", "1", "--node-rank", "3", "--master-port", "29612"], "--node-rank 3 is not one of --nnodes 1's (0 to 0)"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "localhost", "--master-port", "29613"], "(0 to 1)"),
], ids=["standalone-2-nodes", "standalone-1-to-2-nodes", "standalone-node-rank", "c10d-node-rank",
        "static-rank-3-of-1", "static-rank-2-of-2"])
def test_our_torchrun_refuses_machine_counts_and_ranks_that_contradict_each_other(args, fragment, capsys):
    # In this process: each is refused before anything is launched.
    from te_mixtral.torchrun import main

    assert main([*args, "--nproc_per_node=1", "--no-python", "true"]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("te_mixtral.torchrun: error: ") and fragment in err, err


def test_ranks_that_would_run_different_jobs_are_refused_before_the_first_step(planned_command):
    # Before, rank 1 trained at another learning rate than rank 0, and the job exited 0.
    proc, out = planned_command(ONE_RANK_DIFFERS)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-2000:]
    lines = assert_one_line_error(proc, "the ranks would run different jobs", "train.lr is 0.003 on rank 0 and 0.05 "
                                  "on rank 1", "the same config")
    assert proc.stderr.splitlines() == lines and len(lines) == 1, proc.stderr[-3000:]
    assert not (out / "results.json").exists()


def test_the_ranks_first_difference_is_named_whatever_it_is_in():
    same = {"train.dtype": "auto", "the tokenizer's SHA-256": "ab", "model.rope_theta": math.nan}
    assert first_difference([same, dict(same), dict(same)]) is None
    assert (first_difference([same, dict(same), {**same, "the tokenizer's SHA-256": "cd"}])
            == "the tokenizer's SHA-256 is ab on rank 0 and cd on rank 2")
    assert first_difference([same, {**same, "train.dtype": "bf16"}]) == "train.dtype is auto on rank 0 and bf16 on rank 1"


def hub_cache(folder, commit: str) -> None:
    """A Hugging Face hub cache, laid out as huggingface_hub keeps one, holding owner/tiny at
    `commit`: a tiny Mixtral's config.json and a tokenizer.json (what a run reads before the
    ranks compare their jobs)."""
    import shutil

    from transformers import MixtralConfig

    repo = folder / "models--owner--tiny"
    (repo / "snapshots" / commit).mkdir(parents=True)
    MixtralConfig(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4,
                  max_position_embeddings=1024).to_json_file(repo / "snapshots" / commit / "config.json")
    shutil.copy(REPO / "examples" / "chat-tokenizer" / "tokenizer.json", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


@pytest.mark.parametrize("revisions, tokenizer, difference", [
    # Two nodes whose HF_HOME differ, each holding the same revision: before, refused for the
    # tokenizer's path ("data.tokenizer is .../a/... on rank 0 and .../b/... on rank 1").
    (("1" * 40, "1" * 40), None, None),
    # Another revision on rank 1, the tokenizer given: before, trained on, each rank's replicated
    # weights its own cache's (checked with two such caches under torchrun).
    (("1" * 40, "2" * 40), "examples/chat-tokenizer",
     f"the --model checkpoint's hub revision is {'1' * 40} on rank 0 and {'2' * 40} on rank 1"),
])
def test_ranks_compare_a_hub_checkpoint_by_its_revision_not_by_their_caches_path(tmp_path, monkeypatch, revisions,
                                                                                 tokenizer, difference):
    import huggingface_hub.constants

    from te_mixtral.config import load_config
    from te_mixtral.model.hf_config import resolve_model_path
    from te_mixtral.training.hf_checkpoint import adopt_checkpoint
    from te_mixtral.training.same_job import settings_summary

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    overrides = {"model_path": "owner/tiny", **({"tokenizer": str(REPO / tokenizer)} if tokenizer else {})}
    summaries = []
    for rank, revision in enumerate(revisions):  # each rank's HF_HOME, as a rank of its node reads it
        hub_cache(tmp_path / f"rank{rank}", revision)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / f"rank{rank}"))
        model_dir = resolve_model_path("owner/tiny")
        summaries.append(settings_summary(adopt_checkpoint(load_config(None, overrides), model_dir, 1), model_dir))
    assert first_difference(summaries) == difference


def test_hf_tier_is_single_process(monkeypatch):
    # The refusal needs only torchrun's word on the world size, read before anything starts:
    # rank 0 of two, in this process (every rank failing alike is proven above).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert_one_line_error(run_cli(["--tier", "hf"]), "single process")


@pytest.mark.parametrize("option", [["--profile_phases", "true"], ["--loss-check", "REFERENCE"]],
                         ids=["profile_phases", "loss_check"])
def test_a_diverged_run_with_a_report_option_still_stops_in_one_line(tmp_path, option):
    """The phase profile and the loss check report a finished run: a run that diverged has
    neither, and says why it stopped in one line (no traceback from the report)."""
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"losses": [5.0] * 4}))
    option = [str(reference) if arg == "REFERENCE" else arg for arg in option]
    proc = run_cli(["--steps", "4", "--lr", "1e6", "--grad_clip", "1e9", "--output-dir", str(tmp_path / "out"),
                    *option])
    assert proc.returncode == ExitCode.DIVERGED
    assert_one_line_error(proc, "the gradient norm")


def test_diverging_loss_stops_with_the_step(tmp_path):
    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    proc = run_cli(["--steps", "6", "--lr", "1e6", "--grad_clip", "1e9", "--output-dir", str(tmp_path / "out"),
                    "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--save-hf", str(export),
                    "--save-every", "1"])
    assert proc.returncode == ExitCode.DIVERGED
    line = assert_one_line_error(proc, "the gradient norm", "stopped without applying that step")[0]
    step = int(re.search(r"at step (\d+)", line)[1])
    # The diverged run keeps its losses and gradient norms, the last one not finite...
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(results["losses"]) == len(results["grad_norms"]) == step and results["stopped"] in line
    assert results["exit_code"] == ExitCode.DIVERGED
    assert all(math.isfinite(x) for x in results["grad_norms"][:-1]) and not math.isfinite(results["grad_norms"][-1])
    # ... and every save holds the finite weights from before the step that was not applied.
    assert (ckpt / "latest").read_text().strip() == f"step-{step - 1:06d}"
    dcp_to_torch_save(ckpt / f"step-{step - 1:06d}", tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for name, w in saved.items() if name.startswith("model."))
    assert all(torch.isfinite(w).all() for f in export.glob("*.safetensors") for w in load_file(f).values())


def test_an_export_whose_merged_weights_overflow_is_refused(tmp_path):
    # At lr 1e30 one step makes the adapters about 1e30: finite, but B @ A overflows, so the
    # weights the export would write (base + B @ A) are infinite though no parameter is.
    export = tmp_path / "export"
    proc = run_cli(["--steps", "3", "--lr", "1e30", "--lora.rank", "2", "--seq_len", "32", "--timing_warmup_steps",
                    "0", "--output-dir", str(tmp_path / "out"), "--save-hf", str(export), "--save-every", "1"])
    assert proc.returncode == ExitCode.DIVERGED
    assert_one_line_error(proc, "after step 1", f"the Hugging Face export {export}", "not finite")
    assert not list(export.glob("*.safetensors")) and not export.with_name("export.tmp").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--generate", ""], "the generate prompt is blank"),
    (["--tier", "device_mxfp8", "--fp8.mode", "mxfp8-emulated", "--hidden_size", "48", "--head_dim", "24"],
     "needs model.hidden_size to be a multiple of 32, got 48"),
    (["--loss-check", "EMPTY"], "has no losses to compare with"),
    (["--generate", "Once", "--generate-tokens", "5000"], "would pass model.max_position_embeddings (1024)"),
    # Not the emulation, which LoRA refuses too.
    (["--tier", "device_mxfp8", "--lora.rank", "4"], "or with LoRA (a frozen FP8 base needs a Hopper GPU) another tier, "
                                                     "e.g. --tier custom_grouped"),
])
def test_what_would_fail_after_training_is_refused_before_it(args, fragment, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"losses": []}))
    proc = run_cli([*[str(empty) if a == "EMPTY" else a for a in args], "--steps", "2", "--timing_warmup_steps", "1",
                    "--log_every", "1", "--output-dir", str(tmp_path / "out")])
    assert proc.returncode == ExitCode.BAD_INPUT
    assert_one_line_error(proc, fragment)
    assert "step    1/2" not in proc.stdout


def test_resuming_with_data_that_trains_another_tokenizer_is_refused(tmp_path):
    args = ["--seq_len", "64", "--timing_warmup_steps", "0", "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = run_cli([*args, "--steps", "1", "--max_documents", "40", "--output-dir", str(tmp_path / "a")])
    assert first.returncode == 0, first.stderr[-2000:]
    proc = run_cli([*args, "--steps", "2", "--max_documents", "30", "--resume", "--output-dir", str(tmp_path / "b")])
    assert_one_line_error(proc, "was trained with a different tokenizer")


def test_resuming_8bit_expert_moments_as_others_is_refused_naming_the_setting(tmp_path):
    args = ["--seq_len", "32", "--timing_warmup_steps", "0", "--dtype", "bf16", "--optimizer", "master_adamw",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = run_cli([*args, "--steps", "1", "--expert_moments", "8bit", "--output-dir", str(tmp_path / "a")])
    assert first.returncode == 0, first.stderr[-2000:]
    proc = run_cli([*args, "--steps", "2", "--resume", "--output-dir", str(tmp_path / "b")])
    assert proc.returncode == ExitCode.BAD_INPUT
    assert_one_line_error(proc, "was written with train.expert_moments 8bit", "resume it with --expert_moments 8bit")


def test_ctrl_c_stops_every_rank_with_one_line_naming_the_last_checkpoint(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO / "run_finetune_ep.py"), "--steps", "500", "--log_every", "1",
                             "--seq_len", "64", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
                             "--output-dir", str(tmp_path / "out")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait for step 3, past the first checkpoint
        if "step    3/500" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INTERRUPTED
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr),
                          "interrupted at step", "the last checkpoint is", "step-00000", "--resume")


def test_ctrl_c_while_starting_is_one_line_and_exit_130():
    proc = subprocess.Popen(app_command(["--steps", "2"]), cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # A Ctrl-C during the interpreter's own start (site, .pth files) is Python's to report; ours
    # begins at the script's first import, so wait until torch's library is being loaded.
    maps = f"/proc/{proc.pid}/maps"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and "libtorch" not in open(maps).read():
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INTERRUPTED
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), "interrupted")


@pytest.mark.parametrize("key, what", [("--dataset", "data file"), ("--config", "config"),
                                       ("--loss-check", "results file"), ("--tokenizer", "tokenizer file")])
def test_an_input_that_is_a_fifo_is_refused_not_waited_on(tmp_path, key, what):
    fifo = tmp_path / "input.jsonl"
    os.mkfifo(fifo)  # opening it for reading waits for a writer, which never comes

    def waited(signum, frame):
        raise TimeoutError(f"{key} {fifo}: still waiting on the FIFO")

    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(60)
    try:
        proc = run_cli([key, str(fifo), "--output-dir", str(tmp_path / "out")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-2000:]
    assert_one_line_error(proc, f"{what} {fifo} is not a regular file but a FIFO (named pipe)")


def test_the_allocator_grows_in_place_unless_the_user_configured_it():
    from te_mixtral.cli import grow_cuda_memory_in_place

    environ = {}
    grow_cuda_memory_in_place(environ)
    assert environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        environ = {name: "max_split_size_mb:512"}
        grow_cuda_memory_in_place(environ)
        assert environ == {name: "max_split_size_mb:512"}


@pytest.mark.slow
def test_ctrl_c_under_torchrun_ends_every_rank_at_once_each_with_its_line(tmp_path):
    # The terminal sends SIGINT to the launcher and every rank. Before, rank 1 waited 10 s
    # (errors.PEER_GRACE_S, meant for errors rank 0 says for all) before its line and its exit.
    proc = subprocess.Popen([sys.executable, "-m", "te_mixtral.torchrun", "--standalone", "--nproc_per_node=2",
                             str(REPO / "run_finetune_ep.py"), "--ep-size", "2", "--steps", "500", "--log_every", "1",
                             "--seq_len", "32", "--output-dir", str(tmp_path)],
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:
        if "step    3/500" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - start < 6, stderr[-2000:]
    assert proc.returncode == ExitCode.INTERRUPTED, stderr[-2000:]
    lines = stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("te_mixtral: error: interrupted at step") for line in lines), lines
