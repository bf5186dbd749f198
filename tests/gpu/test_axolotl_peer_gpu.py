"""benchmarks/axolotl_peer.py's model on a CUDA GPU: axolotl's ScatterMoE-LoRA kernels give the
loss and adapter gradients that transformers' own experts give (PEFT adding B A to the stacked
weight), in both of its LoRA forwards: the fused kernel (the tiny config's small experts, fp32,
where its dots run in TF32) and the split one it takes for Mixtral's large experts (one
Mixtral-8x7B layer, bf16 and NF4 bases, where ScatterMoE's error against fp32 is held to that
of transformers' own bf16 run). Each run also counts the experts' calls that reached
ScatterMoE with the adapters in hand: none may fall back to PEFT's merge unseen. Needs the
axolotl copy in .peers/axolotl (scripts/fetch_axolotl.sh), bitsandbytes for the NF4 base."""

import copy
import importlib.util

import pytest
import torch
from conftest import REPO

from benchmarks.axolotl_peer import build_axolotl_model, kernels_file
from benchmarks.peer_workload import random_rows
from benchmarks.peft_peer import packed_row
from te_mixtral.config import load_config

AXOLOTL = REPO / ".peers" / "axolotl"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not kernels_file(AXOLOTL).is_file(),
                       reason="no axolotl copy in .peers/axolotl (scripts/fetch_axolotl.sh makes it)"),
]
needs_bitsandbytes = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                        reason="bitsandbytes is not installed")
TF32_REL_TOL = 1e-2  # TF32 dots (10-bit mantissa) in fp32 models; a wrong layout or scale lands near 1
ERROR_FACTOR = 2.0  # ScatterMoE's bf16 error against fp32, at most this times transformers' own


def build(config: str, base: str, dtype, **overrides: str):
    """The peer's model (no recompute: the kernels are under test) and a packed row of its
    config, with nonzero B (PEFT starts B at zero, which would leave the adapters' term out)."""
    cfg = load_config(str(REPO / config), {"lora.rank": "16", "lora.alpha": "32", **overrides})
    torch.manual_seed(0)
    model = build_axolotl_model(cfg, "cuda", base, AXOLOTL, gradient_checkpointing=False, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    (row,) = random_rows(cfg, 1, cfg.data.seq_len // 4, torch.Generator("cuda").manual_seed(1), "cuda")
    return model, packed_row(row)


def train_once(model, experts: str, batch: dict, autocast: bool) -> dict:
    """Loss and every adapter's gradient (float64) of one forward and backward with the
    experts run by `experts` ("scattermoe", or transformers' "eager" under PEFT's merge); and
    how many expert calls reached ScatterMoE with adapters in hand."""
    hf = model.base_model.model
    hf.set_experts_implementation(experts)
    fused = []
    hooks = [layer.mlp.experts.get_base_layer().register_forward_pre_hook(
        lambda module, args: fused.append(bool(getattr(module, "_scattermoe_lora", None))))
        for layer in hf.model.layers]
    model.zero_grad(set_to_none=True)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    grads = {name: p.grad.double() for name, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss.detach().double(), **grads, "fused calls": sum(fused)}


def rel_err(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


def compare(got: dict, want: dict, tolerance) -> None:
    """Every value of `got` within `tolerance(name)` of `want`'s."""
    for name, value in want.items():
        if name != "fused calls":
            assert torch.isfinite(got[name]).all(), name
            assert rel_err(got[name], value) <= tolerance(name), f"{name}: {rel_err(got[name], value):.2e}"


def test_fused_lora_kernel_matches_transformers_experts_in_fp32():
    """The tiny config's experts (64 x 96) take ScatterMoE's fused LoRA kernel."""
    model, batch = build("configs/tiny.yaml", "bf16", torch.float32)
    want = train_once(model, "eager", batch, autocast=False)
    got = train_once(model, "scattermoe", batch, autocast=False)
    assert want["fused calls"] == 0 and got["fused calls"] == len(model.base_model.model.model.layers)
    compare(got, want, lambda name: TF32_REL_TOL)


def scattermoe_as_close_as_transformers(model, reference, batch: dict) -> None:
    """ScatterMoE's loss and gradients in bf16 (autocast, as the peer trains) within
    ERROR_FACTOR of transformers' own bf16 error, both against `reference` (fp32, the same
    weights) run by transformers."""
    want = train_once(reference, "eager", batch, autocast=False)
    hf_bf16 = train_once(model, "eager", batch, autocast=True)
    got = train_once(model, "scattermoe", batch, autocast=True)
    layers = len(model.base_model.model.model.layers)
    assert (got["fused calls"], hf_bf16["fused calls"]) == (layers, 0)
    compare(got, want, lambda name: max(ERROR_FACTOR * rel_err(hf_bf16[name], want[name]), 1e-3))


MIXTRAL_LAYER = ("configs/mixtral-8x7b-lora.yaml", {"num_hidden_layers": "1", "data.seq_len": "2048"})


def test_split_lora_kernels_match_transformers_experts_at_mixtral_shapes():
    """One Mixtral-8x7B layer (its experts take the split forward), 2048 tokens, bf16 base."""
    config, overrides = MIXTRAL_LAYER
    model, batch = build(config, "bf16", torch.bfloat16, **overrides)
    scattermoe_as_close_as_transformers(model, copy.deepcopy(model).float(), batch)


@needs_bitsandbytes
def test_split_lora_kernels_match_transformers_experts_over_the_nf4_base():
    """The same layer over bitsandbytes' NF4 (ScatterMoE's bitsandbytes path: its Triton NF4
    dequantisation of the routed experts, then the split kernels). The fp32 reference is the
    bf16 build of the same seed with those weights through bitsandbytes' NF4 round trip: the
    values the NF4 base holds (tests/bench/test_axolotl_peer_bench.py checks that it holds
    bitsandbytes' NF4 of the bf16 build's weights)."""
    import bitsandbytes.functional as bnb

    config, overrides = MIXTRAL_LAYER
    model, batch = build(config, "nf4", None, **overrides)
    reference, _ = build(config, "bf16", torch.bfloat16, **overrides)
    with torch.no_grad():
        for layer in reference.base_model.model.model.layers:
            experts = layer.mlp.experts.get_base_layer()
            for weight in [getattr(layer.self_attn, name).get_base_layer().weight
                           for name in ("q_proj", "k_proj", "v_proj", "o_proj")] + [experts.gate_up_proj,
                                                                                     experts.down_proj]:
                weight.copy_(bnb.dequantize_4bit(*bnb.quantize_4bit(weight, compress_statistics=True,
                                                                    quant_type="nf4")))
        adapters = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            if p.requires_grad:
                p.copy_(adapters[name])
    scattermoe_as_close_as_transformers(model, reference.float(), batch)
