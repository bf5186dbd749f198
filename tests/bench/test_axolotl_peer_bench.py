"""benchmarks/axolotl_peer.py, the parts that run without a GPU: refusing bad arguments in one
line before importing anything heavy, and refusing a machine without CUDA; the model it builds:
transformers' experts replaced by axolotl's ScatterMoE forward, which receives our adapters in
ScatterMoE's layout at every call; exactly our adapters trained; with `--base nf4`,
bitsandbytes' NF4 where axolotl's QLoRA puts it. axolotl's kernels need CUDA (Triton's
interpreter cannot run them): tests/gpu/test_axolotl_peer_gpu.py checks them against
transformers' experts. The model tests need the axolotl copy in .peers/axolotl
(scripts/fetch_axolotl.sh), and bitsandbytes for the NF4 base; without them they skip."""

import importlib.util
import re

import pytest
import torch
from bench.refusals import refusals
from conftest import REPO

from benchmarks.axolotl_peer import kernels_file
from te_mixtral.config import load_config
from te_mixtral.measure.model_state import count_adapters

TINY = str(REPO / "configs/tiny.yaml")
AXOLOTL = REPO / ".peers" / "axolotl"
needs_axolotl = pytest.mark.skipif(not kernels_file(AXOLOTL).is_file(),
                                   reason="no axolotl copy in .peers/axolotl (scripts/fetch_axolotl.sh makes it)")
HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None
needs_bitsandbytes = pytest.mark.skipif(not HAS_BITSANDBYTES, reason="bitsandbytes is not installed")


@pytest.fixture
def fake_axolotl(tmp_path):
    """A folder that passes the argument check (the kernels' file is there, empty): the
    refusals after it are reached without a copy of axolotl."""
    kernels_file(tmp_path).parent.mkdir(parents=True)
    kernels_file(tmp_path).touch()
    return str(tmp_path)


