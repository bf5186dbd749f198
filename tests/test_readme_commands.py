"""The README's commands load as valid configs, and the overrides a newcomer tries first
(`--lr 1e-4`, `--steps 3`) just work or say how to fix them. Nothing trains here: each command
line goes through the entry point's own parsing and validation, in-process."""

import re
import shlex

import pytest
import torch
from conftest import REPO

from te_mixtral.cli import parse_args
from te_mixtral.config import load_config, to_dict
from te_mixtral.errors import UserError
from te_mixtral.experts.registry import check_tier
from te_mixtral.results.reproduce import reproduce_command

TINY = str(REPO / "configs" / "tiny.yaml")
LAUNCHERS = ("python run_finetune_ep.py", "torchrun ", "accelerate launch ")


def readme_commands() -> list[str]:
    """Every command line in the README's bash blocks that starts the entry point."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()  # continued lines joined
    return [line.strip() for line in lines if line.startswith(LAUNCHERS) and "run_finetune_ep.py" in line]


def world_size(words: list[str]) -> int:
    for word, after in zip(words, words[1:] + [""]):
        if word.startswith("--nproc_per_node="):
            return int(word.split("=")[1])
        if word == "--num_processes":
            return int(after)
    return 1


COMMANDS = readme_commands()


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
    cfg = load_config(str(REPO / args.config), overrides, world_size=ranks)
    check_tier(cfg, ranks)


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
