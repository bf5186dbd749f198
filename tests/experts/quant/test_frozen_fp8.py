"""quant/frozen_fp8.py on the CPU: a LoRA base held in FP8 alone fills from checkpoints and
seeded draws row block by row block, counts as the model's weights, stays out of the state
dict, and exports merged. Its MLP runs in Triton's interpreter (test_fp8_hopper.py) and on
the GPU (tests/gpu/test_lora_gpu.py)."""

import pytest
import torch
from model.test_lora import ALL_TARGETS, SINGLE, hf_checkpoint

from te_mixtral.config import LoRAConfig, ModelConfig
from te_mixtral.data.tokenizer import Tokenizer, train_tokenizer
from te_mixtral.errors import Diverged, TierUnavailable
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.experts.loop import LoopTier
from te_mixtral.experts.quant.fp8_hopper import quantize_rowwise
from te_mixtral.experts.quant.fp8_swiglu import FP8SwiGLUExperts
from te_mixtral.experts.quant.frozen import FrozenWeight
from te_mixtral.experts.quant.frozen_fp8 import FrozenFP8Weight
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH
from te_mixtral.model.lora import add_adapters, base_weights, merged
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.training.hf_checkpoint import load_hf_weights, save_hf_checkpoint

E4M3_HALF_ULP = 2.0**-4  # E4M3 keeps 3 mantissa bits


def fp8_base_tier() -> DeviceMXFP8Tier:
    """The tier as check_available leaves it on a Hopper GPU, with LoRA's frozen base: the
    storage is what is tested here, and it needs no GPU."""
    tier = DeviceMXFP8Tier("fp8-hopper")
    tier.mode, tier._runner = "fp8-hopper", FP8SwiGLUExperts()
    return tier


def test_rows_fill_from_tensors_and_from_seeded_draws():
    gen = torch.Generator().manual_seed(3)
    weight = FrozenFP8Weight((3, 8, 16))
    rows = torch.randn(4, 16, generator=gen) * torch.rand(4, 1, generator=gen)
    weight[1, 2:6].copy_(rows)
    values, scale = quantize_rowwise(rows)
    assert weight.values.dtype == torch.float8_e4m3fn and weight.numel() == 3 * 8 * 16
    assert torch.equal(weight.values[1, 2:6].float(), values.float()) and torch.equal(weight.scale[1, 2:6], scale)
    err = (weight.dequantized()[1, 2:6] - rows).abs() / rows.abs().amax(-1, keepdim=True)
    assert err.max() <= E4M3_HALF_ULP and err.max() > 0

    # A seeded draw is the draw a base in `source_dtype` would make, quantised.
    with pytest.raises(ValueError, match="cannot fill FP8 rows of shape"):
        weight[0].copy_(torch.zeros(8, 15))
    weight[2].normal_(0.0, 0.02, generator=torch.Generator().manual_seed(5))
    drawn = torch.empty(8, 16, dtype=weight.source_dtype).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(5))
    assert torch.equal(weight.values[2].float(), quantize_rowwise(drawn)[0].float())


def test_only_fp8_hopper_holds_a_frozen_base():
    tier = DeviceMXFP8Tier("mxfp8-emulated")
    tier.check_available(torch.device("cpu"))
    with pytest.raises(TierUnavailable, match="runs LoRA over a frozen FP8 base in mode fp8-hopper"):
        tier.expert_weight((2, 4, 8), frozen=True)
    assert isinstance(DeviceMXFP8Tier("fp8-hopper").expert_weight((2, 4, 8)), torch.nn.Parameter)
    assert isinstance(fp8_base_tier().expert_weight((2, 4, 8), frozen=True), FrozenFP8Weight)


def test_a_seeded_fp8_base_is_the_seeded_bf16_base_quantised():
    """What makes the FP8 and BF16 bases of one seed comparable on one run."""
    assert_seeded_base_is_bf16_quantised(fp8_base_tier(), quantize_rowwise)


