"""The learning-rate schedule: linear warm-up to `lr` over `warmup_steps`, then cosine decay
reaching `min_lr` exactly at the last step.

The expected values are written out by hand from that definition, not computed by the code
under test: a warm-up off by one step, a decay that stops short of `min_lr` or runs past it
all change at least one of them. A run's own progress lines then show that the loop steps
with the schedule it defines (a loop that asked for step + 1 would start at 2 lr / W).
"""

import math
import re

import pytest
from conftest import REPO
from launch import run_cli

from te_mixtral.config import load_config
from te_mixtral.training.optimizer import learning_rate

LR, MIN_LR, WARMUP, STEPS = 3e-3, 3e-4, 4, 41  # decay over steps 4 .. 40 (36 intervals)


def config(steps: int = STEPS, warmup: int = WARMUP):
    return load_config(str(REPO / "configs" / "tiny.yaml"), {
        "lr": str(LR), "min_lr": str(MIN_LR), "warmup_steps": str(warmup), "steps": str(steps)})


def test_schedule_at_its_landmarks():
    cfg = config()
    expected = {
        0: LR / 4,  # first step: one quarter of the warm-up done, never lr 0
        1: LR / 2,
        3: LR,  # the warm-up's last step reaches lr
        4: LR,  # the decay starts at lr (cos 0)
        13: MIN_LR + (LR - MIN_LR) * (1 + math.sqrt(0.5)) / 2,  # a quarter of the decay: cos(pi / 4)
        22: (LR + MIN_LR) / 2,  # the decay's midpoint: cos(pi / 2) = 0
        40: MIN_LR,  # the last step reaches min_lr
    }
    for step, want in expected.items():
        assert learning_rate(step, cfg) == pytest.approx(want, rel=1e-12, abs=0), step


def test_schedule_rises_then_falls_to_min_lr():
    cfg = config()
    lrs = [learning_rate(step, cfg) for step in range(STEPS)]
    warm, decay = lrs[:WARMUP], lrs[WARMUP - 1:]
    assert all(a < b for a, b in zip(warm, warm[1:]))
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert min(lrs) == pytest.approx(MIN_LR, rel=1e-12) and max(lrs) == pytest.approx(LR, rel=1e-12)


def test_schedule_without_warmup():
    cfg = config(steps=5, warmup=0)
    got = [learning_rate(step, cfg) for step in range(5)]
    want = [MIN_LR + (LR - MIN_LR) * (1 + c) / 2 for c in (1, math.sqrt(0.5), 0, -math.sqrt(0.5), -1)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_run_steps_with_the_schedule(tmp_path):
    """The loop's progress lines print each step's lr (3 significant digits)."""
    proc = run_cli(["--steps", "6", "--warmup_steps", "4", "--lr", str(LR), "--min_lr", str(MIN_LR),
                    "--batch_size", "2", "--seq_len", "32", "--log_every", "1", "--timing_warmup_steps", "1",
                    "--output-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [float(lr) for lr in re.findall(r"lr (\S+)", proc.stdout)]
    # warm-up 1/4, 2/4, 3/4, 4/4 of lr; the decay's first step at lr, its last (step 6) at min_lr
    assert printed == pytest.approx([7.5e-4, 1.5e-3, 2.25e-3, 3e-3, 3e-3, 3e-4], rel=5e-3), proc.stdout