def test_bad_arguments_are_refused_in_one_line_before_heavy_imports(fake_axolotl):
    here = ["--axolotl-dir", fake_axolotl]
    cases = [
        (["--steps", "5", "--warmup", "5", *here], "--warmup 5 must leave some of the --steps 5 to time"),
        (["--layers", "0", *here], "--layers must be positive, got 0"),
        (["--rank", "0", *here], "--rank must be positive (this peer trains LoRA adapters), got 0"),
        (["--alpha", "-1", *here], "--alpha must be positive, got -1.0"),
        (["--axolotl-dir", "/nonexistent"], "--axolotl-dir /nonexistent holds no copy of axolotl's ScatterMoE "
                                            "kernels: make one with scripts/fetch_axolotl.sh"),
        (["--config", "configs/missing.yaml", *here], "cannot read config configs/missing.yaml"),
    ]
    if not HAS_BITSANDBYTES:
        cases.append((["--base", "nf4", *here], "--base nf4 needs bitsandbytes, which does not import here"))
    answers, imported = refusals("axolotl_peer", [args for args, _ in cases],
                                 ("torch", "transformers", "peft", "axolotl", "bitsandbytes"))
    for (code, stderr), (args, message) in zip(answers, cases):
        assert code == 2 and stderr.startswith(f"axolotl_peer: error: {message}"), (args, stderr)
        assert stderr.count("\n") == 1, (args, stderr)
    assert imported == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_machine_without_cuda_is_refused_in_one_line(fake_axolotl, capsys):
    from benchmarks.axolotl_peer import main

    assert main(["--config", TINY, "--axolotl-dir", fake_axolotl]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("axolotl_peer: error: the axolotl peer (Triton kernels) needs a CUDA GPU, and none "
                                 "is visible\n")


# --- the model it builds


def build(base: str, dtype=None, **overrides: str):
    """The peer's model on the tiny config, in `dtype` (default: bf16 for the NF4 base, which
    bitsandbytes quantises from bf16, as the peer builds it; fp32 for the bf16 base)."""
    from benchmarks.axolotl_peer import build_axolotl_model

    cfg = load_config(TINY, {"lora.rank": "4", "lora.alpha": "8", **overrides})
    torch.manual_seed(0)
    dtype = dtype or (torch.bfloat16 if base == "nf4" else torch.float32)
    return cfg, build_axolotl_model(cfg, "cpu", base, AXOLOTL, dtype=dtype)


class Reached(Exception):
    """Raised where axolotl's experts forward would start: its kernels need CUDA."""


def lora_handed_to_the_kernels(model) -> dict:
    """The adapters axolotl's PEFT hook hands the first layer's experts as it calls them:
    {target: (A, B, scale)} in ScatterMoE's layout. The forward stops there."""
    handed = {}

    def catch(experts, args):
        handed.update(experts._scattermoe_lora)
        raise Reached

    experts = model.base_model.model.model.layers[0].mlp.experts.get_base_layer()
    hook = experts.register_forward_pre_hook(catch)
    try:
        with pytest.raises(Reached):
            model(input_ids=torch.randint(2048, (1, 24)))
    finally:
        hook.remove()
    return handed


@needs_axolotl
@pytest.mark.parametrize("base", ["bf16", pytest.param("nf4", marks=needs_bitsandbytes)])
def test_the_experts_run_axolotls_scattermoe_with_our_adapters_in_its_layout(base):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from benchmarks.axolotl_peer import import_scattermoe

    cfg, model = build(base)
    assert model.base_model.model.config._experts_implementation == "scattermoe"
    assert ALL_EXPERTS_FUNCTIONS["scattermoe"] is import_scattermoe(AXOLOTL).scattermoe_experts_forward
    named = dict(model.named_parameters())
    with torch.no_grad():  # PEFT starts B at zero, which would hide a B in the wrong layout
        for name, p in named.items():
            if "lora_B" in name:
                p.normal_()
    handed = lora_handed_to_the_kernels(model)

    rank, experts = cfg.lora.rank, cfg.model.num_experts
    prefix = "base_model.model.model.layers.0.mlp.experts."
    # PEFT wraps gate_up_proj first (innermost, behind one more base_layer), down_proj around it.
    for target, wrapper in (("gate_up_proj", "base_layer."), ("down_proj", "")):
        a, b, scale = handed[target]
        peft_a, peft_b = named[f"{prefix}{wrapper}lora_A.default.weight"], named[f"{prefix}{wrapper}lora_B.default.weight"]
        assert scale == cfg.lora.alpha / rank
        assert torch.equal(a, peft_a.to(a.dtype))  # [E*r, in], expert-major, as PEFT keeps it
        # ScatterMoE's B is expert-major, [out, E*r]; PEFT's has the expert as the fastest index.
        want_b = peft_b.reshape(-1, rank, experts).transpose(1, 2).reshape(-1, experts * rank)
        assert torch.equal(b, want_b.to(b.dtype))


@needs_axolotl
@pytest.mark.parametrize("base", ["bf16", pytest.param("nf4", marks=needs_bitsandbytes)])
@pytest.mark.parametrize("targets", [None, "k_proj,down_proj"])
def test_the_peer_trains_exactly_our_adapters(base, targets):
    cfg, model = build(base, **({} if targets is None else {"lora.targets": targets}))
    trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    adapter = re.compile(r"base_model\.model\.model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.experts"
                         r"(\.base_layer)*)\.lora_[AB]\.default\.weight")
    assert all(adapter.fullmatch(name) for name in trainable), sorted(trainable)
    assert len(trainable) == cfg.model.num_hidden_layers * len(cfg.lora.target_list()) * 2
    assert sum(trainable.values()) == count_adapters(cfg.model, 1, cfg.lora)


@needs_axolotl
@needs_bitsandbytes
def test_the_nf4_base_is_where_axolotls_qlora_puts_it():
    """Attention's projections bitsandbytes Linear4bit, the expert stacks parametrised, both NF4
    with double quantisation and each bitsandbytes' NF4 of the bf16 model's weight; the
    embeddings, router and lm_head left in bf16."""
    import bitsandbytes as bnb
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    _, bf16 = build("bf16", torch.bfloat16)  # from the same seed: the weights the NF4 build quantises
    _, nf4 = build("nf4")
    before, after = bf16.base_model.model, nf4.base_model.model
    assert type(after.lm_head) is torch.nn.Linear and after.lm_head.weight.dtype == torch.bfloat16
    assert after.model.embed_tokens.weight.dtype == torch.bfloat16
    for old, new in zip(before.model.layers, after.model.layers, strict=True):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(new.self_attn, name).get_base_layer()
            assert isinstance(linear, bnb.nn.Linear4bit) and linear.compute_dtype == torch.bfloat16
            state = linear.weight.quant_state
            assert_nf4_of(bnb.functional.dequantize_4bit(linear.weight.data, state), state,
                          getattr(old.self_attn, name).get_base_layer().weight, quant_storage=torch.bfloat16)
        experts, reference = new.mlp.experts.get_base_layer(), old.mlp.experts.get_base_layer()
        for name in ("gate_up_proj", "down_proj"):
            (parametrization,) = experts.parametrizations[name]
            assert isinstance(parametrization, Bnb4bitParametrization)
            assert_nf4_of(getattr(experts, name), parametrization.quant_state, getattr(reference, name))
        assert new.mlp.gate.weight.dtype == torch.bfloat16 and not new.mlp.gate.weight.requires_grad


def assert_nf4_of(dequantized, state, weight, **storage):
    """`dequantized` (through its quantisation `state`) is bitsandbytes' NF4 of `weight` with
    double quantisation, value for value."""
    import bitsandbytes as bnb

    assert (state.quant_type, state.nested, state.blocksize) == ("nf4", True, 64)
    packed, ours = bnb.functional.quantize_4bit(weight.detach(), compress_statistics=True, quant_type="nf4", **storage)
    assert torch.equal(dequantized, bnb.functional.dequantize_4bit(packed, ours))
