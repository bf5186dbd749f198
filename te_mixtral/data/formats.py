"""Data formats, by `data.format`'s name: what a record holds and how it becomes token ids
and the mask of the tokens trained on.

- `text`: each record's `data.text_field` is a document; every token is trained, and an
  eos closes each document and marks its edge (te_mixtral/data/packing.py).
- `chat`: each record's `data.messages_field` is a conversation, rendered with the
  tokenizer's chat template; only the assistant's replies are trained, and a
  conversation's edges are its length, since it holds an eos after every reply
  (te_mixtral/data/chat.py). `data.role_key`, `data.content_key` and `data.roles` read
  another layout of messages.
- `sharegpt` and `alpaca`: chat data in those two community layouts, read as conversations
  (te_mixtral/data/chat_layouts.py) and trained as `chat` is.

The rest of data/ asks `FORMATS[cfg.format]` and never branches on a format's name: a new
format is one more class here. Chat's module is imported only when chat data is read:
transformers takes seconds to import, and text runs do not need it.
"""

import datasets

from te_mixtral.config import DataConfig
from te_mixtral.data import chat_layouts
from te_mixtral.data.tokenizer import Tokenizer, load_tokenizer
from te_mixtral.errors import UserError


def close_with_eos(ids: list[list[int]], eos_id: int) -> list[list[int]]:
    """Each record's ids, ended by eos unless they already end with one."""
    return [doc if doc and doc[-1] == eos_id else doc + [eos_id] for doc in ids]


class TextFormat:
    name = "text"
    unit = "documents"  # what one record is, as messages count them
    masked = False  # every token is trained, and an eos is a document edge

    def fields(self, cfg: DataConfig) -> list[str]:
        """The fields every record must have."""
        return [cfg.text_field]

    def missing_field_advice(self, cfg: DataConfig, columns: list[str]) -> str:
        """What the message for a data set without one of `fields` advises."""
        return "set data.text_field" + (" (or data.format chat: records that hold conversations)"
                                        if cfg.messages_field in columns else "")

    def records(self, cfg: DataConfig, source: datasets.Dataset) -> datasets.Dataset:
        """The one column of a source that the rest of data/ reads, its field checked; text
        that is empty or blank is left for `without_empty`."""
        if getattr(source.features[cfg.text_field], "dtype", None) not in ("string", "large_string"):
            raise UserError(f"field '{cfg.text_field}' of data set '{cfg.dataset}' does not hold text")
        return source.select_columns([cfg.text_field])

    def without_empty(self, records: datasets.Dataset, field: str) -> datasets.Dataset:
        """The records less those whose text is empty or blank (blank lines of a .txt file).
        A record without the field (None: `datasets` fills it so) is refused, not skipped:
        it is no blank text but a record of another kind, and skipping it would train on less
        than given without a word."""
        def not_blank(texts: list, indices: list[int]) -> list[bool]:
            for text, record in zip(texts, indices):
                if text is None:
                    raise UserError(f"record {record} has no '{field}' (data.text_field): every record must hold "
                                    f"its text there")
            return [bool(text.strip()) for text in texts]
        return records.filter(not_blank, input_columns=field, batched=True, with_indices=True)

    def tokenizer(self, cfg: DataConfig, records: datasets.Dataset | list) -> Tokenizer:
        # Only a BPE trained here reads the texts themselves.
        return load_tokenizer(cfg, records[cfg.text_field] if cfg.tokenizer is None else [])

    def cache_key(self, tokenizer: Tokenizer) -> str:
        """What the token ids depend on besides the tokenizer's JSON and eos."""
        return ""

    def encode(self, tokenizer: Tokenizer, texts: list, indices: list[int]
               ) -> tuple[list[list[int]], list[list[bool]] | None]:
        """Each record's token ids, closed by eos, and which of them are trained: None, all."""
        return close_with_eos(tokenizer.encode_batch(texts), tokenizer.eos_id), None

    def skipped_note(self, skipped: int) -> str:
        """What the too-little-data message says of the samples left out for having no target."""
        return ""


