"""A checkpoint restores the optimizer's state, not only the weights: after a round trip the
next update is the one the saved run would have made, bit for bit.

The optimizer that receives the checkpoint has taken other steps, with other gradients, so
its moments, step count (bias correction) and, for master_adamw, the low bits of the fp32
master all differ from the saved ones: a restore that skipped any of them changes the next
update. Both optimizers (train.optimizer adamw and master_adamw, the latter with bf16
parameters, and with its experts' moments in 8 bits) are checked.
"""

import dataclasses

import pytest
import torch

from te_mixtral.config import load_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.training import checkpoint
from te_mixtral.training.checkpoint import Checkpointer, TrainState
from te_mixtral.training.optimizer import make_optimizer

SINGLE = Layout(0, 1, 1, None, None)
CPU = torch.device("cpu")
OPTIMIZERS = {"adamw": {"optimizer": "adamw", "dtype": "fp32"},
              "master_adamw": {"optimizer": "master_adamw", "dtype": "bf16"},
              # the experts' moments as 8-bit codes and block scales (whole blocks: 16 x 32 values a row)
              "master_adamw-8bit": {"optimizer": "master_adamw", "dtype": "bf16", "expert_moments": "8bit",
                                    "intermediate_size": "32"}}


def make(cfg, seed: int, steps: int):
    """A model initialised from `seed` and its optimizer after `steps` steps on random
    gradients drawn from `seed` (a weight decay and an lr that make every part of the update count)."""
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier())
    init_weights(model, seed, SINGLE)
    optimizer = make_optimizer(model, cfg)
    step(model, optimizer, torch.Generator().manual_seed(seed), steps)
    return model, optimizer


def step(model, optimizer, generator, steps: int = 1, skip: str | None = None) -> None:
    """`steps` steps on random gradients, parameter `skip` left without one."""
    for _ in range(steps):
        for name, p in model.named_parameters():
            p.grad = None if name == skip else torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def small_config(tmp_path, name: str):
    return load_config(None, {
        "checkpoint_dir": str(tmp_path / "ckpt"), "vocab_size": "64", "hidden_size": "16", "intermediate_size": "24",
        "num_hidden_layers": "1", "num_attention_heads": "2", "num_key_value_heads": "1", "head_dim": "8",
        "num_experts": "2", "tokenizer_vocab_size": "64", "steps": "10", "lr": "1e-2",
        "weight_decay": "0.1", **OPTIMIZERS[name]})


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_restored_optimizer_makes_the_saved_runs_next_update(tmp_path, name):
    cfg = small_config(tmp_path, name)
    saved_model, saved_optimizer = make(cfg, seed=1, steps=3)
    ckpt = Checkpointer(cfg, SINGLE, CPU, "a" * 64)  # any tokenizer hash: saved and read by one run
    ckpt.save(TrainState(3, [1.0, 1.0, 1.0], []), saved_model, saved_optimizer, cfg)
    model, optimizer = make(cfg, seed=2, steps=1)  # other weights, other moments, another step count
    ckpt.load_latest(model, optimizer, dataclasses.replace(cfg, resume=True))
    for (key, want), got in zip(saved_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), key

    # The same next gradients on both: the updates must agree bit for bit.
    step(saved_model, saved_optimizer, torch.Generator().manual_seed(3))
    step(model, optimizer, torch.Generator().manual_seed(3))
    moved = False
    for (key, want), (_, got), (_, before) in zip(saved_model.named_parameters(), model.named_parameters(),
                                                  make(cfg, seed=1, steps=3)[0].named_parameters()):
        assert torch.equal(got, want), f"{name}: {key} after the step that follows the restore"
        moved |= not torch.equal(want, before)
    assert moved, "the step after the restore changed nothing, so the comparison proves nothing"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_parameter_never_stepped_is_restored_as_fresh(tmp_path, name):
    """A parameter that has had no gradient yet has no optimizer state. Saving must give it
    the state its first step would create without stepping anything else (the step counts
    set the bias correction), and the restored run then steps as the saved one."""
    cfg = small_config(tmp_path, name)
    saved_model, saved_optimizer = make(cfg, seed=1, steps=0)
    step(saved_model, saved_optimizer, torch.Generator().manual_seed(1), steps=2, skip="lm_head.weight")
    Checkpointer(cfg, SINGLE, CPU, "a" * 64).save(TrainState(2, [1.0, 1.0], []), saved_model, saved_optimizer, cfg)
    model, optimizer = make(cfg, seed=2, steps=0)
    Checkpointer(cfg, SINGLE, CPU, "a" * 64).load_latest(model, optimizer, dataclasses.replace(cfg, resume=True))
    for stepped in (saved_model, model):  # the saved run goes on as if never saved
        step(stepped, saved_optimizer if stepped is saved_model else optimizer, torch.Generator().manual_seed(3))
    reference, reference_optimizer = make(cfg, seed=1, steps=0)  # never saved at all
    step(reference, reference_optimizer, torch.Generator().manual_seed(1), steps=2, skip="lm_head.weight")
    step(reference, reference_optimizer, torch.Generator().manual_seed(3))
    for (key, want), (_, saved), (_, resumed) in zip(reference.named_parameters(), saved_model.named_parameters(),
                                                     model.named_parameters()):
        assert torch.equal(saved, want) and torch.equal(resumed, want), f"{name}: {key}"


@pytest.mark.parametrize("name, moments", [("adamw", None), ("master_adamw", "bf16"), ("master_adamw", "fp32"),
                                           ("master_adamw-8bit", "bf16")])
def test_free_space_check_sizes_what_a_save_writes(tmp_path, monkeypatch, name, moments):
    """The up-front check counts each optimizer's real state: master_adamw's remainders and
    moments (bf16 or fp32; the experts' in 8 bits) beside its bf16 weights, adamw's two fp32
    moments."""
    cfg = load_config(None, {
        **OPTIMIZERS[name], "checkpoint_dir": str(tmp_path / "ckpt"), "vocab_size": "512", "hidden_size": "64",
        "intermediate_size": "192", "num_hidden_layers": "2", "num_attention_heads": "4", "num_key_value_heads": "2",
        "head_dim": "16", "num_experts": "4", "tokenizer_vocab_size": "512", "steps": "10",
        **({"moment_dtype": moments} if moments else {}), "checkpoint_keep": "1"})  # adamw's are fp32 alone
    model, optimizer = make(cfg, seed=1, steps=1)
    ckpt = Checkpointer(cfg, SINGLE, CPU, "a" * 64)
    asked = []
    monkeypatch.setattr(checkpoint, "require_free_space", lambda folder, needed, *rest: asked.append(needed))
    ckpt.check_free_space(model)
    written = ckpt.save(TrainState(1, [1.0], []), model, optimizer, cfg)
    one_checkpoint = asked[0] / 2  # keep 1, plus the one being written
    size = sum(f.stat().st_size for f in written.rglob("*") if f.is_file())
    # The check leaves out only file headers, the config and the RNG state: a few percent here.
    assert 0.9 * size <= one_checkpoint <= size, (one_checkpoint, size)
