"""The README's commands load as valid configs, and the overrides a newcomer tries first
(`--lr 1e-4`, `--steps 3`) just work or say how to fix them: each command line goes through
the entry point's own parsing and validation, in-process.

And every README command a CPU can run, runs as written, on what ships, from a user's folder
of their own (tests/workers/readme_commands.py). Each bash block is a sequence, run in order in
a folder of its own, so a command may rely on the ones before it in its block (a resume on the
run before it) and on nothing else: blocks of `python run_finetune_ep.py` lines (and of the
tiny checkpoint's script, `SCRIPTS_HERE`) in this process (`run_cli`), the others (launchers)
in the background from the session's start. Training commands that do not set `--steps` run two steps (their
evaluation, checkpoint and export still come: each is due after the last step), and a step
count the README sets after them stands for as many steps beyond (`STEPS`). What is not run
says why in `NOT_RUN`; a new README command must be one or the other.
"""

import json
import re
import shlex
import sys

import peft
import pytest
import torch
from background import Command
from conftest import REPO
from launch import RUN_DIR, run_cli
from transformers import AutoTokenizer
from workers.readme_commands import user_folder

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config, load_run_config, to_dict
from te_mixtral.errors import UserError
from te_mixtral.results.reproduce import reproduce_command

TINY = str(REPO / "configs" / "tiny.yaml")
LAUNCHERS = ("python run_finetune_ep.py", "torchrun ", "accelerate launch ")


def readme_blocks() -> list[list[str]]:
    """The README's bash blocks in order, each its command lines in order, continued lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    return [[line for line in (" ".join(raw.split()) for raw in block.replace("\\\n", " ").splitlines())
             if line and not line.startswith("#")] for block in blocks]


def readme_lines() -> list[str]:
    """Every command line of the README's bash blocks, once, in order."""
    return list(dict.fromkeys(line for block in readme_blocks() for line in block))


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
# A README step count, and what stands for it here: the config's 40 steps run as 2, so a
# resume to 60 (20 more) runs to 4.
STEPS = {"--steps 60": "--steps 4"}


def as_run(command: str) -> str:
    """`command` as run here: placeholders filled, step counts as in `STEPS`, two steps where it
    trains and sets no `--steps`."""
    for placeholder, value in {**PLACEHOLDERS, **STEPS}.items():
        command = command.replace(placeholder, value)
    trains = "run_finetune_ep.py" in command and "--estimate-memory" not in command
    return command + " --steps 2" if trains and "--steps" not in command.split() else command


# The README's sequences as run here: each block's lines but those not run, in order. Those of
# the app and of the scripts below alone run in this process (`run_cli`); the others behind it.
SEQUENCES = [seq for seq in ([line for line in block if line not in NOT_RUN] for block in readme_blocks()) if seq]
SCRIPTS_HERE = ("python scripts/make_tiny_mixtral.py ",)
SEQUENCES_HERE = [seq for seq in SEQUENCES if all(line.startswith((LAUNCHERS[0], *SCRIPTS_HERE)) for line in seq)]
SEQUENCES_BEHIND = [seq for seq in SEQUENCES if seq not in SEQUENCES_HERE]
RUN_HERE = [(i, line) for i, seq in enumerate(SEQUENCES_HERE) for line in seq]
RUN_BEHIND = [(i, line) for i, seq in enumerate(SEQUENCES_BEHIND) for line in seq]
BACKGROUND = Command((sys.executable, str(REPO / "tests" / "workers" / "readme_commands.py"), RUN_DIR,
                      json.dumps([[as_run(line) for line in seq] for seq in SEQUENCES_BEHIND])), timeout=900, long=True)
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
    if "lora.init" in overrides:  # read as the config loads: the adapter its block exported first, as one stands here
        overrides["lora.init"] = str(REPO / "tests" / "lora_adapter")
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
    assert set(STEPS) <= {f"--steps {w}" for line in readme_lines() for w in re.findall(r"--steps (\d+)", line)}
    behind = [line for _, line in RUN_BEHIND]
    assert any("PATH_OR_HUB_ID" in line for line in behind)
    assert len(RUN_HERE) >= 6 and len(RUN_BEHIND) >= 4
    # The checkpoint the placeholder stands for is made first in the sequence that fine-tunes and
    # resumes it, and the resume comes after the run it continues.
    [sequence] = [seq for seq in SEQUENCES_BEHIND if any("--resume" in line for line in seq)]
    assert sequence[0] == "python scripts/make_tiny_mixtral.py tiny-mixtral"
    first, resume = sequence[1:]
    assert resume.startswith(first) and "--checkpoint-dir ckpt" in first


