"""Chat data: rendering, the assistant-only loss mask, packing by conversation, the loss,
bad input, `data.split` on local files, `data.subset`, and one short run on the example.

The references are transformers' own: `apply_chat_template` for the token ids, and its
`return_assistant_tokens_mask` over a copy of the template whose replies are marked with
`{% generation %}`, for the mask. Conversations are made up afresh each run (the seed is
printed).
"""

import json
import random
import re

import datasets
import huggingface_hub
import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import REPO
from launch import assert_one_line_error, run_cli

from te_mixtral.config import DataConfig, load_config
from te_mixtral.data.chat import render_batch
from te_mixtral.data.packing import PackedData
from te_mixtral.data.sources import load_records
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.layers import TORCH
from te_mixtral.model.mixtral import MixtralForCausalLM, causal_lm_loss, init_weights

TOKENIZER = REPO / "examples" / "chat-tokenizer"
EXAMPLE = REPO / "examples" / "chat.jsonl"
REPLY = "{{- ' ' + message['content'] + eos_token }}"
# A ChatML-style template: its assistant header is prompt, not reply.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
          "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture
def rng():
    seed = random.randrange(2**32)
    print(f"random seed {seed}")
    return random.Random(seed)


def random_conversation(rng, words) -> list[dict]:
    """Alternating user/assistant turns, sometimes after a system message, sometimes ending
    on an unanswered user turn; contents with spaces, punctuation and newlines."""
    def text():
        return " ".join(rng.choices(words, k=rng.randint(1, 12))) + rng.choice(["", ".", "?", "\nok", "!"])

    messages = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
    for turn in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": text()})
        messages.append({"role": "assistant", "content": text()})
    if rng.random() < 0.2:
        messages.append({"role": "user", "content": text()})
    return messages


def random_conversations(rng, count):
    words = ["".join(rng.choices("abcdefghijklmnop", k=rng.randint(1, 7))) for _ in range(60)]
    return [random_conversation(rng, words) for _ in range(count)]


def with_generation_marks(template: str) -> str:
    assert REPLY in template
    return template.replace(REPLY, "{% generation %}" + REPLY + "{% endgeneration %}")


def reference(tokenizer, messages, template=None) -> tuple[list[int], list[bool]]:
    """transformers' ids and assistant mask of one conversation."""
    out = tokenizer.apply_chat_template(messages, chat_template=template or with_generation_marks(
        tokenizer.chat_template), return_assistant_tokens_mask=True, return_dict=True)
    return out["input_ids"], [bool(m) for m in out["assistant_masks"]]


def write_chat(path, conversations, field="messages"):
    path.write_text("".join(json.dumps({field: c, "id": i}) + "\n" for i, c in enumerate(conversations)))
    return path


# --- rendering and the mask -------------------------------------------------------------


@pytest.mark.parametrize("template", ["mixtral", "chatml"])
def test_tokens_and_mask_are_the_templates(tokenizer, rng, template):
    conversations = [json.loads(line)["messages"] for line in EXAMPLE.read_text().splitlines()]
    conversations += random_conversations(rng, 30)
    if template == "chatml":
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))
        tokenizer.chat_template = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    rendered = render_batch(tokenizer, conversations, list(range(len(conversations))))
    for messages, ids, trained in zip(conversations, rendered["input_ids"], rendered["trained"]):
        expected_ids, expected_mask = reference(tokenizer, messages, CHATML if template == "chatml" else None)
        assert ids == expected_ids == tokenizer.apply_chat_template(messages)["input_ids"]
        assert trained == expected_mask
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert any(trained) == bool(replies)
        if template == "mixtral":  # " reply</s>" for each reply, nothing else
            trained_text = tokenizer.decode([t for t, keep in zip(ids, trained) if keep])
            assert trained_text == "".join(f" {reply}</s>" for reply in replies)


# --- packing ----------------------------------------------------------------------------


def expected_stream(tokenizer, conversations):
    """The stream built here from transformers' own ids and masks: tokens, conversation
    ends, trained tokens; an unanswered conversation is closed by an untrained eos."""
    tokens, ends, trained = [], [], []
    for messages in conversations:
        ids, mask = reference(tokenizer, messages)
        if ids[-1] != tokenizer.eos_token_id:
            ids, mask = ids + [tokenizer.eos_token_id], mask + [False]
        tokens += ids
        trained += mask
        ends += [False] * (len(ids) - 1) + [True]
    return tokens, ends, trained


