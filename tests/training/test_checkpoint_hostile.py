"""Checkpoints a user did not mean to hand over as they are: altered by hand or by someone
else, written by a run of another tier family, or cut short by Ctrl-C. Each ends in one
line, never in a traceback, and never in advice to load a file's code."""

import argparse
import dataclasses
import json
import signal

import pytest
import torch
from test_checkpoint import save, setup  # noqa: F401 (setup is a fixture)

import te_mixtral.training.checkpoint as checkpoint
from te_mixtral.errors import Interrupted, UserError
from te_mixtral.files import sha256_of
from te_mixtral.training.checkpoint import LATEST, TrainState
from te_mixtral.training.loop import stop_on_interrupt


def rewrite_shard(folder, edit):
    """Replace rank 0's file with `edit(its blob)` and record the new file in meta.json, as
    someone who knows the format would: the size and hash checks pass."""
    shard = folder / "rank00000.pt"
    blob = edit(torch.load(shard, weights_only=True))
    torch.save(blob, shard)
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"][shard.name] = {"bytes": shard.stat().st_size, "sha256": sha256_of(shard)}
    (folder / "meta.json").write_text(json.dumps(meta))


def test_a_checkpoint_holding_objects_is_refused_without_loading_them(setup):
    cfg, fresh, ckpt = setup
    folder = save(ckpt, cfg, *fresh(), 2)
    rewrite_shard(folder, lambda blob: {**blob, "extra": argparse.Namespace(code="would run on load")})
    with pytest.raises(UserError, match="holds objects other than tensors") as info:
        ckpt.load_latest(*fresh(), cfg)
    assert "weights_only" not in str(info.value) and "\n" not in str(info.value)


def test_a_checkpoint_of_another_model_layout_is_one_line(setup):
    cfg, fresh, ckpt = setup
    folder = save(ckpt, cfg, *fresh(), 2)
    meta = json.loads((folder / "meta.json").read_text())
    meta["config"]["tier"] = "hf"  # transformers' model: its weights are named `hf.model...`
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="written by tier hf, .* resume it with --tier hf"):
        ckpt.load_latest(*fresh(), cfg)
    meta["config"]["tier"] = "loop"
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="written by tier loop, .* resume it with --tier loop"):
        ckpt.load_latest(*fresh(), dataclasses.replace(cfg, tier="hf_eager"))
    # A checkpoint that lacks a parameter of the model: test_checkpoint.py's
    # test_a_model_with_a_parameter_the_checkpoint_lacks_is_refused_in_one_line.


def test_ctrl_c_during_a_save_is_an_interruption_not_a_full_disk(setup, monkeypatch):
    cfg, fresh, ckpt = setup
    model, optimizer = fresh()
    save(ckpt, cfg, model, optimizer, 2)
    real_open = open

    def open_then_ctrl_c(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode:  # Ctrl-C at torch.save's third write: its zip writer then raises a RuntimeError
            write, writes = f.write, []

            def write_then_ctrl_c(data):
                writes.append(len(data))
                if len(writes) == 3:
                    signal.raise_signal(signal.SIGINT)
                return write(data)

            f.write = write_then_ctrl_c
        return f

    before = signal.getsignal(signal.SIGINT)
    try:
        stop_on_interrupt(TrainState(step=4), ckpt, 10)
        monkeypatch.setattr(checkpoint, "open", open_then_ctrl_c, raising=False)
        with pytest.raises(Interrupted, match="interrupted at step 4 of 10; the last checkpoint is .*step-000002"):
            save(ckpt, cfg, model, optimizer, 4)
    finally:
        signal.signal(signal.SIGINT, before)
    assert (ckpt.dir / LATEST).read_text().strip() == "step-000002"