def assert_seeded_base_is_bf16_quantised(tier, quantize) -> None:
    """A tiny model over `tier`'s frozen quantised base and one over a BF16 base, from one
    seed: every quantised stack holds `quantize` of the BF16 one, every other weight is equal."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)
    built = {}
    for name, each in (("bf16", LoopTier()), ("quantised", tier)):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = MixtralForCausalLM(cfg, TORCH, SINGLE, each, frozen_base=True)
        finally:
            torch.set_default_dtype(torch.float32)
        init_weights(model, 11, SINGLE)
        built[name] = base_weights(model)
    assert built["bf16"].keys() == built["quantised"].keys()
    stacks = 0
    for name, weight in built["quantised"].items():
        if isinstance(weight, FrozenWeight):
            stacks += 1
            for got, want in zip(weight.parts(), quantize(built["bf16"][name])):
                assert torch.equal(got.float(), want.float()), name
        else:
            assert torch.equal(weight, built["bf16"][name]), name
    assert stacks == 2 * cfg.num_hidden_layers


def test_a_checkpoint_loads_into_an_fp8_base_which_exports_merged(tmp_path):
    """A Hugging Face checkpoint read into the FP8 base (its per-expert w1, w3, w2 into their
    rows), the adapters beside it; the FP8 values are not in the state dict (a checkpoint
    holds the adapters), the weight count is the model's, and --save-hf writes the
    dequantised base with the adapters merged."""
    hf = hf_checkpoint(tmp_path / "base", dtype=torch.float32)
    lora = LoRAConfig(rank=3, alpha=6.0, targets=ALL_TARGETS)
    ours = MixtralForCausalLM(model_config_from_hf(tmp_path / "base"), TORCH, SINGLE, fp8_base_tier(), frozen_base=True)
    load_hf_weights(ours, tmp_path / "base", SINGLE)
    add_adapters(ours, lora, 7, SINGLE)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".B"):
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))

    assert_loads_and_exports_merged(ours, hf, tmp_path / "merged", quantize_rowwise)


def export(ours, folder) -> None:
    tokenizer = Tokenizer.wrap(train_tokenizer([f"text number {i}" for i in range(50)], 300), "test")
    save_hf_checkpoint(ours, folder, SINGLE, torch.float32, tokenizer)


def assert_loads_and_exports_merged(ours, hf, folder, quantize) -> None:
    """`ours`, a checkpoint read into a frozen quantised base with adapters: its weight count
    is the checkpoint's, its quantised parts are not in the state dict, layer 1's gate_up
    holds `quantize` of the checkpoint's, and --save-hf writes the dequantised base with the
    adapters merged and the rest as it was."""
    weights = base_weights(ours)
    reference = dict(hf.named_parameters())
    assert sum(w.numel() for name, w in weights.items() if ".adapters." not in name) == hf.num_parameters()
    stack = weights["model.layers.1.mlp.experts.gate_up_proj"]
    assert not any(name.endswith(tuple(f".{part}" for part in stack.part_names)) for name in ours.state_dict())
    want = quantize(reference["model.layers.1.mlp.experts.gate_up_proj"].detach())
    assert all(torch.equal(got.float(), part.float()) for got, part in zip(stack.parts(), want))

    export(ours, folder)
    from safetensors.torch import load_file

    exported = {}
    for file in folder.glob("*.safetensors"):
        exported.update(load_file(file))
    adapter = ours.model.layers[1].mlp.experts.adapters["down_proj"]
    down = merged(weights["model.layers.1.mlp.experts.down_proj"].dequantized(), adapter.A, adapter.B, adapter.scale)
    for expert in range(down.shape[0]):
        assert torch.equal(exported[f"model.layers.1.block_sparse_moe.experts.{expert}.w2.weight"], down[expert])
    assert torch.equal(exported["model.norm.weight"], reference["model.norm.weight"].detach())


def test_a_non_finite_fp8_base_is_not_exported(tmp_path):
    """A NaN in a checkpoint's expert row makes that row's scale NaN: the export refuses, as
    for any weight that is not finite."""
    hf_checkpoint(tmp_path / "base", dtype=torch.float32)
    ours = MixtralForCausalLM(model_config_from_hf(tmp_path / "base"), TORCH, SINGLE, fp8_base_tier(), frozen_base=True)
    load_hf_weights(ours, tmp_path / "base", SINGLE)
    row = torch.randn(40)  # a row of down [L, D, F]: F wide
    row[3] = float("nan")
    ours.model.layers[0].mlp.experts.down_proj[2, 5:6].copy_(row[None])
    with pytest.raises(Diverged, match="the weights are not finite"):
        export(ours, tmp_path / "merged")
