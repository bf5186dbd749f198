"""Greedy generation from the fine-tuned model: a quick look at what it learned.

Greedy means the most likely next token every time, as transformers' `generate(do_sample=False)`
picks it, so on the same weights the two give the same tokens. The prompt runs once, filling a
KV cache (te_mixtral/model/kv_cache.py); then each new token runs the model over itself alone,
attending to the cache, and reads each weight once: the dense ones and its top-k experts' per
layer, the least a decode step can read.

The decode step keeps its state on the device (the token, its position, the cache), so it has
the same shapes at every token and waits for nothing where its expert tier waits for nothing
(`ExpertTier.sync_free`). Then, on one CUDA process, it is captured in a CUDA graph after one
run and replayed for every later token (`graphs`): at batch 1 a step's kernels are small, and
launching them one by one from Python takes longer than the GPU takes to run them. Only
reading the token back (to stop at eos) waits for the GPU. The graph replays the very kernels
the first step ran, so the tokens are the same either way.

With expert parallelism every rank must run every forward, since each holds only some of
the experts: every rank runs the same loop on the same prompt, without graphs (the exchange
of rows between ranks needs the host). The token is chosen on rank 0 and broadcast, so all
ranks stay in step even if their logits differed in the last bit.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from te_mixtral.data.tokenizer import Tokenizer
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError
from te_mixtral.model.layers import PackedSequences
from te_mixtral.model.mixtral import MixtralForCausalLM
from te_mixtral.training.evaluate import evaluating


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
                    layout: Layout, device: torch.device, autocast: AbstractContextManager,
                    max_positions: int, graphs: bool = False) -> list[int]:
    """The ids of up to `max_new_tokens` tokens that follow `prompt_ids`; stops after eos.
    `graphs`: replay the decode step as a CUDA graph (one CUDA process, our model, an expert
    tier that never waits for the host: `generate_text` decides)."""
    steps = min(max_new_tokens, max_positions - len(prompt_ids))
    if steps <= 0:
        return []
    cache = model.kv_cache(len(prompt_ids) + steps - 1)  # the last new token is never fed back
    token_11 = torch.empty(1, 1, dtype=torch.int64, device=device)
    position_11 = torch.full((1, 1), len(prompt_ids), dtype=torch.int64, device=device)
    one_token = PackedSequences(position_11, torch.tensor([0, 1], dtype=torch.int32, device=device), 1)

    def take(logits_1SV: torch.Tensor) -> None:
        token_11.copy_(logits_1SV[:, -1:].argmax(-1))
        if layout.world_size > 1:
            dist.broadcast(token_11, src=0)

    def decode_step() -> None:
        with autocast, evaluating(model):
            take(model(token_11, one_token, cache))
        position_11.add_(1)

    length = len(prompt_ids)
    prompt = PackedSequences(torch.arange(length, device=device)[None],
                             torch.tensor([0, length], dtype=torch.int32, device=device), length)
    with autocast, evaluating(model):
        take(model(torch.tensor([prompt_ids], device=device), prompt, cache))
    new = [int(token_11)]
    if graphs and len(new) < steps and new[-1] != eos_id:
        decode_step = captured(decode_step, (token_11, position_11))
    while len(new) < steps and new[-1] != eos_id:
        decode_step()
        new.append(int(token_11))
    return new


def captured(step: Callable[[], None], state: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """`step` as a CUDA graph, replayed by the callable returned. It runs once first, on a side
    stream, so that what happens once (Triton's compiles, cuBLAS's workspaces) is not captured;
    `state`, which the step updates in place, is then put back, so that the first replay is
    the first step (the cache rows that run wrote are written again)."""
    before = [t.clone() for t in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for t, value in zip(state, before):
        t.copy_(value)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def encode_prompt(tokenizer: Tokenizer, prompt: str, max_positions: int, max_new_tokens: int) -> list[int]:
    """The prompt's token ids (with the tokenizer's own special tokens, as transformers
    adds them; in a chat run, the prompt as a user turn of the chat template, the reply's
    header included), or a one-line `UserError` when they leave no room for the
    `max_new_tokens` asked for (generation would stop short without a word). The training
    loop calls this before the first step too, so a bad prompt does not wait for training."""
    if not prompt.strip():  # a chat template would make it an empty user turn, and answer that
        raise UserError("the generate prompt is blank: give some text to continue")
    if tokenizer.chat is None:
        prompt_ids = tokenizer.backend.encode(prompt).ids
    else:
        from te_mixtral.data.chat import user_turn_ids  # transformers: imported for chat data only

        prompt_ids = user_turn_ids(tokenizer.chat, prompt)
    if not prompt_ids:
        raise UserError(f"the generate prompt {prompt[:40]!r} encodes to no tokens (nothing the tokenizer knows); "
                        f"give some text")
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
    graphs = (device.type == "cuda" and layout.world_size == 1 and isinstance(model, MixtralForCausalLM)
              and model.tier.sync_free())
    tokens = greedy_generate(model, prompt_ids, max_new_tokens, tokenizer.eos_id, layout, device, autocast,
                             model.config.max_position_embeddings, graphs)
    return {"prompt": prompt, "prompt_ids": prompt_ids, "tokens": tokens, "text": tokenizer.backend.decode(tokens)}
