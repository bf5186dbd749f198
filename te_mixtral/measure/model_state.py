"""Weights, gradients and optimizer state: how many parameters a rank holds, and how much of
them, and of their gradients, each phase of a training step holds, whole or sharded by FSDP.
The memory estimate (memory.py) builds on these; the phases are its."""

from dataclasses import dataclass

from te_mixtral.config import LoRAConfig, ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameters one rank holds, by kind (experts: this rank's E / EP of them)."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    dense_per_layer: int  # attention, router, norms
    experts_per_layer: int
    final_norm: int
    layers: int

    @property
    def dense(self) -> int:
        return self.embedding + self.lm_head + self.final_norm + self.layers * self.dense_per_layer

    @property
    def experts(self) -> int:
        return self.layers * self.experts_per_layer

    @property
    def total(self) -> int:
        return self.dense + self.experts


def count_parameters(m: ModelConfig, ep_size: int = 1) -> ParamCounts:
    d, hd = m.hidden_size, m.head_dim
    attention = d * m.num_attention_heads * hd * 2 + d * m.num_key_value_heads * hd * 2  # q, o; k, v
    router, norms = d * m.num_experts, 2 * d
    experts = (m.num_experts // ep_size) * 3 * m.intermediate_size * d  # gate, up, down
    return ParamCounts(m.vocab_size * d, 0 if m.tie_word_embeddings else m.vocab_size * d,
                       attention + router + norms, experts, d, m.num_hidden_layers)


def adapter_widths(m: ModelConfig, lora: LoRAConfig) -> tuple[int, int]:
    """in + out of LoRA's adapted projections in one layer, summed: (attention's, one expert's).
    An adapter of rank r holds r times that many parameters."""
    d, hd, f = m.hidden_size, m.head_dim, m.intermediate_size
    dense = {"q_proj": d + m.num_attention_heads * hd, "k_proj": d + m.num_key_value_heads * hd,
             "v_proj": d + m.num_key_value_heads * hd, "o_proj": m.num_attention_heads * hd + d}
    experts = {"gate_up_proj": d + 2 * f, "down_proj": f + d}
    targets = lora.target_list()
    return sum(dense[t] for t in targets if t in dense), sum(experts[t] for t in targets if t in experts)


def count_adapters(m: ModelConfig, ep_size: int, lora: LoRAConfig) -> int:
    """LoRA's adapter parameters one rank holds (its E / EP experts' adapters); 0 without LoRA."""
    if not lora.enabled:
        return 0
    dense, expert = adapter_widths(m, lora)
    return m.num_hidden_layers * lora.rank * (dense + (m.num_experts // ep_size) * expert)


def local_parts(params: ParamCounts, expert_replicas: int, dense_replicas: int) -> tuple[int, int]:
    """(dense, expert) parameters of this rank's shards: each dense weight split over
    `dense_replicas` ranks, each expert over `expert_replicas`."""
    return params.dense // dense_replicas, params.experts // expert_replicas


def local_parameters(params: ParamCounts, expert_replicas: int, dense_replicas: int) -> int:
    """Parameters of this rank's shards (`local_parts`, summed)."""
    return sum(local_parts(params, expert_replicas, dense_replicas))


def held_unsharded(params: ParamCounts, p_bytes: int, g_bytes: int, accumulating: bool, tied: bool) -> dict:
    """Phase -> (weights, gradients, transient bytes) unsharded: every weight whole; in the
    backward the gradients made so far (all but the embedding's, made last, at layer 0), or
    with accumulation all of them, the earlier micro-batches' sums."""
    weights, grads = p_bytes * params.total, g_bytes * params.total
    but_embedding = grads - (0 if tied else g_bytes * params.embedding)
    return {"head backward": (weights, grads if accumulating else 0, 0),
            "layer 0 backward": (weights, grads if accumulating else but_embedding, 0),
            "optimizer step": (weights, grads, 0)}


def held_fsdp(params: ParamCounts, expert_replicas: int, world_size: int, p_bytes: int, g_bytes: int,
              accumulating: bool, whole_until_last: bool) -> dict:
    """Phase -> (weights, gradients, transient bytes) under FSDP2 (distributed/parallelize.py),
    as torch.distributed.fsdp._fully_shard holds them: a rank keeps its shards of weights and
    gradients. Each unit (a layer's experts, a layer's dense weights, the root: embeddings,
    final norm, LM head) is gathered whole before its forward and again before its backward,
    the next unit's gather issued while one runs; the root stays gathered from the forward
    to the end of the backward, and so do its whole gradients. A unit's backward leaves its
    whole gradient, copied into an fp32 buffer for the reduce-scatter (the reduce dtype), whose
    fp32 shard is then added into the sharded gradient in the weights' dtype.
    `whole_until_last`: micro-batches that do not reduce (`train.fsdp_reduce: step`) keep
    every whole gradient, in fp32, until the last one's backward."""
    local = local_parameters(params, expert_replicas, world_size)
    weights, grads = p_bytes * local, g_bytes * local
    root = params.embedding + params.lm_head + params.final_norm
    experts = params.experts_per_layer
    # In an expert unit's backward: its weights, its layer's dense ones and the next layer's
    # (prefetched) gathered, and the root's.
    gathered = p_bytes * (root + experts + 2 * params.dense_per_layer)
    if whole_until_last:
        whole = 4 * params.total  # fp32, every unit's, the earlier micro-batches' sums
        backward = (whole, g_bytes * experts)  # and the expert unit's new gradient, added in after
        head = whole
    else:
        # The shards made so far (all of them with accumulation; else all but the embedding's,
        # made last), the root's whole gradients; the expert unit's whole gradient, its fp32
        # copy and the fp32 shard.
        root_whole = root - (params.embedding if params.lm_head else 0)  # a tied embedding is the head
        shards = grads if accumulating else grads - g_bytes * (params.embedding // world_size)
        backward = (shards + g_bytes * root_whole, (g_bytes + 4) * experts + 4 * experts // expert_replicas)
        head = grads if accumulating else 0
    return {"head backward": (weights + p_bytes * (root + params.dense_per_layer), head, 0),
            "layer 0 backward": (weights + gathered, *backward),
            "optimizer step": (weights, grads, 0)}