def test_packed_chat_keeps_conversation_edges_and_trains_replies_only(tmp_path, tokenizer, rng):
    conversations = random_conversations(rng, 60)
    # A long unanswered prompt fills whole samples that have no target: they are left out.
    conversations.insert(rng.randrange(60), [{"role": "user", "content": "word " * 300}])
    seq_len, batch_size = rng.randint(16, 48), rng.randint(1, 4)
    cfg = DataConfig(dataset=str(write_chat(tmp_path / "c.jsonl", conversations)), format="chat",
                     tokenizer=str(TOKENIZER), seq_len=seq_len)
    packed = PackedData(cfg, batch_size=batch_size, rank=0, world_size=1, seed=rng.randrange(1000))

    tokens, ends, trained = expected_stream(tokenizer, conversations)
    assert packed.stream.tokens.tolist() == tokens
    expected = {}  # sample input row -> (labels, positions), for samples with a target
    for start in range(0, len(tokens) - seq_len, seq_len):
        row = tokens[start : start + seq_len]
        labels = [-100 if ends[j] or not trained[j + 1] else tokens[j + 1] for j in range(start, start + seq_len)]
        positions = [0]
        for j in range(start, start + seq_len - 1):
            positions.append(0 if ends[j] else positions[-1] + 1)
        if any(label != -100 for label in labels):
            expected[tuple(row)] = (labels, positions)
    assert len(packed.train_samples) == len(expected) < packed.num_samples

    seen = set()
    for step in range(packed.steps_per_epoch):
        (batch,) = packed.micro_batches(step)
        cu = batch.packed.cu_seqlens.tolist()
        for b, (row, labels, positions) in enumerate(zip(batch.input_ids.tolist(), batch.labels.tolist(),
                                                         batch.packed.position_ids_BS.tolist())):
            assert (labels, positions) == expected[tuple(row)]
            # Segments start exactly where positions restart: at the sample edge and after each conversation.
            starts = [b * seq_len + s for s, p in enumerate(positions) if p == 0]
            assert [c for c in cu if b * seq_len <= c < (b + 1) * seq_len] == starts
            seen.add(tuple(row))
        assert cu[-1] == batch.num_tokens and batch.packed.max_seqlen == max(b - a for a, b in zip(cu, cu[1:]))
    assert len(expected) - len(seen) < batch_size  # one epoch: every sample but the remainder


def tiny_model():
    cfg = load_config(str(REPO / "configs" / "tiny-chat.yaml"), {"num_hidden_layers": "1"})
    single = Layout(0, 1, 1, None, None)
    model = MixtralForCausalLM(cfg.model, TORCH, single, LoopTier(), "none")
    init_weights(model, 5, single)
    return model


def test_chat_loss_and_gradient_count_assistant_tokens_only(tmp_path, tokenizer, rng):
    conversations = random_conversations(rng, 20)
    cfg = DataConfig(dataset=str(write_chat(tmp_path / "c.jsonl", conversations)), format="chat",
                     tokenizer=str(TOKENIZER), seq_len=32)
    packed = PackedData(cfg, batch_size=4, rank=0, world_size=1, seed=rng.randrange(1000))
    (batch,) = packed.micro_batches(0)
    tokens, ends, trained = expected_stream(tokenizer, conversations)
    logits = tiny_model()(batch.input_ids, batch.packed).detach().requires_grad_()
    targets = (batch.labels != -100).sum()
    loss = causal_lm_loss(logits, batch.labels, targets.double())
    loss.backward()

    # float64, from the stream built from transformers' masks: each row is a window at sample * S.
    where = {tuple(tokens[s : s + 32]): s for s in range(0, len(tokens) - 32, 32)}
    log_probs = logits.detach().double().log_softmax(-1)
    terms, expected_grad, count = [], torch.zeros_like(log_probs), 0
    for b, row in enumerate(batch.input_ids.tolist()):
        start = where[tuple(row)]
        for s in range(32):
            j = start + s
            if not ends[j] and trained[j + 1]:
                terms.append(-log_probs[b, s, tokens[j + 1]])
                expected_grad[b, s] = log_probs[b, s].exp()
                expected_grad[b, s, tokens[j + 1]] -= 1
                count += 1
    assert count == targets > 0
    torch.testing.assert_close(loss.double(), torch.stack(terms).mean(), rtol=1e-6, atol=0)
    torch.testing.assert_close(logits.grad.double(), expected_grad / count, rtol=1e-5, atol=1e-9)
    assert F.cross_entropy(logits.detach().flatten(0, 1), batch.labels.flatten()).isfinite()


