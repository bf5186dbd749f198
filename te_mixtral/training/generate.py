"""Greedy generation from the fine-tuned model: a quick look at what it learned.

Deliberately the simplest thing that is right: every new token runs a full forward over the
whole sequence so far (no KV cache), through the very forward training uses. That costs
O(n^2) work for n tokens, which is nothing for the few dozen tokens of a smoke test, and it
needs no second code path in the model. Greedy means the most likely next token every
time, as transformers' `generate(do_sample=False)` picks it, so on the same weights the two
give the same tokens.

With expert parallelism every rank must run every forward, since each holds only some of
the experts: every rank runs the same loop on the same prompt. The token is chosen on rank
0 and broadcast, so all ranks stay in step even if their logits differed in the last bit.
"""

from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from te_mixtral.data.tokenizer import Tokenizer
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError
from te_mixtral.model.layers import PackedSequences


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
                    layout: Layout, device: torch.device, autocast: AbstractContextManager,
                    max_positions: int) -> list[int]:
    """The ids of up to `max_new_tokens` tokens that follow `prompt_ids`; stops after eos."""
    ids = list(prompt_ids)
    new = []
    while len(new) < max_new_tokens and len(ids) < max_positions:
        length = len(ids)
        packed = PackedSequences(torch.arange(length, device=device)[None],
                                 torch.tensor([0, length], dtype=torch.int32, device=device), length)
        with autocast:
            logits_1SV = model(torch.tensor([ids], device=device), packed)
        next_id = logits_1SV[0, -1].argmax()
        if layout.world_size > 1:
            dist.broadcast(next_id, src=0)
        ids.append(int(next_id))
        new.append(ids[-1])
        if ids[-1] == eos_id:
            break
    return new


def encode_prompt(tokenizer: Tokenizer, prompt: str, max_positions: int, max_new_tokens: int) -> list[int]:
    """The prompt's token ids (with the tokenizer's own special tokens, as transformers
    adds them; in a chat run, the prompt as a user turn of the chat template, the reply's
    header included), or a one-line `UserError` when they leave no room for the
    `max_new_tokens` asked for (generation would stop short without a word). The training
    loop calls this before the first step too, so a bad prompt does not wait for training."""
    if tokenizer.chat is None:
        prompt_ids = tokenizer.backend.encode(prompt).ids
    else:
        from te_mixtral.data.chat import user_turn_ids  # transformers: imported for chat data only

        prompt_ids = user_turn_ids(tokenizer.chat, prompt)
    if not prompt_ids:
        raise UserError(f"the generate prompt {prompt[:40]!r} encodes to no tokens (empty, or nothing the "
                        f"tokenizer knows); give some text")
    if len(prompt_ids) >= max_positions:
        raise UserError(f"the generate prompt is {len(prompt_ids)} tokens, which leaves no room to generate "
                        f"within model.max_position_embeddings ({max_positions})")
    if len(prompt_ids) + max_new_tokens > max_positions:
        raise UserError(f"the generate prompt is {len(prompt_ids)} tokens, and {max_new_tokens} more (generate_tokens) "
                        f"would pass model.max_position_embeddings ({max_positions}): set --generate-tokens "
                        f"{max_positions - len(prompt_ids)} or fewer")
    return prompt_ids


def generate_text(model: torch.nn.Module, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, layout: Layout,
                  device: torch.device, autocast: AbstractContextManager) -> dict:
    """Encode `prompt`, continue it greedily, and return prompt, token ids and decoded text."""
    prompt_ids = encode_prompt(tokenizer, prompt, model.config.max_position_embeddings, max_new_tokens)
    tokens = greedy_generate(model, prompt_ids, max_new_tokens, tokenizer.eos_id, layout, device, autocast,
                             model.config.max_position_embeddings)
    return {"prompt": prompt, "prompt_ids": prompt_ids, "tokens": tokens, "text": tokenizer.backend.decode(tokens)}
