"""LoRA (te_mixtral/model/lora.py): our adapted Mixtral equals transformers' Mixtral with PEFT's
LoRA loaded from the adapters we save (logits, loss and the gradients of every A and B, in
float64), a zero B leaves the base model's forward bit for bit, and the frozen base gets no
gradient. PEFT is the independent reference: it adapts transformers' own modules."""

import contextlib

import peft
import pytest
import torch
from hf_reference import random_hf_mixtral
from model.test_hf_parity import random_packed_batch, rel_err
from transformers import MixtralForCausalLM

from te_mixtral.config import LoRAConfig, RunConfig, load_config
from te_mixtral.data.tokenizer import Tokenizer, train_tokenizer
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.loop import LoopTier
from te_mixtral.lora_config import peft_config
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH
from te_mixtral.model.lora import add_adapters, is_adapter_param, lora_adapters
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.model.mixtral import causal_lm_loss
from te_mixtral.training.hf_checkpoint import load_hf_weights, save_hf_checkpoint
from te_mixtral.training.peft_adapters import PREFIX, expert_key, load_adapter, save_adapter

SINGLE = Layout(0, 1, 1, None, None)
VOCAB = 101
ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_up_proj,down_proj"


def hf_checkpoint(folder, dtype=torch.float64):
    # Odd sizes: 6 experts, top-3, GQA ratio 3, a head_dim that is not hidden / heads.
    hf = random_hf_mixtral(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=12, num_local_experts=6,
                           num_experts_per_tok=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf.save_pretrained(folder)
    hf.config._experts_implementation = "eager"  # grouped_mm takes no float64
    return hf.to(dtype)


def adapted(folder, lora: LoRAConfig, tier=None, dtype=torch.float64, seed=7, backend=TORCH):
    """Our model with `folder`'s weights and `lora`'s adapters, B drawn at random (a zero B
    would leave every A without a gradient)."""
    ours = Ours(model_config_from_hf(folder), backend, SINGLE, tier or LoopTier(), frozen_base=True)
    load_hf_weights(ours, folder, SINGLE)
    add_adapters(ours, lora, seed, SINGLE)
    ours.to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    return ours


def small_tokenizer() -> Tokenizer:
    """A tokenizer for the exports, which write one beside the weights."""
    return Tokenizer.wrap(train_tokenizer([f"text number {i}" for i in range(50)], 300), "test")


def run_config(lora: LoRAConfig) -> RunConfig:
    cfg = RunConfig()
    cfg.lora = lora
    return cfg


@pytest.mark.parametrize("lora", [
    LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS),
    LoRAConfig(rank=3, alpha=5.0, rslora=True, targets="v_proj,down_proj"),
    LoRAConfig(rank=2, alpha=2.0, targets="gate_up_proj"),
], ids=["all", "rslora-v-down", "gate-up-only"])
def test_equals_transformers_with_peft_in_float64(tmp_path, lora):
    hf = hf_checkpoint(tmp_path / "base")
    ours = adapted(tmp_path / "base", lora)
    assert save_adapter(ours, tmp_path / "adapter", run_config(lora), SINGLE, small_tokenizer()) == tmp_path / "adapter"
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).to(torch.float64)
    batch = random_packed_batch(VOCAB)
    targets = (batch.labels != -100).sum()

    ours_logits = ours(batch.input_ids, batch.packed)
    ref_logits = reference(input_ids=batch.input_ids, position_ids=batch.packed.position_ids_BS,
                           use_cache=False).logits
    # Not float64's 1e-15: both models normalise and rotate in float32, as HF's numerics do.
    # A wrong scale, target or expert order is off by 1e-2 and more.
    assert rel_err(ours_logits, ref_logits) < 1e-6
    causal_lm_loss(ours_logits, batch.labels, targets).backward()
    causal_lm_loss(ref_logits, batch.labels, targets).backward()

    ref_params = dict(reference.named_parameters())
    adapters = lora_adapters(ours)
    assert len(adapters) == 2 * len(lora.target_list())  # every target, in both layers
    experts = peft_config(run_config(lora))["target_parameters"]
    for weight_name, adapter in adapters.items():
        layer = int(weight_name.split(".")[2])
        if weight_name.endswith(".weight"):  # dense: PEFT's lora_A/B.default of the projection
            stem = PREFIX + weight_name.removesuffix(".weight")
            ref_a, ref_b = (ref_params[f"{stem}.lora_{f}.default.weight"].grad for f in "AB")
        else:
            target = weight_name.rpartition(".")[2]
            ref_a, ref_b = (ref_params[expert_key(layer, target, experts, f"lora_{f}").removesuffix(".weight")
                                       + ".default.weight"].grad for f in "AB")
            num_experts, rank = adapter.A.shape[:2]
            ref_a = ref_a.reshape(num_experts, rank, -1)
            ref_b = ref_b.reshape(ref_b.shape[0], rank, num_experts).permute(2, 0, 1)
        assert ref_a.abs().max() > 0 and ref_b.abs().max() > 0
        assert rel_err(adapter.A.grad, ref_a) < 1e-5, weight_name
        assert rel_err(adapter.B.grad, ref_b) < 1e-5, weight_name
    for name, p in ours.named_parameters():
        assert (p.grad is not None) == is_adapter_param(name), name  # the base is frozen


