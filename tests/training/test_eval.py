"""Held-out data is fixed and never trained on; a chat run prompts its generation as a user turn.

(The end-to-end checks, EP=2 eval loss and generation against transformers on an exported
checkpoint, are in test_checkpoint_hf_out.py; greedy generation itself in test_generate.py.)"""

import json
from dataclasses import replace

import pytest
import torch
from conftest import REPO

from te_mixtral.config import DataConfig
from te_mixtral.data.formats import FORMATS
from te_mixtral.data.packing import PackedData, held_out_records
from te_mixtral.errors import UserError
from te_mixtral.training.generate import encode_prompt


def test_the_held_out_records_are_a_fixed_share_of_the_records():
    held = held_out_records(1000, 0.05)
    assert held.sum() == 50 and torch.equal(held, held_out_records(1000, 0.05))  # the data alone decides
    assert held_out_records(30, 0.2).sum() == 6  # a share of what people count: their records
    assert held_out_records(17, 0.05).sum() == 1  # rounded, at least one
    assert not held_out_records(1000, 0.0).any()  # nothing held out: training is as before
    with pytest.raises(UserError, match="0.5 of 1 conversations leaves none to train on"):
        held_out_records(1, 0.5, "conversations")


CHAT = DataConfig(dataset=str(REPO / "examples" / "chat.jsonl"), format="chat",
                  tokenizer=str(REPO / "examples" / "chat-tokenizer"), seq_len=128, eval_fraction=0.05)


def test_a_share_of_a_small_chat_file_is_held_out_by_conversation():
    # The README's fine-tune: 40 conversations pack into fewer samples than 5 % makes one
    # global batch of; 5 % of the conversations is two of them.
    data = PackedData(CHAT, batch_size=4, rank=0, world_size=1, seed=0)
    everything = PackedData(replace(CHAT, eval_fraction=0.0), batch_size=4, rank=0, world_size=1, seed=0)
    assert len(data.eval_stream.lengths) == 2 + 1  # two conversations and the padding
    held = int(data.eval_stream.lengths[:2].sum())
    assert len(data.stream.tokens) + held == len(everything.stream.tokens)
    # Every held-out target is scored once, padding never is.
    trained = data.eval_stream.trained[:held] & ~data.eval_stream.ends[:held].roll(1)
    assert sum(int((b.labels != -100).sum()) for b in data.eval_batches()) == int(trained[1:].sum())


def test_held_out_records_with_nothing_to_score_are_refused(tmp_path):
    # Before: the run trained, then evaluated 0 targets: loss and perplexity nan, exit 0.
    records = (REPO / "examples" / "chat.jsonl").read_text().splitlines()
    for i in held_out_records(len(records), 0.025).nonzero().flatten().tolist():
        records[i] = json.dumps({"messages": [{"role": "user", "content": "A question nobody answers?"}]})
    (tmp_path / "c.jsonl").write_text("\n".join(records) + "\n")
    cfg = replace(CHAT, dataset=str(tmp_path / "c.jsonl"), eval_fraction=0.025)
    with pytest.raises(UserError, match="the 1 conversations held out .* hold no target token"):
        PackedData(cfg, batch_size=4, rank=0, world_size=1, seed=0)


@pytest.mark.parametrize("accum", [1, 2])
def test_training_never_reads_a_held_out_record(accum):
    cfg = DataConfig(seq_len=64, eval_fraction=0.1)
    ranks = [PackedData(cfg, batch_size=4, rank=r, world_size=2, seed=1, grad_accum_steps=accum) for r in (0, 1)]
    other = PackedData(cfg, batch_size=8, rank=0, world_size=1, seed=99)
    held = int(ranks[0].eval_stream.lengths[:-1].sum())  # the held-out documents, less the padding
    # Not the seed, the world size nor the batch size decide which documents are held out.
    assert torch.equal(ranks[0].eval_stream.tokens[:held], other.eval_stream.tokens[:held])

    held_rows = [tuple(row.tolist()) for r in ranks for b in r.eval_batches() for row in b.input_ids]
    assert len(held_rows) == len(ranks[0].eval_samples)  # the ranks' shares: all of it, once
    # No evaluation forward is larger than a training one.
    assert all(len(b.input_ids) == 4 // (2 * accum) for r in ranks for b in r.eval_batches())
    everything = PackedData(replace(cfg, eval_fraction=0.0), batch_size=4, rank=0, world_size=1, seed=1)
    assert len(ranks[0].stream.tokens) + held == len(everything.stream.tokens)
    # Training reads the training stream alone, and no held-out document is in it.
    first_held = ranks[0].eval_stream.tokens[: ranks[0].eval_stream.lengths[0]].tolist()
    train = ranks[0].stream.tokens.tolist()
    assert not any(train[i : i + len(first_held)] == first_held for i in range(len(train) - len(first_held) + 1))


def test_a_chat_run_prompts_as_a_user_turn():
    # As transformers' users prompt a chat model: the template's user turn, then the header
    # of the reply, with no special token added on top.
    tokenizer = FORMATS["chat"].tokenizer(CHAT, [])
    turn = [{"role": "user", "content": "What is a list?"}]
    expected = tokenizer.chat.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert encode_prompt(tokenizer, "What is a list?", 1024, 32) == expected
    assert tokenizer.chat.decode(expected).endswith("[/INST]")
    with pytest.raises(UserError, match="the generate prompt is blank"):  # before: an empty user turn, answered
        encode_prompt(tokenizer, "", 1024, 32)
    text = replace(tokenizer, chat=None)  # the same tokenizer in a text run: the prompt as it is
    assert encode_prompt(text, "What is a list?", 1024, 32) == tokenizer.backend.encode("What is a list?").ids
