"""Our Mixtral equals Hugging Face's: logits, loss and gradients, from a saved HF checkpoint."""

import pytest
import torch
from hf_reference import random_hf_mixtral

from te_mixtral.data.packing import batch_from_windows
from te_mixtral.distributed.layout import Layout
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH, PackedSequences
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.model.mixtral import causal_lm_loss
from te_mixtral.training.hf_checkpoint import load_hf_weights

SINGLE = Layout(0, 1, 1, None, None)
EOS = 0


@pytest.fixture
def hf_and_ours(tmp_path):
    # Odd sizes: 6 experts, top-3, GQA ratio 3, a head_dim that is not hidden / heads.
    hf = random_hf_mixtral(vocab_size=101, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=12, num_local_experts=6,
                           num_experts_per_tok=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf.save_pretrained(tmp_path)
    ours = Ours(model_config_from_hf(tmp_path), TORCH, SINGLE, LoopTier())
    load_hf_weights(ours, tmp_path, SINGLE)
    return hf, ours


def random_packed_batch(vocab: int):
    """Two samples of 24 tokens with documents of random lengths (EOS closes each)."""
    windows = torch.randint(1, vocab, (2, 25))
    windows[torch.rand(windows.shape) < 0.15] = EOS
    return batch_from_windows(windows, EOS)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_logits_loss_and_grads_match_hf(hf_and_ours):
    hf, ours = hf_and_ours
    batch = random_packed_batch(101)
    targets = (batch.labels != -100).sum()

    ours_logits = ours(batch.input_ids, batch.packed)
    hf_logits = hf(input_ids=batch.input_ids, position_ids=batch.packed.position_ids_BS, use_cache=False).logits
    assert rel_err(ours_logits, hf_logits) < 1e-4

    ours_loss = causal_lm_loss(ours_logits, batch.labels, targets)
    hf_loss = causal_lm_loss(hf_logits, batch.labels, targets)
    assert abs(ours_loss.item() - hf_loss.item()) / hf_loss.item() < 1e-5
    ours_loss.backward()
    hf_loss.backward()
    hf_grads = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        hf_name = name if name in hf_grads else name.replace(".mlp.", ".block_sparse_moe.")
        assert rel_err(param.grad, hf_grads[hf_name].grad) < 1e-4, name


def test_documents_do_not_attend_to_each_other(hf_and_ours):
    """A packed document gives the same logits as the document run alone."""
    _, ours = hf_and_ours
    batch = random_packed_batch(101)
    logits = ours(batch.input_ids, batch.packed)
    starts = batch.packed.cu_seqlens.tolist()
    flat_ids = batch.input_ids.flatten()
    for begin, end in zip(starts[:-1], starts[1:]):
        alone = flat_ids[begin:end][None]
        single = PackedSequences(torch.arange(end - begin)[None], torch.tensor([0, end - begin], dtype=torch.int32),
                                 end - begin)
        assert rel_err(logits.flatten(0, 1)[begin:end], ours(alone, single)[0]) < 1e-5
