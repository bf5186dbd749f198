"""`accelerate launch` starts the same run as torchrun, and every setting it passes is either
honoured or refused in one line (te_mixtral/accelerate_launch.py).

One real launch through accelerate's command line: two processes, bf16 and gradient
accumulation (and one it refuses; both started with the session, in the background). The other cases read the environment accelerate's own launcher code makes for
a command line (`accelerate_env`), in-process: each refusal comes before anything is built.
"""

import json
import os
import sys

import pytest
import yaml
from background import Command
from conftest import REPO
from launch import RUN_DIR, run_cli

from te_mixtral.accelerate_launch import launch_settings
from te_mixtral.config import load_config
from te_mixtral.errors import ExitCode, UserError

TINY = str(REPO / "configs" / "tiny.yaml")


def accelerate_launch(launch_args: list[str], app_args: list[str], **env) -> Command:
    # `accelerate launch`, run by this interpreter (the `accelerate` script may be another's).
    return Command((sys.executable, "-m", "accelerate.commands.launch", *launch_args, "run_finetune_ep.py", *app_args),
                   (("OMP_NUM_THREADS", "1"), *env.items()), timeout=300)


# --multi_gpu is torchrun underneath, and on a CPU machine starts CPU processes (gloo).
# Accumulation reaches a script through the environment only (DeepSpeed's launcher sets it).
TWO_PROCESSES = accelerate_launch(
    ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port", "0",
     "--mixed_precision", "bf16", "--dynamo_backend", "no"],
    ["--ep-size", "2", "--steps", "2", "--seq_len", "32", "--batch_size", "4", "--output-dir", RUN_DIR],
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS="2")
BAD_SETTING = accelerate_launch(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port",
                                 "0", "--mixed_precision", "no", "--dynamo_backend", "no"], ["--ep-size", "4"])
# Run from the session's start (conftest.py's planned_command); the two-process run for its slow
# test only: the default run launches through accelerate in the README's commands already.
PLANNED_COMMANDS = [pytest.param(TWO_PROCESSES, marks=pytest.mark.slow), BAD_SETTING]


def accelerate_env(*flags: str) -> dict[str, str]:
    """What `accelerate launch FLAGS run_finetune_ep.py` adds to the environment of the process
    it starts, as accelerate's own code makes it. Its simple launcher: the one for `--cpu` or
    one process, which sets the same ACCELERATE_* variables as the torchrun one (`--multi_gpu`)
    and ACCELERATE_USE_CPU besides."""
    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args([*flags, "--num_machines", "1", "run_finetune_ep.py"])
    _, env = prepare_simple_launcher_cmd_env(_validate_launch_command(args)[0])
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


@pytest.mark.slow
def test_two_processes_with_accelerates_precision_and_accumulation(planned_command):
    proc, folder = planned_command(TWO_PROCESSES)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if line.startswith("te_mixtral: from accelerate launch")]
    assert len(notes) == 1, proc.stdout  # rank 0 says what accelerate set, once
    assert "train.dtype bf16 (accelerate launch --mixed_precision bf16)" in notes[0]
    results = json.loads((folder / "results.json").read_text())
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    assert (results["header"]["world_size"], results["header"]["precision"]) == (2, "bf16")
    assert (saved["train"]["dtype"], saved["train"]["grad_accum_steps"], saved["ep_size"]) == ("bf16", 2, 2)
    assert len(results["losses"]) == 2


def test_a_bad_setting_under_accelerate_launch_is_one_line_per_job(planned_command):
    proc, _ = planned_command(BAD_SETTING)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("te_mixtral: error:")]
    assert lines == ["te_mixtral: error: world size (2) is not divisible by ep_size (4): launch 4 processes (or a "
                     "multiple), or give an --ep-size that divides 2 [exit code 2]"], proc.stderr


@pytest.mark.parametrize("flags, key, value", [
    (["--mixed_precision", "bf16"], "train.dtype", "bf16"),
    (["--mixed_precision", "no"], "train.dtype", "fp32"),  # accelerate's "no": no autocast
    ([], "train.dtype", "fp32"),  # "no" is accelerate's default too
    (["--cpu", "--mixed_precision", "bf16"], "device", "cpu"),
])
def test_each_honoured_launch_option_sets_its_key(flags, key, value):
    settings = launch_settings(accelerate_env(*flags))
    assert settings[key][0] == value
    cfg = load_config(TINY, launch=settings)
    section, _, name = key.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, name) == value


