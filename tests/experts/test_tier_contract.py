"""The tier contract: every registered tier is an `ExpertTier`, and the example tier of
docs/architecture.md ("Adding a tier") runs as the doc says, matching the `loop` tier."""

import ast
import re
import sys

import pytest
import torch
from background import Command
from conftest import REPO

from te_mixtral.experts import registry
from te_mixtral.experts.base import ExpertTier
from te_mixtral.experts.loop import LoopTier

DOC = REPO / "docs" / "architecture.md"


def doc_code_blocks() -> list[str]:
    section = DOC.read_text().split("## Adding a tier", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_every_registered_tier_subclasses_the_base():
    for name, tier_class in registry.EXPERT_TIERS.items():
        assert issubclass(tier_class, ExpertTier), name
        assert tier_class.name == name
        assert isinstance(registry.make_tier(name), ExpertTier)
    assert not set(registry.BASELINES) & set(registry.EXPERT_TIERS)
    assert registry.RUN_NAMES == (*registry.BASELINES, *registry.EXPERT_TIERS)


def test_a_tier_must_implement_call():
    class NoCall(ExpertTier):
        name = "no_call"

    with pytest.raises(TypeError):
        NoCall()


def test_defaults_of_the_base():
    tier = LoopTier.from_config(object())
    assert isinstance(tier, LoopTier) and tier.describe() == {}
    tier.check_available(torch.device("cpu"))


def test_doc_example_tier_matches_loop():
    example, registry_lines = doc_code_blocks()
    namespace = {}
    exec(compile(example, str(DOC), "exec"), namespace)  # defines the class; registers nothing
    tier_class = namespace["GatherTier"]
    assert issubclass(tier_class, ExpertTier) and tier_class.name not in registry.EXPERT_TIERS

    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 3, 1, 0, 7])  # empty experts included
    hidden, ffn, experts = 12, 20, len(counts)
    x = torch.randn(int(counts.sum()), hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * ffn, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, ffn, generator=gen) / ffn**0.5
    dy = torch.randn(x.shape[0], hidden, generator=gen)

    def forward_backward(tier):
        inputs = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        y = tier(inputs[0], counts, *inputs[1:])
        return (y, *torch.autograd.grad(y, inputs, dy))

    for got, want in zip(forward_backward(tier_class.from_config(None)), forward_backward(LoopTier())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # The registry lines the doc asks for have the form the registry's own tiers use.
    source = (REPO / "te_mixtral" / "experts" / "registry.py").read_text()
    for line in registry_lines.splitlines():
        assert line.replace("gather", "loop").replace("GatherTier", "LoopTier") + "\n" in source, line


def test_config_help_names_every_tier_and_mode():
    # config.py stays a leaf at import time, so its help text lists the names itself.
    from te_mixtral.config import settings
    from te_mixtral.experts.options import FP8_MODES

    assert all(name in settings()["tier"].metadata["help"] for name in registry.RUN_NAMES)
    assert all(mode in settings()["fp8.mode"].metadata["help"] for mode in FP8_MODES)


# Imports in a fresh interpreter where triton and transformer_engine cannot be imported.
WITHOUT_TRITON_OR_TE = Command((sys.executable, "-c",
                                "import sys; sys.modules['triton'] = sys.modules['transformer_engine'] = None\n"
                                "import te_mixtral.experts.registry, te_mixtral.training.loop, te_mixtral.cli"))
PLANNED_COMMANDS = [WITHOUT_TRITON_OR_TE]  # run from the session's start (conftest.py's planned_command)


def test_the_registry_and_the_training_loop_import_without_triton_or_te(planned_command):
    """The tiers load Triton and Transformer Engine where they run: choosing, checking and
    planning a run (the registry, the config, the training loop's module) needs neither."""
    proc, _ = planned_command(WITHOUT_TRITON_OR_TE)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_nothing_outside_the_tiers_branches_on_a_tier_name():
    """A tier's options, checks and memory terms are its own (asked through the registry): no
    module outside experts/ names a tier or baseline in a string, save config.py's default
    tier (config stays importable without torch, so it cannot ask the registry)."""
    names = set(registry.RUN_NAMES)
    found = []
    for path in sorted((REPO / "te_mixtral").rglob("*.py")):
        if "experts" in path.relative_to(REPO / "te_mixtral").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} '{node.value}'")
    assert found == [f"te_mixtral/config.py:{_default_tier_line()} 'loop'"], found


def _default_tier_line() -> int:
    lines = (REPO / "te_mixtral" / "config.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.lstrip().startswith("tier: str = setting(\"loop\""))