def test_tokenized_records_are_cached(tmp_path, tokenizer, rng, monkeypatch):
    path = write_chat(tmp_path / "c.jsonl", random_conversations(rng, 30))
    cfg = DataConfig(dataset=str(path), format="chat", tokenizer=str(TOKENIZER), seq_len=16)
    first = PackedData(cfg, batch_size=2, rank=0, world_size=1, seed=0)

    def no_rendering(*args):
        raise AssertionError("the tokenized records should have come from the cache")

    monkeypatch.setattr("te_mixtral.data.chat.render_batch", no_rendering)
    again = PackedData(cfg, batch_size=2, rank=0, world_size=1, seed=0)
    assert torch.equal(again.stream.tokens, first.stream.tokens)
    assert torch.equal(again.stream.trained, first.stream.trained)
    # Another template is another key: tokenized afresh.
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    with pytest.raises(AssertionError, match="from the cache"):
        PackedData(DataConfig(dataset=str(path), format="chat", tokenizer=str(other), seq_len=16), batch_size=2,
                   rank=0, world_size=1, seed=0)


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("record, message", [
    ({"text": "hello"}, "no field 'messages' (fields: text); set data.messages_field"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "chat record 1, message 0: role 'robot' is not one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "chat record 1, message 0: content must be text"),
    ({"messages": [{"role": "user"}]}, "chat record 1, message 0: content must be text"),
    ({"messages": []}, "chat record 1: messages must be a non-empty list"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "chat record 1: the chat template refuses it: After the optional system message, conversation roles must "
     "alternate"),
], ids=["no-messages", "unknown-role", "content-not-text", "no-content", "empty", "template-refuses"])
def test_bad_chat_records_are_one_line_errors(tmp_path, record, message):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    lines = [json.dumps(good), json.dumps(record)] if "messages" in record else [json.dumps(record)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(dataset=str(tmp_path / "c.jsonl"), format="chat", tokenizer=str(TOKENIZER), seq_len=8)
    with pytest.raises(UserError) as info:
        PackedData(cfg, batch_size=1, rank=0, world_size=1, seed=0)
    assert message in str(info.value) and "\n" not in str(info.value), info.value


@pytest.mark.parametrize("roles", [("user",), ("system",), ("system", "user")])
def test_chat_data_without_an_assistant_turn_is_refused_as_such(tmp_path, roles):
    # Before: "packs into 6 samples ... one global batch needs 4", or 0 samples: the batch
    # size blamed for data that holds nothing to train on.
    path = write_chat(tmp_path / "c.jsonl", [[{"role": role, "content": f"turn {i}"} for role in roles]
                                             for i in range(30)])
    cfg = DataConfig(dataset=str(path), format="chat", tokenizer=str(TOKENIZER), seq_len=8)
    with pytest.raises(UserError, match="has no assistant turn"):
        PackedData(cfg, batch_size=1, rank=0, world_size=1, seed=0)


def test_a_chat_template_failing_in_its_own_code_is_one_line(tmp_path):
    broken = tmp_path / "tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 1 / 0 }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_chat(tmp_path / "c.jsonl", [[{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "yo"}]])
    cfg = DataConfig(dataset=str(path), format="chat", tokenizer=str(broken), seq_len=8)
    with pytest.raises(UserError, match="chat record 0: the chat template fails on it: ZeroDivisionError"):
        PackedData(cfg, batch_size=1, rank=0, world_size=1, seed=0)


def test_named_chat_templates_beside_the_default_leave_the_data_as_the_default_renders_it(tmp_path, rng):
    # transformers v5 saves a tokenizer's named templates (tool use, ...) in additional_chat_templates/
    # and the default in chat_template.jinja; AutoTokenizer then holds them all in a dict. Before:
    # a TypeError traceback from the tokenized data's cache key, which took the template as text.
    path = write_chat(tmp_path / "c.jsonl", random_conversations(rng, 12))
    folder = tmp_path / "tokenizer"
    (folder / "additional_chat_templates").mkdir(parents=True)
    (folder / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(CHATML)

    def stream(tokenizer):
        cfg = DataConfig(dataset=str(path), format="chat", tokenizer=str(tokenizer), seq_len=16)
        return PackedData(cfg, batch_size=1, rank=0, world_size=1, seed=0).stream

    assert set(transformers.AutoTokenizer.from_pretrained(str(folder)).chat_template) == {"default", "tool_use"}
    named, plain = stream(folder), stream(TOKENIZER)
    assert torch.equal(named.tokens, plain.tokens) and torch.equal(named.trained, plain.trained)
    # Named templates and no default: which one renders the data? Refused, naming them.
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(UserError, match=r"^tokenizer \S+ has chat templates named tool_use but no default one"):
        stream(folder)


def test_chat_needs_a_tokenizer_folder_with_a_template(tmp_path):
    path = write_chat(tmp_path / "c.jsonl", [[{"role": "user", "content": "hi"}]])
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    (plain / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "eos_token": "</s>"}))
    # Before, for a folder without tokenizer.json: "Couldn't instantiate the backend tokenizer from one of: ".
    (tmp_path / "bare").mkdir()
    for tokenizer, message in ((plain, "has no chat template"), (plain / "tokenizer.json", "needs a tokenizer folder"),
                               (tmp_path / "bare", "holds no tokenizer.json"),
                               (None, "needs a tokenizer with a chat template")):
        cfg = DataConfig(dataset=str(path), format="chat", tokenizer=tokenizer and str(tokenizer), seq_len=8)
        with pytest.raises(UserError, match=message):
            PackedData(cfg, batch_size=1, rank=0, world_size=1, seed=0)
    with pytest.raises(UserError, match="data.format chat needs a tokenizer"):
        load_config(None, {"format": "chat"})
    with pytest.raises(UserError, match="data.format must be one of text, chat, sharegpt, alpaca"):
        load_config(None, {"format": "openai"})
    # Text records that hold conversations point at data.format.
    with pytest.raises(UserError, match="or data.format chat"):
        load_records(DataConfig(dataset=str(path)))


# --- split and subset -------------------------------------------------------------------


def test_split_slices_local_files_and_refuses_other_names(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = [f"document {i}" for i in range(20)]
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:12]))
    (folder / "b.txt").write_text("\n".join(texts[12:]) + "\n")

    def read(split, **keys):
        return load_records(DataConfig(dataset=str(folder), split=split, **keys))["text"]

    assert read("train") == texts
    assert read("train[:50%]") == texts[:10]  # over the whole folder, not file by file
    assert read("train[15:]+train[:2]") == texts[15:] + texts[:2]
    assert read("train[-5:]", max_documents=3) == texts[15:18]
    embedded = load_records(DataConfig(split="train[:10%]"))["text"]
    assert embedded == load_records(DataConfig())["text"][: len(embedded)] and len(embedded) > 0
    for split in ("train[:0%]", "train[30:]"):  # before: "has no non-empty 'text' records", as if they were blank
        with pytest.raises(UserError, match=re.escape(f"data.split '{split}' selects none of the 20 records")):
            read(split)
    for split in ("test", "validation[:10%]"):
        with pytest.raises(UserError, match=re.escape(f"data.split '{split}'") + ".*one 'train' split") as info:
            read(split)
        assert "\n" not in str(info.value)


