"""Chat data in the layouts the community shares it in, turned into the conversations chat.py
renders: a list of `{"role": "system" | "user" | "assistant", "content": ...}` per record.

- `chat` with a mapping: any list-of-messages layout, as axolotl's `chat_template` type reads
  it: the record's field that holds the messages (`data.messages_field`), the keys of a
  message's role and text (`data.role_key`, `data.content_key`) and the record's role names
  as ours (`data.roles`, `"human:user,gpt:assistant"`; a role left out of it must be one of
  ours already).
- `sharegpt`: `{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}`, the
  same mapping with ShareGPT's names fixed.
- `alpaca`: `{"instruction", "input", "output"}`, one exchange: the instruction (and the
  input below it, when there is one) is the user's turn, the output the assistant's reply.
  An optional `system` field opens the conversation.

Each is one `datasets.map` over a source, after which the record's column is `messages`:
the records read from files are cached with the rest of `datasets`' work, under a key of ours
(`LAYOUTS_RECIPE`, data/cache_key.py says why). A message or
record the layout cannot read is refused in one line naming the record (the rest of the
checks, roles and contents, are chat.py's as the records are rendered).
"""

from dataclasses import dataclass
from functools import partial

import datasets

from te_mixtral.data.cache_key import map_fingerprint
from te_mixtral.errors import UserError

MESSAGES = "messages"  # the column every layout is turned into
# Part of the cache key of converted records: change it whenever a conversion changes.
LAYOUTS_RECIPE = "layouts-1"
ROLES = ("system", "user", "assistant")
ALPACA_FIELDS = ("instruction", "input", "output")


@dataclass(frozen=True)
class MessageLayout:
    """Where a record keeps its conversation, and what it names a message's role and text."""

    field: str
    role_key: str = "role"
    content_key: str = "content"
    roles: tuple[tuple[str, str], ...] = ()  # (the record's role name, ours)

    @property
    def is_standard(self) -> bool:
        return (self.field, self.role_key, self.content_key, self.roles) == (MESSAGES, "role", "content", ())


SHAREGPT = MessageLayout("conversations", "from", "value", (("human", "user"), ("gpt", "assistant"),
                                                             ("system", "system")))


def parse_roles(text: str | None) -> tuple[tuple[str, str], ...]:
    """`data.roles` ("human:user,gpt:assistant") as pairs; each target must be one of ROLES."""
    pairs = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        theirs, colon, ours = (part.strip() for part in item.partition(":"))
        if not colon or not theirs or ours not in ROLES:
            raise UserError(f"data.roles: '{item.strip()}' is not THEIRS:OURS with OURS one of {', '.join(ROLES)} "
                            f"(e.g. human:user,gpt:assistant)")
        pairs.append((theirs, ours))
    return tuple(pairs)


def _mapped(layout: MessageLayout, conversations: list, records: list[int]) -> dict[str, list]:
    """`datasets.map` batch function: each record's messages as {role, content}."""
    roles = dict(layout.roles)
    out = []
    for conversation, record in zip(conversations, records):
        if not isinstance(conversation, list):
            raise UserError(f"chat record {record}: '{layout.field}' must be a list of messages, "
                            f"got {conversation!r:.80}")
        messages = []
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or layout.role_key not in message or layout.content_key not in message:
                raise UserError(f"chat record {record}, message {j}: no '{layout.role_key}' and '{layout.content_key}' "
                                f"keys (data.role_key, data.content_key): {message!r:.80}")
            role = message[layout.role_key]
            if roles and role not in roles and role not in ROLES:
                raise UserError(f"chat record {record}, message {j}: role {role!r} is none of "
                                f"{', '.join(roles)} (data.roles) nor of {', '.join(ROLES)}")
            messages.append({"role": roles.get(role, role), "content": message[layout.content_key]})
        out.append(messages)
    return {MESSAGES: out}


def _alpaca(read: tuple[str, ...], *batch) -> dict[str, list]:
    """`datasets.map` batch function over the columns `read` (and the indices, last): each
    instruction record as a two- or three-turn chat."""
    columns, records, out = dict(zip(read, batch[:-1])), batch[-1], []
    for i, record in enumerate(records):
        instruction, given, output = (columns[key][i] if key in columns else "" for key in ALPACA_FIELDS)
        for key, value in zip(ALPACA_FIELDS, (instruction, given, output)):
            if value is None and key != "input":  # the input is optional; the exchange is not
                raise UserError(f"alpaca record {record}: '{key}' is null; each record needs its instruction "
                                f"and the output to train on")
            if value is not None and not isinstance(value, str):
                raise UserError(f"alpaca record {record}: '{key}' must be text, got {value!r:.80}")
        system = columns["system"][i] if "system" in columns else None
        prompt = instruction if not given else f"{instruction}\n\n{given}"
        out.append(([{"role": "system", "content": system}] if system else [])
                   + [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}])
    return {MESSAGES: out}


def as_messages(source: datasets.Dataset, layout: MessageLayout) -> datasets.Dataset:
    """A source whose `layout.field` holds conversations, as one column of standard ones."""
    if layout.is_standard:
        return source.select_columns([MESSAGES])
    return source.map(partial(_mapped, layout), batched=True, input_columns=layout.field, with_indices=True,
                      remove_columns=source.column_names, new_fingerprint=map_fingerprint(LAYOUTS_RECIPE, source, repr((layout,))),
                      desc="reading conversations")


def alpaca_as_messages(source: datasets.Dataset) -> datasets.Dataset:
    """An Alpaca source (instruction, input, output; input and system optional) as one column
    of conversations."""
    read = [key for key in (*ALPACA_FIELDS, "system") if key in source.column_names]
    return source.map(partial(_alpaca, tuple(read)), batched=True,
                      input_columns=read, with_indices=True, remove_columns=source.column_names,
                      new_fingerprint=map_fingerprint(LAYOUTS_RECIPE, source, repr(("alpaca", read))), desc="reading conversations")
