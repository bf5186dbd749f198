"""What a forward keeps for the backward on a GPU (TE layers, the custom_grouped kernels),
full fine-tuning and LoRA, against the memory estimate's count (for LoRA, an upper bound);
the held storages are printed by size, which names a tensor the estimate misses."""

import pytest
import torch
from measure.test_memory import held_storages, random_batch, tiny
from measure.test_memory_lora import TARGETS, UPPER_BOUND_SLACK

from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.registry import make_tier
from te_mixtral.model.layers import PackedSequences, resolve_backend
from te_mixtral.model.lora import add_adapters
from te_mixtral.model.mixtral import MixtralForCausalLM, causal_lm_loss, init_weights
from te_mixtral.planning.memory import estimate_memory
from te_mixtral.training.loop import default_dtype

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SINGLE = Layout(0, 1, 1, None, None)
SHAPES = {"hidden_size": "256", "intermediate_size": "512", "num_attention_heads": "4", "num_key_value_heads": "2",
          "head_dim": "64", "vocab_size": "2048", "seq_len": "512", "batch_size": "2", "dtype": "bf16",
          "device": "cuda", "tier": "custom_grouped"}


# One decoder layer of Mixtral-8x7B at a full-model rank's load: one 8192-token sequence.
REAL = dict(SHAPES, hidden_size="4096", intermediate_size="14336", num_attention_heads="32",
            num_key_value_heads="8", head_dim="128", vocab_size="32000", seq_len="8192", batch_size="1",
            num_hidden_layers="1", num_experts="8", max_position_embeddings="8192")


@pytest.mark.parametrize("tier", ["custom_grouped", "device_mxfp8"])
@pytest.mark.parametrize("lora", [None, "all", "experts"])
@pytest.mark.parametrize("shapes", [SHAPES, REAL], ids=["small", "8x7b-layer"])
def test_forward_keeps_what_the_estimate_counts(tier, lora, shapes):
    if tier == "device_mxfp8" and lora is None:
        pytest.skip("full fine-tuning in FP8: tests/gpu/test_device_mxfp8_gpu.py")
    overrides = dict(shapes, tier=tier, optimizer="adamw" if lora else "master_adamw")
    if lora:
        overrides |= {"lora.rank": "16", "lora.targets": TARGETS[lora]}
    cfg = tiny(**overrides)
    backend = resolve_backend("auto", "cuda")
    expert_tier = make_tier(cfg.tier, cfg)
    expert_tier.check_available(torch.device("cuda"))  # device_mxfp8: Hopper's FP8, its frozen base with LoRA
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        model = MixtralForCausalLM(cfg.model, backend, SINGLE, expert_tier, "none", frozen_base=bool(lora))
        init_weights(model, 1, SINGLE)
    if lora:
        add_adapters(model, cfg.lora, 2, SINGLE)
    ids, packed = random_batch(cfg)
    ids, packed = ids.cuda(), packed.to("cuda")

    def forward_loss():  # as the training loop's, on copies of the inputs (tests/measure/test_memory.py)
        copies = PackedSequences(packed.position_ids_BS.clone(), packed.cu_seqlens.clone(), packed.max_seqlen)
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(ids.clone(), copies)
        return causal_lm_loss(logits, ids, torch.tensor(1.0, device="cuda"))

    held = held_storages(model, forward_loss)
    estimate = estimate_memory(cfg, 1, device="cuda").forward_saved
    listing = sorted(held.values(), reverse=True)
    print(f"lora {lora}: measured {sum(listing)}, estimate {estimate}; T={cfg.train.batch_size * cfg.data.seq_len} "
          f"D={cfg.model.hidden_size} F={cfg.model.intermediate_size}; held: {listing[:40]}")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = forward_loss()
    after_forward = torch.cuda.memory_allocated() - before
    loss.backward()
    print(f"    held after forward {after_forward}, fwd+bwd peak above the start "
          f"{torch.cuda.max_memory_allocated() - before}")
    if lora is None:
        assert estimate == pytest.approx(sum(listing), rel=0.05)
    else:  # an upper bound (tests/measure/test_memory_lora.py says why)
        assert sum(listing) <= estimate <= UPPER_BOUND_SLACK * sum(listing)
