"""The model and the app on CUDA: HF parity in bf16, tier agreement, EP=2 over NCCL."""

import json

import pytest
import torch
from launch import run_app
from transformers import MixtralConfig, MixtralForCausalLM

from te_mixtral.data.packing import batch_from_windows
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TE, TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.te_support import te_available
from te_mixtral.training.hf_checkpoint import load_hf_weights

pytestmark = pytest.mark.cuda
SINGLE = Layout(0, 1, 1, None, None)
BATCHES = 8
BACKENDS = [TORCH] + ([TE] if te_available() else [])


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_hf_parity_bf16(backend, tmp_path):
    """Our bf16 logits are about as close to HF's fp32 logits as HF's own bf16 logits are.

    Both errors vary with the random model and tokens, most on the TE path, whose fused
    attention and norms round differently: one batch made the ratio swing enough to be
    flaky, so both errors are averaged over several batches, and the bound leaves room
    above the ratios seen (measured: docs/results/2026-11-21-checks-behind-tolerances.md).
    """
    cfg = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_local_experts=6,
                        num_experts_per_tok=3, attn_implementation="sdpa")
    hf = MixtralForCausalLM(cfg).cuda().eval()
    hf.save_pretrained(tmp_path)
    with torch.device("cuda"):
        ours = Ours(model_config_from_hf(tmp_path), backend, SINGLE, LoopTier()).eval()
    load_hf_weights(ours, tmp_path, SINGLE)
    hf_error = ours_error = 0.0
    for _ in range(BATCHES):
        windows = torch.randint(1, 512, (2, 257))
        windows[torch.rand(windows.shape) < 0.01] = 0
        batch = batch_from_windows(windows, 0).to("cuda")

        def hf_logits():
            return hf(input_ids=batch.input_ids, position_ids=batch.packed.position_ids_BS, use_cache=False).logits

        with torch.no_grad():
            reference = hf_logits()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hf_bf16, ours_bf16 = hf_logits(), ours(batch.input_ids, batch.packed)
        hf_error += rel_err(hf_bf16, reference) / BATCHES
        ours_error += rel_err(ours_bf16, reference) / BATCHES
    assert ours_error < 2 * hf_error, (ours_error, hf_error)
    assert ours_error < 3e-2, ours_error


def train(tmp_path, name, tier, nproc=1, *extra):
    out = tmp_path / name
    proc = run_app(["--tier", tier, "--steps", "10", "--timing_warmup_steps", "2", "--seq_len", "256",
                    "--output-dir", str(out), *extra], nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out / "results.json", proc.stdout


@pytest.mark.skipif(not te_available(), reason="needs Transformer Engine")
def test_grouped_linear_matches_loop_over_10_steps(tmp_path):
    reference, _ = train(tmp_path, "loop", "loop")
    _, stdout = train(tmp_path, "grouped_linear", "grouped_linear", 1, "--loss-check", str(reference))
    assert "loss check passed" in stdout


@pytest.mark.multigpu
@pytest.mark.parametrize("sharding", ["none", "fsdp"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ep2_over_nccl_equals_ep1(tmp_path, precision, sharding):
    # fp32 on the PyTorch backend (TE's fused attention has no fp32) must agree to rounding;
    # bf16 on the default backend (with the bf16-master optimizer under fsdp) within the bf16
    # loss tolerance. `none` sums the dense gradients in overlapped buckets (distributed/
    # overlap.py); `fsdp` shards them and their optimizer state with FSDP2.
    extra = ["--batch_size", "2"] + (["--dtype", "fp32", "--backend", "torch"] if precision == "fp32" else [])
    if precision == "bf16" and sharding == "fsdp":
        extra += ["--optimizer", "master_adamw"]
    ep1, _ = train(tmp_path, "ep1", "loop", 1, *extra)
    ep2, _ = train(tmp_path, "ep2", "loop", 2, "--ep-size", "2", "--sharding", sharding, *extra)
    losses1, losses2 = (json.loads(p.read_text())["losses"] for p in (ep1, ep2))
    if precision == "fp32":
        for a, b in zip(losses2, losses1):
            assert abs(a - b) / b < 1e-5, (losses2, losses1)
    else:  # bf16: the first step is the forward alone; later steps drift apart chaotically
        assert abs(losses2[0] - losses1[0]) / losses1[0] < 1e-3, (losses2, losses1)
        assert abs(sum(losses2) - sum(losses1)) / sum(losses1) < 3e-2, (losses2, losses1)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="fp8-hopper needs a Hopper GPU")
def test_fp8_hopper_trains_like_loop_at_ep2_under_fsdp(tmp_path):
    """The FP8 tier over NCCL with FSDP2 (experts gathered for each forward, parameters
    written by the sharded optimizer, its FP8 weight copies refilled after every step, which
    tests/experts/quant/test_fp8_hopper.py checks on its own) trains within the 8-bit loss
    bounds of `loop` in the same layout."""
    extra = ["--batch_size", "2", "--optimizer", "master_adamw", "--lr", "3e-3"]
    reference, _ = train(tmp_path, "loop", "loop", 2, "--ep-size", "2", "--sharding", "fsdp", *extra)
    _, stdout = train(tmp_path, "fp8", "device_mxfp8", 2, "--ep-size", "2", "--sharding", "fsdp",
                      "--fp8.min_rows_per_expert", "0", "--loss-check", str(reference), *extra)
    assert "fp8-rowwise" in stdout and "loss check passed" in stdout, stdout[-3000:]


@pytest.mark.skipif(not te_available(), reason="needs Transformer Engine")
def test_te_rotary_equals_the_float32_rotary_over_packed_documents():
    """TE's fused RoPE, which finds each document's positions from cu_seqlens, rotates as the
    PyTorch path does from the position ids: forward and gradient within bf16 rounding of a
    float64 reference, on rows of several documents (positions off by one are 0.2 off, and
    positions that do not restart at each document 0.9)."""
    from te_mixtral.model.layers import TERotary, TorchRotary

    windows = torch.randint(1, 512, (2, 1025))
    windows[torch.rand(windows.shape) < 0.01] = 0
    packed = batch_from_windows(windows, 0).packed.to("cuda")
    assert packed.cu_seqlens.numel() > 4  # documents start inside the rows
    head_dim = 128
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cuda") / head_dim))
    x = torch.randn(2, 1024, 8, head_dim, device="cuda").to(torch.bfloat16)
    grad_out = torch.randn_like(x)

    cos, sin = (t.double() for t in TorchRotary.tables(inv_freq, packed))
    x64 = x.double().requires_grad_()
    first, second = x64.chunk(2, dim=-1)
    reference = x64 * cos + torch.cat((-second, first), dim=-1) * sin
    reference.backward(grad_out.double())

    errors = {}
    for rotary in (TorchRotary, TERotary):
        xr = x.clone().requires_grad_()
        out = rotary.apply(xr, rotary.tables(inv_freq, packed), packed)
        out.backward(grad_out)
        errors[rotary.__name__] = (rel_err(out, reference), rel_err(xr.grad, x64.grad))
    for te_error, torch_error in zip(errors["TERotary"], errors["TorchRotary"], strict=True):
        assert te_error < 2 * torch_error + 1e-4, errors
        assert te_error < 5e-3, errors