class ChatFormat:
    name = "chat"
    unit = "conversations"
    masked = True  # the assistant's tokens only, and a conversation's edges are its length

    def fields(self, cfg: DataConfig) -> list[str]:
        return [cfg.messages_field]

    def missing_field_advice(self, cfg: DataConfig, columns: list[str]) -> str:
        return "set data.messages_field (and for messages not of {role, content}: data.role_key, data.content_key, " \
               "data.roles)"

    def records(self, cfg: DataConfig, source: datasets.Dataset) -> datasets.Dataset:
        """The conversations, as {role, content} messages; each is checked as it is rendered."""
        return chat_layouts.as_messages(source, chat_layouts.MessageLayout(
            cfg.messages_field, cfg.role_key, cfg.content_key, chat_layouts.parse_roles(cfg.roles)))

    def without_empty(self, records: datasets.Dataset, field: str) -> datasets.Dataset:
        """The records as they are: an empty conversation is refused as it is rendered."""
        return records

    def tokenizer(self, cfg: DataConfig, records: datasets.Dataset | list) -> Tokenizer:
        """The folder's tokenizer with its chat template; the records are not read."""
        from te_mixtral.data.chat import load_chat_tokenizer

        chat = load_chat_tokenizer(cfg.tokenizer)
        eos_id = chat.eos_token_id
        if eos_id is None:  # the folder names none: the first of EOS_CANDIDATES, as for text
            eos_id = Tokenizer.wrap(chat.backend_tokenizer, cfg.tokenizer).eos_id
        return Tokenizer(chat.backend_tokenizer, eos_id, chat)

    def cache_key(self, tokenizer: Tokenizer) -> str:
        return tokenizer.chat.get_chat_template()  # the one rendering uses: the default among named ones

    def encode(self, tokenizer: Tokenizer, conversations: list, indices: list[int]
               ) -> tuple[list[list[int]], list[list[bool]] | None]:
        """Each conversation's token ids, closed by eos unless its template ends it with one,
        and which of them are the assistant's (an eos added here is not)."""
        from te_mixtral.data.chat import render_batch

        rendered = render_batch(tokenizer.chat, conversations, indices)
        ids = rendered["input_ids"]
        closed = close_with_eos(ids, tokenizer.eos_id)
        return closed, [t + [False] * (len(c) - len(i)) for t, c, i in zip(rendered["trained"], closed, ids)]

    def skipped_note(self, skipped: int) -> str:
        return f", {skipped} without an assistant token"

    def nothing_to_train(self, cfg: DataConfig) -> UserError:
        """The error for data with no token to train on (only a masked format's can have none)."""
        return UserError(f"chat data set '{cfg.dataset}' has no assistant turn: chat data trains on the assistant's "
                         f"replies only, so there is nothing to train on")


class ShareGPTFormat(ChatFormat):
    name = "sharegpt"

    def fields(self, cfg: DataConfig) -> list[str]:
        return [chat_layouts.SHAREGPT.field]

    def missing_field_advice(self, cfg: DataConfig, columns: list[str]) -> str:
        return OTHER_LAYOUTS

    def records(self, cfg: DataConfig, source: datasets.Dataset) -> datasets.Dataset:
        return chat_layouts.as_messages(source, chat_layouts.SHAREGPT)


class AlpacaFormat(ChatFormat):
    name = "alpaca"

    def fields(self, cfg: DataConfig) -> list[str]:
        return ["instruction", "output"]  # "input" and "system" where there are any

    def missing_field_advice(self, cfg: DataConfig, columns: list[str]) -> str:
        return OTHER_LAYOUTS

    def records(self, cfg: DataConfig, source: datasets.Dataset) -> datasets.Dataset:
        return chat_layouts.alpaca_as_messages(source)


OTHER_LAYOUTS = ("for another layout of conversations use data.format chat with data.messages_field, data.role_key, "
                 "data.content_key and data.roles")
FORMATS = {fmt.name: fmt for fmt in (TextFormat(), ChatFormat(), ShareGPTFormat(), AlpacaFormat())}