def test_subset_and_split_go_to_the_hub(monkeypatch):
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"text": ["one", "two"]})

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network here: the cache alone
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert load_records(DataConfig(dataset="someone/corpus", subset="small", split="test[:5%]"))["text"] == ["one", "two"]
    assert calls == [(("someone/corpus", "small"), {"split": "test[:5%]"})]


# --- end to end -------------------------------------------------------------------------


def test_chat_example_trains_and_exports_its_template(tmp_path):
    """The example config as a newcomer runs it, shortened: the loss falls, and the export
    keeps the chat template."""
    proc = run_cli(["--config", "configs/tiny-chat.yaml", "--steps", "4", "--timing_warmup_steps", "1",
                    "--warmup_steps", "1", "--seq_len", "64", "--output_dir", str(tmp_path / "run"),
                    "--save_hf", str(tmp_path / "hf")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads((tmp_path / "run" / "results.json").read_text())["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert exported.chat_template == transformers.AutoTokenizer.from_pretrained(str(TOKENIZER)).chat_template

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    proc = run_cli(["--config", "configs/tiny-chat.yaml", "--dataset", str(bad), "--output_dir", str(tmp_path / "x")])
    assert_one_line_error(proc, "chat record 0, message 0: role 'bot'")
    assert proc.returncode == 2


def test_no_progress_bars_in_a_log(tmp_path, capfd):
    # stderr here is pytest's capture, not a terminal: as in a log file, `datasets` must not
    # draw its bars (a fresh file, so that it is read and tokenized, not found in a cache).
    path = write_chat(tmp_path / "c.jsonl", random_conversations(random.Random(0), 8))
    PackedData(DataConfig(dataset=str(path), format="chat", tokenizer=str(TOKENIZER), seq_len=16), 1, 0, 1, 0)
    err = capfd.readouterr().err
    assert "tokenizing" not in err and "Generating train split" not in err, err
