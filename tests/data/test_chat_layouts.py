"""Chat data in community layouts (te_mixtral/data/chat_layouts.py): the shipped ShareGPT and
Alpaca examples, and a layout read through data.messages_field / role_key / content_key /
roles, packed through the real path (`PackedData`), give exactly the token stream and loss
mask of the same conversations in the standard layout (format chat, whose mask
tests/data/test_chat.py holds against transformers'); the mask covers each assistant reply
and its eos, nothing else. Records a layout cannot read are refused in one line."""

import json
import re

import datasets
import pytest
import transformers
from conftest import REPO
from launch import assert_one_line_error, run_cli

from te_mixtral.config import DataConfig, load_config
from te_mixtral.data import chat_layouts
from te_mixtral.data.chat_layouts import MESSAGES
from te_mixtral.data.packing import PackedData
from te_mixtral.errors import UserError

TOKENIZER = str(REPO / "examples" / "chat-tokenizer")
CHAT, SHAREGPT, ALPACA = (REPO / "examples" / name for name in ("chat.jsonl", "chat-sharegpt.jsonl",
                                                                "chat-alpaca.json"))


def stream(dataset, **keys):
    data = PackedData(DataConfig(dataset=str(dataset), tokenizer=TOKENIZER, seq_len=64, **keys), batch_size=1,
                      rank=0, world_size=1, seed=0)
    return data.stream, data.tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def assert_same_stream(got, want):
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.trained.tolist() == want.trained.tolist()
    assert got.lengths.tolist() == want.lengths.tolist()


def test_sharegpt_reads_as_the_same_conversations():
    want, _ = stream(CHAT, format="chat")
    got, _ = stream(SHAREGPT, format="sharegpt")
    assert_same_stream(got, want)


def test_alpaca_is_one_exchange_with_the_input_below_the_instruction(tmp_path):
    rows = json.loads(ALPACA.read_text())
    assert any(row["input"] for row in rows) and any(row.get("system") for row in rows)
    conversations = [([{"role": "system", "content": row["system"]}] if row.get("system") else []) + [
        {"role": "user", "content": row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")},
        {"role": "assistant", "content": row["output"]}] for row in rows]
    want, _ = stream(write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations]), format="chat")
    got, tokenizer = stream(ALPACA, format="alpaca")
    assert_same_stream(got, want)

    # The trained tokens of each record are its reply and the eos that ends it: nothing of the
    # instruction, the input or the system message.
    chat = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    start = 0
    for row, length in zip(rows, got.lengths.tolist()):
        tokens, trained = got.tokens[start:start + length], got.trained[start:start + length]
        assert chat.decode(tokens[trained]) == f" {row['output']}</s>"
        start += length


def test_a_mapped_layout_reads_as_the_same_conversations(tmp_path):
    ours = {"user": "customer", "assistant": "agent", "system": "system"}
    rows = [{"turns": [{"speaker": ours[m["role"]], "text": m["content"]} for m in json.loads(line)["messages"]],
             "source": "made up"} for line in CHAT.read_text().splitlines()]
    got, _ = stream(write_jsonl(tmp_path / "mapped.jsonl", rows), format="chat", messages_field="turns",
                    role_key="speaker", content_key="text", roles="customer:user, agent:assistant")
    assert_same_stream(got, stream(CHAT, format="chat")[0])


@pytest.mark.parametrize("fmt, keys, row, fragment", [
    ("sharegpt", {}, {"messages": []}, "no field 'conversations' (fields: messages); for another layout of "
                                       "conversations use data.format chat with data.messages_field"),
    ("alpaca", {}, {"instruction": "x"}, "no field 'output' (fields: instruction)"),
    ("sharegpt", {}, {"conversations": [{"from": "human", "text": "hi"}]},
     "chat record 0, message 0: no 'from' and 'value' keys"),
    ("sharegpt", {}, {"conversations": [{"from": "bot", "value": "hi"}]},
     "chat record 0, message 0: role 'bot' is none of human, gpt, system"),
    ("sharegpt", {}, {"conversations": "hi"}, "chat record 0: 'conversations' must be a list of messages"),
    ("chat", {"roles": "human=user"}, {"messages": []}, "data.roles: 'human=user' is not THEIRS:OURS"),
    ("chat", {"roles": "human:person"}, {"messages": []}, "data.roles: 'human:person' is not THEIRS:OURS"),
    ("alpaca", {}, {"instruction": "x", "input": "", "output": 3}, "alpaca record 0: 'output' must be text"),
    ("alpaca", {}, {"instruction": "x", "input": None, "output": None}, "alpaca record 0: 'output' is null"),
    ("alpaca", {}, {"instruction": None, "output": "y"}, "alpaca record 0: 'instruction' is null"),
])
def test_records_a_layout_cannot_read_are_refused_naming_them(tmp_path, fmt, keys, row, fragment):
    data = write_jsonl(tmp_path / "data.jsonl", [row])
    with pytest.raises(UserError, match=re.escape(fragment)):
        stream(data, format=fmt, **keys)


def test_mapping_keys_belong_to_format_chat():
    with pytest.raises(UserError, match="data.role_key maps the messages of data.format chat; the other formats "
                                        "read their own layout"):
        load_config(None, {"format": "sharegpt", "role_key": "from", "tokenizer": TOKENIZER})


def test_an_alpaca_run_trains_from_the_command_line(tmp_path):
    proc = run_cli(["--config", "configs/tiny-chat.yaml", "--format", "alpaca", "--dataset", str(ALPACA),
                    "--steps", "2", "--timing_warmup_steps", "0", "--output-dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = json.loads((tmp_path / "run" / "results.json").read_text())["losses"]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
    assert_one_line_error(run_cli(["--config", "configs/tiny-chat.yaml", "--format", "sharegpt", "--steps", "1",
                                   "--output-dir", str(tmp_path / "bad")]), "no field 'conversations'")


def test_converted_records_are_cached_under_the_conversion_recipe(tmp_path, monkeypatch):
    """`datasets` names a map by its function's module and name, not its code: a conversion
    changed in a later te_mixtral would be handed the records an older one converted. The
    recipe in the cache key is what a change of conversion bumps: under the same recipe the
    cache answers (the hazard), under a new one the new conversion runs."""
    data = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "x", "input": "", "output": "y"}])
    source = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(tmp_path / "cache"))

    def reply(records):
        return [messages[-1]["content"] for messages in records[MESSAGES]]

    assert reply(chat_layouts.alpaca_as_messages(source)) == ["y"]
    def changed(read, *batch):
        return {MESSAGES: [[{"role": "user", "content": "x"}, {"role": "assistant", "content": "changed"}]]}

    monkeypatch.setattr(chat_layouts, "_alpaca", changed)
    assert reply(chat_layouts.alpaca_as_messages(source)) == ["y"]  # the cache, not the new code
    monkeypatch.setattr(chat_layouts, "LAYOUTS_RECIPE", "layouts-next")
    assert reply(chat_layouts.alpaca_as_messages(source)) == ["changed"]
