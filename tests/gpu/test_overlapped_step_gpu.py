"""The optimizer step on its own stream (training/overlapped_step.py), on CUDA: each unit's
forward sees its new weights, `wait` makes the whole update visible, and the update is the
plain step's to the bit; then the app with `--optimizer_overlap` against the app without."""

import json

import pytest
import torch
from launch import run_app
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from te_mixtral.config import load_config
from te_mixtral.data.packing import batch_from_windows
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.optim import MasterAdamW
from te_mixtral.training.overlapped_step import OverlappedStep

pytestmark = pytest.mark.cuda
SINGLE = Layout(0, 1, 1, None, None)
MODEL = {"vocab_size": "256", "hidden_size": "64", "intermediate_size": "128", "num_hidden_layers": "3",
         "num_attention_heads": "4", "num_key_value_heads": "2", "head_dim": "16", "num_experts": "4",
         "tokenizer_vocab_size": "256", "seq_len": "64", "batch_size": "2"}
# cycles the update stream idles before each update: far longer than the tiny forward, so a
# forward that did not wait for its unit would read the old weights
DELAY_CYCLES = 20_000_000


def bf16_model(cfg) -> tuple[MixtralForCausalLM, MasterAdamW]:
    model = MixtralForCausalLM(cfg.model, TORCH, SINGLE, LoopTier()).cuda()
    init_weights(model, 3, SINGLE)
    return model, MasterAdamW.from_fp32(model.parameters(), lr=1e-2, moment_dtype=torch.bfloat16)


def test_each_forward_sees_its_units_update_and_wait_shows_the_whole_step():
    cfg = load_config(None, MODEL)
    (plain, plain_opt), (overlapped, overlapped_opt) = bf16_model(cfg), bf16_model(cfg)
    overlap = OverlappedStep(overlapped, overlapped_opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        for p, q in zip(plain.parameters(), overlapped.parameters()):
            p.grad = torch.randn(p.shape, generator=gen).bfloat16().cuda()
            q.grad = p.grad.clone()
        grad_scale = torch.tensor(0.7, device="cuda")
        plain_opt.step(grad_scale=grad_scale)
        with torch.cuda.stream(overlap.stream):
            torch.cuda._sleep(DELAY_CYCLES)
        overlap.step(grad_scale)
        plain_opt.zero_grad(set_to_none=True)
        overlapped_opt.zero_grad(set_to_none=True)
        windows = torch.randint(1, 256, (2, 65), generator=gen)
        batch = batch_from_windows(windows, eos_id=0).to("cuda")
        with torch.no_grad():
            want = plain(batch.input_ids, batch.packed)
            got = overlapped(batch.input_ids, batch.packed)
        assert torch.equal(got, want), f"step {step + 1}: a forward ran before its unit's update"
    with torch.cuda.stream(overlap.stream):
        torch.cuda._sleep(DELAY_CYCLES)
    for p in overlapped.parameters():
        p.grad = torch.ones_like(p)
    for p in plain.parameters():
        p.grad = torch.ones_like(p)
    overlap.step(None)
    plain_opt.step()
    overlap.wait()
    for (name, p), q in zip(plain.named_parameters(), overlapped.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(plain_opt.master(p), overlapped_opt.master(q)), name
        for key, value in plain_opt.state[p].items():
            assert torch.equal(value, overlapped_opt.state[q][key]), (name, key)


def train(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    proc = run_app(["--steps", "6", "--dtype", "bf16", "--optimizer", "master_adamw", "--tier", "loop",
                    "--backend", "torch", "--batch_size", "2", "--eval-fraction", "0.1", "--eval-every", "3",
                    "--checkpoint-dir", str(tmp_path / f"{name}-ckpt"), "--checkpoint-every", "3", "--plots", "false",
                    "--output-dir", str(out), *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def saved(checkpoint: str) -> dict:
    """A checkpoint's weights and optimizer state, read whole."""
    whole = checkpoint + ".pt"
    dcp_to_torch_save(checkpoint, whole)
    return torch.load(whole, weights_only=False)


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from flat(value, f"{prefix}{i}.")
    else:
        yield prefix, tree


def test_the_app_with_optimizer_overlap_trains_and_saves_as_without(tmp_path):
    """The same losses, evaluations and checkpoints, bit for bit, as the run without: a
    checkpoint or an evaluation that read the weights before the update landed would differ.
    A second run without shows that the reference itself repeats to the bit."""
    runs = {name: train(tmp_path, name, *extra) for name, extra in
            [("plain", ()), ("again", ()), ("overlapped", ("--optimizer_overlap", "true"))]}
    checkpoints = {name: {step: dict(flat(saved(str(tmp_path / f"{name}-ckpt" / step))))
                          for step in ("step-000003", "step-000006")} for name in runs}
    assert len(runs["plain"]["evals"]) == 2 and len(checkpoints["plain"]["step-000003"]) > 10
    for name in ("again", "overlapped"):
        assert runs[name]["losses"] == runs["plain"]["losses"], name
        assert runs[name]["evals"] == runs["plain"]["evals"], name
        for step, tensors in checkpoints["plain"].items():
            assert tensors.keys() == checkpoints[name][step].keys()
            for key, want in tensors.items():
                got = checkpoints[name][step][key]
                assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, (name, step, key)
