"""Settings that would train wrongly or crash later are refused before anything runs, each
with one line naming the key."""

import pytest
from conftest import REPO
from launch import assert_one_line_error, run_app

from te_mixtral.config import load_config
from te_mixtral.errors import UserError


@pytest.mark.parametrize("key, value, fragment", [
    ("grad_clip", "-1", "train.grad_clip must be a finite norm above 0"),  # reversed gradients, exit 0
    ("grad_clip", "0", "train.grad_clip must be a finite norm above 0"),  # never learns
    ("grad_clip", ".inf", "train.grad_clip must be a finite norm above 0"),
    ("batch_size", "0", "train.batch_size must be positive"),
    ("batch_size", "-4", "train.batch_size must be positive"),
    ("beta1", "1", "train.beta1 must be in [0, 1)"),
    ("beta2", "1.5", "train.beta2 must be in [0, 1)"),
    ("beta2", "-0.1", "train.beta2 must be in [0, 1)"),
    ("lr", ".inf", "a finite lr > 0"),
    ("lr", ".nan", "a finite lr > 0"),
    ("weight_decay", "-0.1", "train.weight_decay must be finite and >= 0"),
    ("warmup_steps", "-1", "train.warmup_steps must be 0 or positive"),
    ("max_documents", "-3", "data.max_documents must be positive or null"),
    ("max_documents", "0", "data.max_documents must be positive or null"),
    ("rms_norm_eps", "0", "model.rms_norm_eps must be finite and above 0"),
    ("rms_norm_eps", "-1e-5", "model.rms_norm_eps must be finite and above 0"),
    ("rope_theta", "0", "model.rope_theta must be finite and above 0"),
    ("initializer_range", ".nan", "model.initializer_range must be finite and above 0"),
    ("fsdp_reduce", "sometimes", "train.fsdp_reduce must be one of step, micro_batch"),
    ("fsdp_reduce", "micro_batch", "train.fsdp_reduce micro_batch is FSDP's: it needs train.sharding fsdp"),
])
def test_bad_setting_is_refused_in_one_line(key, value, fragment):
    with pytest.raises(UserError) as raised:
        load_config(str(REPO / "configs" / "tiny.yaml"), {key: value, "min_lr": "0"})
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_good_edges_load():
    load_config(str(REPO / "configs" / "tiny.yaml"), {"beta1": "0", "warmup_steps": "0", "weight_decay": "0", "max_documents": "1"})


def test_an_empty_config_file_is_refused_not_killed(tmp_path):
    # An empty file means every default: the full Mixtral-8x7B, far beyond this machine's
    # memory. The estimate refuses it before building anything (before: killed, no message).
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert_one_line_error(run_app(["--config", str(empty)], timeout=120), "needs about")
