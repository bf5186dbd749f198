"""Held-out data is fixed and never trained on; greedy generation is transformers' greedy.

(The end-to-end checks, EP=2 eval loss and generation against transformers on an exported
checkpoint, are in test_checkpoint_hf_out.py.)"""

import contextlib

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from te_mixtral.config import DataConfig
from te_mixtral.data.packing import PackedData, held_out_split
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM as Ours
from te_mixtral.training.generate import greedy_generate
from te_mixtral.training.hf_checkpoint import load_hf_weights

SINGLE = Layout(0, 1, 1, None, None)


def test_the_held_out_split_is_fixed_disjoint_and_whole_batches():
    train, held = held_out_split(1000, 0.05, batch_size=8)
    assert len(held) == 48 and len(train) == 952  # 50 rounded down to whole global batches
    assert sorted(torch.cat([train, held]).tolist()) == list(range(1000))
    again_train, again_held = held_out_split(1000, 0.05, batch_size=8)
    assert torch.equal(held, again_held) and torch.equal(train, again_train)
    assert torch.equal(held_out_split(1000, 0.0, 8)[0], torch.arange(1000))  # nothing held out: as before
    with pytest.raises(UserError, match="less than one global batch"):
        held_out_split(100, 0.05, batch_size=8)


@pytest.mark.parametrize("accum", [1, 2])
def test_training_never_reads_a_held_out_sample(accum):
    cfg = DataConfig(seq_len=64, eval_fraction=0.1)
    ranks = [PackedData(cfg, batch_size=4, rank=r, world_size=2, seed=s, grad_accum_steps=accum)
             for r, s in ((0, 1), (1, 1))]
    other_seed = PackedData(cfg, batch_size=4, rank=0, world_size=2, seed=99)
    assert torch.equal(ranks[0].eval_samples, other_seed.eval_samples)  # the seed moves training only

    held_rows = {tuple(row.tolist()) for r in ranks for b in r.eval_batches() for row in b.input_ids}
    assert len(held_rows) == len(ranks[0].eval_samples)  # the ranks' shares: all of it, once
    # No evaluation forward is larger than a training one.
    assert all(len(b.input_ids) == 4 // (2 * accum) for r in ranks for b in r.eval_batches())
    for step in range(ranks[0].steps_per_epoch + 3):  # an epoch and into the next
        for data in ranks:
            assert not {tuple(row.tolist()) for b in data.micro_batches(step) for row in b.input_ids} & held_rows, step


def test_greedy_generation_equals_transformers(tmp_path):
    torch.manual_seed(0)
    hf_cfg = MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, eos_token_id=None, bos_token_id=None,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = MixtralForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = Ours(model_config_from_hf(tmp_path), TORCH, SINGLE, LoopTier())
    load_hf_weights(ours, tmp_path, SINGLE)
    prompt = [5, 17, 3, 42]

    def ours_greedy(eos_id):
        return greedy_generate(ours, prompt, 10, eos_id, SINGLE, torch.device("cpu"), contextlib.nullcontext(), 1024)

    def hf_greedy(eos_id):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=eos_id,
                          pad_token_id=eos_id)
        return out[0, len(prompt):].tolist()

    full = hf_greedy(eos_id=None)
    assert len(full) == 10
    assert ours_greedy(eos_id=-1) == full  # -1: no token stops it
    stop = full[2]  # make the third token the eos: both must stop right after it
    assert ours_greedy(eos_id=stop) == hf_greedy(eos_id=stop) == full[: full.index(stop) + 1]
