"""Build examples/chat-tokenizer: a small Mixtral-style tokenizer with a chat template.

Chat data is rendered with a tokenizer's chat template (te_mixtral/data/chat.py), so the
offline chat example and the tests need a tokenizer that has one. This one is a byte-level
BPE of 1024 tokens, trained on Python's own help topics (pydoc, shipped with every Python)
and examples/chat.jsonl, with Mixtral's special tokens (<s>, </s>) and Mixtral-8x7B-Instruct's
`[INST]` chat template: small enough to ship (tens of KB), built offline.

    python scripts/make_chat_tokenizer.py        # writes examples/chat-tokenizer/

Byte level means any text encodes; the vocabulary is far too small for a real model, which
brings its own tokenizer (`model_path`, or `data.tokenizer` naming its folder).
"""

import json
from pathlib import Path
from pydoc_data.topics import topics

import tokenizers

VOCAB_SIZE = 1024
ROOT = Path(__file__).resolve().parents[1]

# Mixtral-8x7B-Instruct-v0.1's template: an optional system message joins the first user
# turn; user and assistant turns must alternate; each assistant turn ends with eos.
MIXTRAL_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}"
    "{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial "
    "optional system message!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def corpus() -> list[str]:
    chats = [json.loads(line)["messages"] for line in (ROOT / "examples" / "chat.jsonl").read_text().splitlines()]
    turns = [" [INST] " + m["content"] + " [/INST]" if m["role"] != "assistant" else " " + m["content"]
             for messages in chats for m in messages]
    return [topics[name] for name in sorted(topics)] + turns


def build() -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus(), trainer)
    # Like Mixtral's, plain encoding opens a text with <s>; a chat template writes its own.
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    return backend


def main() -> None:
    out = ROOT / "examples" / "chat-tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    build().save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 32768, "chat_template": MIXTRAL_CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
