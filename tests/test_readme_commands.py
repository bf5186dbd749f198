"""The README's commands load as valid configs, and the overrides a newcomer tries first
(`--lr 1e-4`, `--steps 3`) just work or say how to fix them: each command line goes through
the entry point's own parsing and validation, in-process.

And every README command a CPU can run, runs as written, on what ships, from a user's folder
of their own (tests/workers/readme_commands.py), in README order: `python run_finetune_ep.py`
lines in this process (`run_cli`), the launchers' lines and the tiny checkpoint they fine-tune
in the background from the session's start. Training commands that do not set `--steps` run
two steps (their evaluation, checkpoint and export still come: each is due after the last
step). What is not run says why in `NOT_RUN`; a new README command must be one or the other.
"""

import json
import re
import shlex
import shutil
import sys

import pytest
import torch
from background import Command
from conftest import REPO
from launch import RUN_DIR, run_cli
from workers.readme_commands import user_folder

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config, load_run_config, to_dict
from te_mixtral.errors import UserError
from te_mixtral.results.reproduce import reproduce_command

TINY = str(REPO / "configs" / "tiny.yaml")
LAUNCHERS = ("python run_finetune_ep.py", "torchrun ", "accelerate launch ")


def readme_lines() -> list[str]:
    """Every command line of the README's bash blocks, once, in order, continued lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    lines = [" ".join(line.split()) for line in "\n".join(blocks).replace("\\\n", " ").splitlines()]
    return list(dict.fromkeys(line for line in lines if line and not line.startswith("#")))


COMMANDS = [line for line in readme_lines() if line.startswith(LAUNCHERS) and "run_finetune_ep.py" in line]


def world_size(words: list[str]) -> int:
    for word, after in zip(words, words[1:] + [""]):
        if word.startswith("--nproc_per_node="):
            return int(word.split("=")[1])
        if word == "--num_processes":
            return int(after)
    return 1


# The README lines not run here, and why.
NOT_RUN = {
    "pip install torch==2.13.0 && pip install -r requirements.txt": "installs packages",
    "pip install --no-build-isolation transformer_engine[pytorch]": "installs packages (GPU machines)",
    "python -m pytest -q": "this suite",
    "python run_finetune_ep.py --config configs/mixtral-8x7b-2layer.yaml --tier custom_grouped --optimizer "
    "master_adamw": "full-width Mixtral-8x7B layers: a GPU's work",
    "python3 scripts/gpu_runs.py tiers runs/h100 configs/mixtral-8x7b-2layer.yaml 1 1 hf grouped_linear "
    "custom_grouped":
        "GPU tiers at full width",
    "python run_finetune_ep.py --config configs/mixtral-8x7b-lora.yaml --tier device_mxfp8 --model "
    "mistralai/Mixtral-8x7B-v0.1 --format chat --dataset my_chats.jsonl --save-adapter mixtral-lora":
        "the real Mixtral-8x7B: a hub download and a Hopper GPU's work",
}
# A README placeholder, and what stands for it here: the checkpoint its own first line makes.
PLACEHOLDERS = {"PATH_OR_HUB_ID": "tiny-mixtral"}
# A user's own files the README names, and what they hold here.
USER_FILES = {"my_chats.jsonl": REPO / "examples" / "chat.jsonl"}


def as_run(command: str) -> str:
    """`command` as run here: placeholders filled, two steps where it trains and sets no `--steps`."""
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    trains = "run_finetune_ep.py" in command and "--estimate-memory" not in command
    return command + " --steps 2" if trains and "--steps" not in command.split() else command


RUN = [line for line in readme_lines() if line not in NOT_RUN]
RUN_HERE = [line for line in RUN if line.startswith(LAUNCHERS[0])]
RUN_BEHIND = [line for line in RUN if line not in RUN_HERE]
BACKGROUND = Command((sys.executable, str(REPO / "tests" / "workers" / "readme_commands.py"), RUN_DIR,
                      *map(as_run, RUN_BEHIND)), timeout=900)
PLANNED_COMMANDS = [BACKGROUND]  # run from the session's start (conftest.py's planned_command)


def test_the_readme_shows_each_way_in():
    assert len(COMMANDS) >= 8
    for fragment in ("--model", "--resume", "--save-hf", "--estimate-memory", "--eval-fraction", "tiny-chat.yaml"):
        assert any(fragment in command for command in COMMANDS) or fragment in (REPO / "README.md").read_text()
    assert any(c.startswith("torchrun ") for c in COMMANDS) and any(c.startswith("accelerate launch ") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_is_a_valid_config(command, monkeypatch):
    # As on the GPU machine the README has in mind: CUDA resolves precision auto to bf16.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    words = shlex.split(command)
    args, overrides = parse_args(words[words.index("run_finetune_ep.py") + 1:])
    if not (REPO / args.config).exists():
        pytest.skip(f"{args.config} is not in this checkout")
    ranks = args.estimate_memory or world_size(words)
    load_run_config(str(REPO / args.config), overrides, world_size=ranks)


def test_a_lower_learning_rate_alone_just_works():
    cfg = load_config(TINY, {"lr": "1e-4"})
    assert (cfg.train.lr, cfg.train.min_lr) == (1e-4, 1e-5)  # min_lr follows lr / 10
    assert load_config(TINY).train.min_lr == 3e-4  # and reads as written: 3e-3 / 10 in floats is not 3e-4
    with pytest.raises(UserError, match=r"train.min_lr \(0.001\) must be in \[0, train.lr \(0.0001\)\]: set --min_lr"):
        load_config(TINY, {"lr": "1e-4", "min_lr": "1e-3"})  # set by hand: kept, and the fix named


def test_a_short_run_alone_just_works():
    assert [load_config(TINY, {"steps": str(n)}).train.timing_warmup_steps for n in (1, 2, 3, 4, 40)] == [0, 1, 2, 3, 3]
    with pytest.raises(UserError, match="set --timing_warmup_steps 2 or fewer, or leave it unset"):
        load_config(TINY, {"steps": "3", "timing_warmup_steps": "3"})
    # A config file that sets it keeps it, and says so the same way.
    with pytest.raises(UserError, match="set --timing_warmup_steps 2 or fewer"):
        load_config(str(REPO / "configs" / "mixtral-8x7b-2layer.yaml"), {"steps": "3"})


def test_a_reproduce_command_names_a_following_key_only_where_it_would_follow_elsewhere():
    # min_lr set by hand to tiny.yaml's own value, lr changed: left out, min_lr would follow lr.
    cfg = load_config(TINY, {"lr": "1e-3", "min_lr": "3e-4", "steps": "7"})
    command = reproduce_command(to_dict(cfg), world_size=1)
    assert "--train.min_lr 0.0003" in command and "--train.timing_warmup_steps" not in command
    args, overrides = parse_args(shlex.split(command)[2:])
    assert to_dict(load_config(str(REPO / args.config), overrides)) == to_dict(cfg)


def test_every_readme_command_is_run_or_says_why_not():
    assert set(NOT_RUN) <= set(readme_lines()), set(NOT_RUN) - set(readme_lines())  # no stale entry
    assert any("PATH_OR_HUB_ID" in line for line in RUN_BEHIND)
    assert "python scripts/make_tiny_mixtral.py tiny-mixtral" in RUN_BEHIND  # the checkpoint it stands for
    assert len(RUN_HERE) >= 6 and len(RUN_BEHIND) >= 4


@pytest.fixture(scope="module")
def ran_here(tmp_path_factory) -> dict:
    """{README line: CompletedProcess} of the `python run_finetune_ep.py` lines, run in order in
    one user's folder."""
    folder = tmp_path_factory.mktemp("readme")
    user_folder(folder)
    for name, source in USER_FILES.items():
        shutil.copy(source, folder / name)
    return {line: run_cli(shlex.split(as_run(line))[2:], cwd=folder) for line in RUN_HERE}


def assert_ran(command: str, returncode: int, stdout: str, stderr: str) -> None:
    assert returncode == 0, f"{command}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    if "run_finetune_ep.py" in command and "--estimate-memory" not in command:
        assert "results: " in stdout, stdout[-2000:]


@pytest.mark.parametrize("command", RUN_HERE)
def test_readme_command_runs_as_written(command, ran_here):
    proc = ran_here[command]
    assert_ran(command, proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("command", RUN_BEHIND)
def test_readme_launcher_command_runs_as_written(command, planned_command):
    proc, folder = planned_command(BACKGROUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = {o["command"]: o for o in json.loads((folder / "outcomes.json").read_text())}
    outcome = outcomes[as_run(command)]
    assert_ran(command, outcome["returncode"], outcome["stdout"], outcome["stderr"])
    if "--save-hf finetuned" in command:  # evaluated on held-out conversations, checkpointed, exported
        assert "eval  step    2/2" in outcome["stdout"], outcome["stdout"][-2000:]
        assert (folder / "finetuned" / "config.json").exists() and any((folder / "ckpt").iterdir())
