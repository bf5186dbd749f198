"""Runs that cannot go on: a diverged model is never saved, a full disk ends in one line,
and whatever can only fail after training is refused before it."""

import errno
import json
import math
import os

import pytest
import torch
from launch import train_and_save
from safetensors import SafetensorError

import te_mixtral.measure.report as report
import te_mixtral.training.hf_checkpoint as hf_checkpoint
from te_mixtral.config import load_config
from te_mixtral.data.tokenizer import Tokenizer, train_tokenizer
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import Diverged, UserError, WriteFailed
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.experts.loop import LoopTier
from te_mixtral.measure.loss_check import check_reference
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.training.generate import encode_prompt
from te_mixtral.training.hf_checkpoint import save_hf_checkpoint

SINGLE = Layout(0, 1, 1, None, None)
TINY = {"vocab_size": "320", "hidden_size": "16", "intermediate_size": "24", "num_hidden_layers": "1",
        "num_attention_heads": "2", "num_key_value_heads": "1", "head_dim": "8", "num_experts": "2",
        "tokenizer_vocab_size": "300"}
NORMS_RUN = ["--steps", "3", "--timing_warmup_steps", "1", "--seq_len", "64"]
# Launched with the other modules' one-process runs (conftest.py's launch_planned).
PLANNED_RUNS = {1: [NORMS_RUN]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.wrap(train_tokenizer([f"text number {i}" for i in range(50)], 300), "test")


def tiny_model():
    cfg = load_config(None, TINY)
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier())
    init_weights(model, 0, SINGLE)
    return model


def test_an_export_of_non_finite_weights_is_refused_and_writes_nothing(tmp_path, tokenizer):
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[1, 0, 0] = math.nan
    with pytest.raises(Diverged, match="weights are not finite.*refusing to save the Hugging Face export"):
        save_hf_checkpoint(model, tmp_path / "export", SINGLE, torch.float32, tokenizer)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error", [SafetensorError("Error while serializing: I/O error: No space left on device "
                                                   "(os error 28)"),
                                   OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))])
def test_an_export_onto_a_full_disk_is_one_line_and_keeps_the_earlier_export(tmp_path, tokenizer, monkeypatch, error):
    # safetensors raises its own SafetensorError on a full disk (measured on a 1 MiB tmpfs).
    model, out = tiny_model(), tmp_path / "export"
    save_hf_checkpoint(model, out, SINGLE, torch.float32, tokenizer)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):
        raise error

    monkeypatch.setattr(hf_checkpoint, "save_file", disk_full)
    with pytest.raises(WriteFailed, match="cannot write the Hugging Face export .*No space left on device"):
        save_hf_checkpoint(model, out, SINGLE, torch.float32, tokenizer)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_results_onto_a_full_disk_are_printed_then_one_line(tmp_path, monkeypatch, capsys):
    def disk_full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report, "write_text_atomic", disk_full)
    with pytest.raises(WriteFailed, match="results.json .*No space left on device"):
        report.write_results(tmp_path, {"tier": "loop"}, {"median_step_ms": 1.0}, [2.5, math.nan])
    printed = capsys.readouterr().out
    assert printed.startswith("results.json (not saved): ")
    kept = json.loads(printed.removeprefix("results.json (not saved): "))
    assert kept["losses"][0] == 2.5 and math.isnan(kept["losses"][1]) and kept["header"] == {"tier": "loop"}


def test_a_reference_that_can_only_fail_is_refused_before_training():
    with pytest.raises(UserError, match="has no losses"):
        check_reference([], 5, "fp32", "ref.json")
    with pytest.raises(UserError, match="non-finite loss at step 3"):
        check_reference([3.0, 2.9, math.nan, 2.7], 5, "fp32", "ref.json")
    check_reference([3.0, 2.9, math.nan], 2, "fp32", "ref.json")  # past the compared steps
    with pytest.raises(UserError, match="no loss tolerance"):
        check_reference([3.0], 5, "fp16", "ref.json")


def test_a_prompt_that_leaves_nothing_to_generate_is_refused(tokenizer):
    prompt_ids = encode_prompt(tokenizer, "text number", 64, 1)
    assert encode_prompt(tokenizer, "text number", 64, 64 - len(prompt_ids)) == prompt_ids
    for blank in ("", " \n "):  # before: blank text generated from a few spaces' tokens
        with pytest.raises(UserError, match="the generate prompt is blank"):
            encode_prompt(tokenizer, blank, 64, 1)
    with pytest.raises(UserError, match="leaves no room to generate"):
        encode_prompt(tokenizer, "text number " * 40, 64, 1)
    # More new tokens than the context holds: refused, not cut short without a word.
    with pytest.raises(UserError, match=f"set --generate-tokens {64 - len(prompt_ids)} or fewer"):
        encode_prompt(tokenizer, "text number", 64, 65 - len(prompt_ids))


@pytest.mark.parametrize("hidden, ffn, bad", [(48, 64, "hidden_size"), (64, 48, "intermediate_size")])
def test_mxfp8_refuses_sizes_its_blocks_cannot_take_before_building(hidden, ffn, bad):
    cfg = load_config(None, {**TINY, "hidden_size": str(hidden), "intermediate_size": str(ffn),
                             "tier": "device_mxfp8", "fp8.mode": "mxfp8-emulated"})
    tier = DeviceMXFP8Tier.from_config(cfg)
    with pytest.raises(UserError, match=f"model.{bad} to be a multiple of 32, got 48"):
        tier.check_available("cpu")
    DeviceMXFP8Tier.from_config(load_config(None, {**TINY, "hidden_size": "64", "intermediate_size": "96",
                                                   "tier": "device_mxfp8", "fp8.mode": "mxfp8-emulated"})
                                ).check_available("cpu")


def test_results_record_the_global_gradient_norm_of_every_step(tmp_path, launch_planned):
    launch_planned(1)
    results, _, grads = train_and_save(tmp_path, NORMS_RUN)
    # The norm of the gradients the loop held after reducing them, before clipping, in float64.
    expected = [math.sqrt(sum(g.double().square().sum().item() for g in step.values())) for step in grads[0]]
    assert len(results["grad_norms"]) == 3
    for got, want in zip(results["grad_norms"], expected):
        assert got == pytest.approx(want, rel=1e-5)