def run_id(item: tuple[int, str]) -> str:
    return f"block {item[0]}: {item[1]}"


@pytest.fixture(scope="module")
def ran_here(tmp_path_factory) -> tuple[dict, list]:
    """{(sequence, README line): CompletedProcess} of the sequences of `python run_finetune_ep.py`
    lines, each run in order in a user's folder of its own; and those folders, by sequence."""
    ran, folders = {}, []
    for i, sequence in enumerate(SEQUENCES_HERE):
        folder = tmp_path_factory.mktemp(f"readme{i}")
        folders.append(folder)
        user_folder(folder)  # what ships, and nothing else: a file of the user's own is no command run as written
        for line in sequence:
            _, script, *args = shlex.split(as_run(line))
            ran[i, line] = run_cli(args, cwd=folder, script=script)
    return ran, folders




def assert_ran(command: str, returncode: int, stdout: str, stderr: str) -> None:
    assert returncode == 0, f"{command}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    if "run_finetune_ep.py" in command and "--estimate-memory" not in command:
        assert "results: " in stdout, stdout[-2000:]


@pytest.mark.parametrize("item", RUN_HERE, ids=run_id)
def test_readme_command_runs_as_written(item, ran_here):
    proc = ran_here[0][item]
    assert_ran(item[1], proc.returncode, proc.stdout, proc.stderr)


def test_a_line_of_two_blocks_runs_again_where_it_ran(ran_here):
    """A reader runs the README top to bottom in one folder, so a line that two blocks repeat (each
    block stands alone) meets, the second time, what it made the first: the tiny checkpoint's
    script refused its own folder, and the LoRA block stopped there."""
    repeated = {line for line in readme_lines() if sum(line in block for block in readme_blocks()) > 1}
    assert repeated
    for (sequence, line), _ in list(ran_here[0].items()):
        if line in repeated:
            _, script, *args = shlex.split(as_run(line))
            proc = run_cli(args, cwd=ran_here[1][sequence], script=script)
            assert_ran(line, proc.returncode, proc.stdout, proc.stderr)


def test_the_readmes_first_adapter_loads_with_peft_from_anywhere(ran_here):
    """The README's first LoRA command exports an adapter that PEFT's users load as they load any
    (`AutoPeftModelForCausalLM`, the base named in its config), here from another folder than the
    one it was made in: over a base no file held, it named none, and nothing could load it."""
    [(sequence, _)] = [item for item in RUN_HERE if item[1].endswith("--save-adapter my-adapter")]
    adapter = ran_here[1][sequence] / "my-adapter"
    model = peft.AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    ids = AutoTokenizer.from_pretrained(adapter)("The adapters trained on this.", return_tensors="pt").input_ids
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-6  # they trained, and apply


@pytest.mark.parametrize("item", RUN_BEHIND, ids=run_id)
def test_readme_launcher_command_runs_as_written(item, planned_command):
    proc, folder = planned_command(BACKGROUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sequence, command = item
    outcomes = json.loads((folder / "outcomes.json").read_text())
    [outcome] = [o for o in outcomes if (o["sequence"], o["command"]) == (sequence, as_run(command))]
    assert_ran(command, outcome["returncode"], outcome["stdout"], outcome["stderr"])
    ran_in = folder / str(sequence)
    if "--save-hf finetuned" in command:  # evaluated on held-out conversations, checkpointed, exported
        steps = 4 if "--resume" in command else 2
        assert f"eval  step    {steps}/{steps}" in outcome["stdout"], outcome["stdout"][-2000:]
        assert (ran_in / "finetuned" / "config.json").exists() and any((ran_in / "ckpt").iterdir())
    if "--resume" in command:  # on from the run before it, not from the start
        assert "resuming from ckpt/step-000002 (step 2 of 4)" in outcome["stdout"], outcome["stdout"][-2000:]