def test_an_adapter_peft_made_gives_our_model_pefts_logits(tmp_path):
    """The other way round: PEFT's own LoRA on transformers' Mixtral (targets listed in an order
    of their own, rsLoRA, a random B), saved by PEFT, started from by our model (`lora.init`: its
    settings taken from the adapter's config, its weights read by `load_adapter`) gives PEFT's
    logits. A wrong scale, target, expert order or nesting is off by 1e-2 and more."""
    hf = hf_checkpoint(tmp_path / "base", torch.float32)
    made = peft.get_peft_model(hf, peft.LoraConfig(r=3, lora_alpha=5, use_rslora=True,
                                                   target_modules=["o_proj", "k_proj"],
                                                   target_parameters=["mlp.experts.down_proj",
                                                                      "mlp.experts.gate_up_proj"]))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in made.named_parameters():
            if "lora_" in name:  # A as PEFT draws it; B, zero, drawn too
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "lora_B" in name else 0.2))
    made.save_pretrained(tmp_path / "adapter")
    cfg = load_config(None, {"model_path": str(tmp_path / "base"), "lora.init": str(tmp_path / "adapter")})
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.rslora, cfg.lora.targets) == (
        3, 5.0, True, "k_proj,o_proj,gate_up_proj,down_proj")
    ours = Ours(model_config_from_hf(tmp_path / "base"), TORCH, SINGLE, LoopTier(), frozen_base=True)
    load_hf_weights(ours, tmp_path / "base", SINGLE)
    add_adapters(ours, cfg.lora, 0, SINGLE)
    load_adapter(ours, tmp_path / "adapter", cfg, SINGLE)
    ours.to(torch.float64)
    batch = random_packed_batch(VOCAB)
    with torch.no_grad():
        want = made.to(torch.float64)(input_ids=batch.input_ids, position_ids=batch.packed.position_ids_BS,
                                      use_cache=False).logits
        assert rel_err(ours(batch.input_ids, batch.packed), want) < 1e-6


@pytest.mark.parametrize("tier", [LoopTier, CustomGroupedTier])
def test_zero_b_leaves_the_base_forward_bit_for_bit(tmp_path, tier):
    hf_checkpoint(tmp_path)
    base = Ours(model_config_from_hf(tmp_path), TORCH, SINGLE, tier())
    load_hf_weights(base, tmp_path, SINGLE)
    ours = Ours(model_config_from_hf(tmp_path), TORCH, SINGLE, tier())
    load_hf_weights(ours, tmp_path, SINGLE)
    add_adapters(ours, LoRAConfig(rank=4, targets=ALL_TARGETS), 3, SINGLE)
    assert all(adapter.A.abs().max() > 0 for adapter in lora_adapters(ours).values())
    batch = random_packed_batch(VOCAB)
    assert torch.equal(ours(batch.input_ids, batch.packed), base(batch.input_ids, batch.packed))


def test_adapters_do_not_depend_on_the_expert_layout(tmp_path):
    """Each EP rank draws its own experts' adapters: together they are the EP=1 adapters."""
    hf_checkpoint(tmp_path)
    lora = LoRAConfig(rank=2, targets=ALL_TARGETS)
    whole = Ours(model_config_from_hf(tmp_path), TORCH, SINGLE, LoopTier())
    add_adapters(whole, lora, 11, SINGLE)
    for ep_rank in range(2):
        layout = Layout(ep_rank, 2, 2, None, None)
        half = Ours(model_config_from_hf(tmp_path), TORCH, layout, LoopTier())
        add_adapters(half, lora, 11, layout)
        for name, p in half.named_parameters():
            if is_adapter_param(name):
                want = dict(whole.named_parameters())[name]
                if ".experts." in name:
                    want = want.chunk(2)[ep_rank]
                assert torch.equal(p, want), name


def test_merged_export_equals_the_adapted_model(tmp_path):
    """--save-hf of a LoRA run: a plain transformers Mixtral with W + s B A in every adapted
    weight gives the adapted model's logits."""
    hf_checkpoint(tmp_path / "base")
    lora = LoRAConfig(rank=3, alpha=6.0, targets=ALL_TARGETS)
    ours = adapted(tmp_path / "base", lora, dtype=torch.float32)
    save_hf_checkpoint(ours, tmp_path / "merged", SINGLE, torch.float32, small_tokenizer())
    merged = MixtralForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    batch = random_packed_batch(VOCAB)
    with torch.no_grad():
        want = ours(batch.input_ids, batch.packed)
        got = merged(input_ids=batch.input_ids, position_ids=batch.packed.position_ids_BS, use_cache=False).logits
    assert rel_err(got, want) < 1e-5


def test_evaluation_and_generation_apply_no_dropout(tmp_path):
    """With lora.dropout the adapters drop inputs while training only: a held-out loss and a
    generated continuation are the dropout-free model's, and training mode comes back after."""
    from te_mixtral.training.evaluate import evaluate
    from te_mixtral.training.generate import greedy_generate

    hf_checkpoint(tmp_path)
    dropping = adapted(tmp_path, LoRAConfig(rank=4, alpha=8, dropout=0.5, targets=ALL_TARGETS), dtype=torch.float32)
    plain = adapted(tmp_path, LoRAConfig(rank=4, alpha=8, dropout=0.0, targets=ALL_TARGETS), dtype=torch.float32)
    batch = random_packed_batch(VOCAB)
    losses = [evaluate(model, [batch], 1, SINGLE, torch.device("cpu"), contextlib.nullcontext()).loss
              for model in (dropping, dropping, plain)]
    assert losses[0] == losses[1] == pytest.approx(losses[2], rel=1e-6)
    prompt = batch.input_ids[0, :5].tolist()
    tokens = [greedy_generate(model, prompt, 6, None, SINGLE, torch.device("cpu"), contextlib.nullcontext(), 64)
              for model in (dropping, plain)]
    assert tokens[0] == tokens[1]
    assert dropping.training