def test_accumulation_from_the_environment_sets_grad_accum_steps():
    # Accelerate passes it to scripts under DeepSpeed only; `Accelerator` reads it from the
    # environment wherever it is set, so this does too.
    env = {**accelerate_env(), "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}
    cfg = load_config(TINY, {"batch_size": "8"}, launch=launch_settings(env))
    assert cfg.train.grad_accum_steps == 4
    assert "train.grad_accum_steps" not in launch_settings({**env, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "auto"})


def test_outside_accelerate_nothing_is_set():
    assert launch_settings({"PATH": "/usr/bin", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}) == {}


@pytest.mark.parametrize("flags, fragment", [
    (["--mixed_precision", "fp16"], "ACCELERATE_MIXED_PRECISION=fp16 is not supported"),
    (["--dynamo_backend", "inductor"], "ACCELERATE_DYNAMO_BACKEND=INDUCTOR is not supported: torch.compile"),
    (["--debug"], "ACCELERATE_DEBUG_MODE=true is not supported: te_mixtral does not read it"),
    (["--enable_cpu_affinity"], "ACCELERATE_CPU_AFFINITY=1 is not supported"),
    # accelerate's --cpu launcher starts one process (more only through MPI): alone, it
    # would train as if one process had been asked for.
    (["--cpu", "--num_processes", "2"], "started one process where more were asked for"),
])
def test_every_other_launch_option_is_refused_in_one_line(flags, fragment):
    with pytest.raises(UserError) as raised:
        launch_settings(accelerate_env(*flags))
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("env, fragment", [
    # Set by launchers (FSDP's, DeepSpeed's) or options (fp8) that need more than this machine has.
    ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "--tier device_mxfp8"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "use --sharding fsdp"),
    # DeepSpeed's launcher sets its fields too; the refusal names DeepSpeed, not a field.
    ({"ACCELERATE_CONFIG_DS_FIELDS": "zero_stage", "ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed is not supported"),
    ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "0"}, "a whole number above 0"),
])
def test_settings_of_other_launchers_are_refused_in_one_line(env, fragment):
    with pytest.raises(UserError) as raised:
        launch_settings(env)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_fp8_is_refused_for_what_it_is_not_for_a_detail_of_it():
    # accelerate sets its fp8 recipe's details (ACCELERATE_FP8_*) with --mixed_precision fp8:
    # before, the refusal named the first of them ("ACCELERATE_FP8_AMAX_COMPUTE_ALGO=most_recent
    # ... does not read it"), not the setting asked for and what to use instead.
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import setup_fp8_env

    args = launch_command_parser().parse_args(["--mixed_precision", "fp8", "run_finetune_ep.py"])
    env = setup_fp8_env(args, {"ACCELERATE_MIXED_PRECISION": "fp8"})
    assert any(variable.startswith("ACCELERATE_FP8_") for variable in env)
    with pytest.raises(UserError, match="ACCELERATE_MIXED_PRECISION=fp8 is not supported: .*--tier device_mxfp8"):
        launch_settings(env)


@pytest.mark.parametrize("overrides, flags, fragment", [
    ({"dtype": "fp32"}, ["--mixed_precision", "bf16"],
     "accelerate launch --mixed_precision bf16 asks for train.dtype bf16, but the config or command line sets "
     "train.dtype fp32"),
    ({"dtype": "bf16"}, [], "--mixed_precision no asks for train.dtype fp32"),  # accelerate's default
    ({"device": "cuda"}, ["--cpu"], "accelerate launch --cpu asks for device cpu"),
])
def test_a_setting_the_config_also_sets_otherwise_is_refused(overrides, flags, fragment):
    settings = launch_settings(accelerate_env(*flags))
    with pytest.raises(UserError, match="drop one of the two") as raised:
        load_config(TINY, overrides, launch=settings)
    assert fragment in str(raised.value)


def test_the_same_value_or_auto_in_the_config_agrees():
    settings = launch_settings(accelerate_env("--mixed_precision", "bf16"))
    assert load_config(TINY, {"dtype": "bf16"}, launch=settings).train.dtype == "bf16"
    assert load_config(TINY, {"dtype": "auto"}, launch=settings).train.dtype == "bf16"


def test_the_entry_point_refuses_before_building_anything(monkeypatch):
    for variable, value in accelerate_env("--cpu", "--num_processes", "2").items():
        monkeypatch.setitem(os.environ, variable, value)
    # Nothing heavy is imported before the refusal: the training loop's module stays unloaded.
    monkeypatch.delitem(sys.modules, "te_mixtral.training.loop", raising=False)
    proc = run_cli(["--steps", "2"])  # in this process, its environment put back after
    assert proc.returncode == ExitCode.BAD_INPUT
    assert proc.stderr.count("\n") == 1 and "accelerate launch --multi_gpu --num_processes N" in proc.stderr
    assert "te_mixtral.training.loop" not in sys.modules
