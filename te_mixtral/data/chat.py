"""Chat data: conversations rendered with the tokenizer's chat template, loss on the
assistant's tokens only.

A chat record holds a list of messages, `{"role": "system" | "user" | "assistant",
"content": "..."}` (the `messages` column of a JSONL file or of a hub data set such as
HuggingFaceH4/ultrachat_200k). A model fine-tuned on chat must see its conversations exactly
as it will see them in use, so the text is the tokenizer's own chat template's rendering
(`transformers`' `apply_chat_template`), and the token ids are that text tokenized without
added special tokens: what `apply_chat_template(messages)` returns.

The loss mask
-------------
Only the assistant's replies are trained on; the prompt (system and user turns, the
template's markup) is context. Where a reply lies in the rendered text is found from the
template itself, by rendering prefixes of the conversation: reply i spans from the end of
`render(messages[:i], add_generation_prompt=True)` (the conversation so far, and the header
that opens an assistant turn, when the template has one) to the end of
`render(messages[:i+1])`. For Mixtral's `[INST]` template that is " reply</s>": the reply
and the eos that ends it, so the model learns to stop. A token is trained when it starts
inside such a span (offsets of the fast tokenizer).

Pitfall: this needs a template whose rendering of a conversation's start is a prefix of the
rendering of the whole; a template that rewrites earlier turns (some drop the reasoning of
earlier replies) is refused in one line rather than masked wrongly. Templates that mark
replies with `{% generation %}` agree with this mask (tests/data/test_chat.py checks it
against `return_assistant_tokens_mask`).
"""

from pathlib import Path

import jinja2
import transformers

from te_mixtral.errors import UserError, first_line

ROLES = ("system", "user", "assistant")


def load_chat_tokenizer(folder: str | None) -> transformers.PreTrainedTokenizerBase:
    """The fast tokenizer in `folder` (tokenizer.json and tokenizer_config.json, as a Hugging
    Face checkpoint has them), which must carry a chat template."""
    if folder is None:
        raise UserError("chat data needs a tokenizer with a chat template: set data.tokenizer to its folder "
                        "(e.g. examples/chat-tokenizer) or model_path to a checkpoint that has one")
    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"chat data needs a tokenizer folder (tokenizer.json and tokenizer_config.json with a "
                        f"chat_template), got {folder}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds for a folder it cannot read
        if not (path / "tokenizer.json").is_file():  # its own message then lists the files it looked for, over lines
            raise UserError(f"tokenizer folder {path} holds no tokenizer.json: chat data needs a fast tokenizer") from None
        raise UserError(f"cannot read tokenizer folder {path}: {first_line(e)}") from None
    if not tokenizer.is_fast:
        raise UserError(f"tokenizer {path} is not a fast tokenizer (no tokenizer.json)")
    if not tokenizer.chat_template:
        raise UserError(f"tokenizer {path} has no chat template (tokenizer_config.json's chat_template or "
                        f"chat_template.jinja): chat data is rendered with it")
    # Named templates (additional_chat_templates/NAME.jinja) come as a dict, beside the default.
    if isinstance(tokenizer.chat_template, dict) and "default" not in tokenizer.chat_template:
        raise UserError(f"tokenizer {path} has chat templates named {', '.join(sorted(tokenizer.chat_template))} but "
                        f"no default one (chat_template.jinja), which chat data is rendered with")
    return tokenizer


def _checked(messages, record: int) -> list[dict]:
    """The messages of record `record`, each {role, content}, or a one-line UserError.
    Keys that hold None are dropped: `datasets` fills a key missing from some messages with
    None, and templates handle a missing key but not a None."""
    where = f"chat record {record}"
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r:.80}")
    checked = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(f"{where}, message {j}: not a {{role, content}} mapping: {message!r:.80}")
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("role") not in ROLES:
            raise UserError(f"{where}, message {j}: role {message.get('role')!r} is not one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise UserError(f"{where}, message {j}: content must be text, got {message.get('content')!r:.80}")
        checked.append(message)
    return checked


def _render(tokenizer, messages: list[dict], where: str, **kwargs) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.TemplateError as e:  # the template's own raise_exception, e.g. roles that do not alternate
        raise UserError(f"{where}: the chat template refuses it: {first_line(e)}") from None
    except Exception as e:  # the template's own code failed (a division by zero, a bad filter argument...)
        raise UserError(f"{where}: the chat template fails on it: {type(e).__name__}: {first_line(e)}") from None


def user_turn_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of `prompt` as one user turn, rendered up to where the assistant's reply
    starts (`add_generation_prompt`): a model fine-tuned on chat is prompted as it was trained."""
    text = _render(tokenizer, [{"role": "user", "content": prompt}], "the generate prompt as a user turn",
                   add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assistant_spans(tokenizer, messages: list[dict], record: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant's replies in it
    (see the module docstring)."""
    where = f"chat record {record}"
    text = _render(tokenizer, messages, where)

    def prefix_end(rendered: str) -> int | None:
        return len(rendered) if text.startswith(rendered) else None

    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = 0
        if i > 0:  # after the header that opens a reply, where the template has one
            start = prefix_end(_render(tokenizer, messages[:i], where, add_generation_prompt=True))
            if start is None:
                start = prefix_end(_render(tokenizer, messages[:i], where))
        end = prefix_end(_render(tokenizer, messages[: i + 1], where))
        if start is None or end is None:
            raise UserError(f"{where}: the chat template does not render the start of a conversation "
                            f"as a prefix of the whole, so its assistant replies cannot be located")
        spans.append((start, end))
    return text, spans


def render_batch(tokenizer, conversations: list, records: list[int]) -> dict[str, list]:
    """`datasets.map` batch function: each conversation's token ids (`input_ids`) and which
    of them are the assistant's (`trained`)."""
    texts, spans = zip(*(assistant_spans(tokenizer, _checked(messages, record), record)
                         for messages, record in zip(conversations, records)))
    encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    trained = [[any(a <= start < b for a, b in reply_spans) for start, _ in offsets]
               for offsets, reply_spans in zip(encoded["offset_mapping"], spans)]
    return {"input_ids": encoded["input_ids"], "trained": trained}
