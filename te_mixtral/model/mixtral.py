"""A Mixtral decoder whose numerics equal Hugging Face `MixtralForCausalLM`.

Shape suffixes: see te_mixtral/__init__.py.

Parameter names follow transformers v5 (`model.layers.N.mlp.experts.gate_up_proj`, ...),
so converting a checkpoint is a rename at most; each rank holds only its own slice of the
stacked experts (see `te_mixtral.distributed.layout` for the layout), those its
`placement` gives it (te_mixtral/distributed/placement.py).

Initialisation is independent of the expert-parallel layout: dense weights come from one
generator seeded by the run's seed, and each expert from its own generator seeded by
(seed, layer, global expert index). So EP=1 and EP=2 runs, placed in order or by load,
start from identical weights, and no rank ever materialises experts it does not own.

`recompute` (train.recompute) trades memory for compute: "full" runs each decoder layer's
forward again in its backward, "selective" only the expert FFN (see
te_mixtral/model/recompute.py), in every layer or in the first `recompute_layers`
(train.recompute_layers), the others keeping everything.

Generation (training/generate.py) passes a `KVCache` (te_mixtral/model/kv_cache.py): the
forward's tokens continue the cached ones, at the positions `packed` gives them, and attend to
them; attention and the rotary embedding then run in PyTorch on either backend.

Router losses. Each forward keeps its layers' routing statistics as `model.routing`, taken
from the layers' return values outside any recomputed region; `model.router_losses(layout)`
turns them into the load-balancing loss and z-loss of the global batch, and the expert load
(te_mixtral/model/router_losses.py). The forward itself still returns only the logits.
"""

import torch
from torch import nn

from te_mixtral.config import ModelConfig
from te_mixtral.distributed.dispatch import AllToAllDispatcher
from te_mixtral.distributed.layout import Layout, is_expert_param
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.experts.base import ExpertTier
from te_mixtral.model.kv_cache import KVCache, LayerCache
from te_mixtral.model.layers import Backend, PackedSequences, TorchRotary, torch_cross_entropy
from te_mixtral.model.moe import MoEBlock
from te_mixtral.model.packed_projection import packed_linear
from te_mixtral.model.recompute import recomputed
from te_mixtral.model.router_losses import RouterLosses, RouterStats, router_losses


class RotaryEmbedding(nn.Module):
    """The rotary tables of one forward, made once for every layer, in the form the
    backend's RoPE takes (te_mixtral/model/layers.py)."""

    def __init__(self, head_dim: int, theta: float, backend: Backend):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary = backend.rotary

    def forward(self, packed: PackedSequences, cached: bool = False):
        """The tables; `cached`: in PyTorch's form, at the positions as given (a cached
        generation's tokens start anywhere)."""
        return (TorchRotary if cached else self.rotary).tables(self.inv_freq, packed)


class Attention(nn.Module):
    def __init__(self, m: ModelConfig, backend: Backend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = m.num_attention_heads, m.num_key_value_heads, m.head_dim
        self.q_proj = backend.linear(m.hidden_size, self.heads * self.head_dim)
        self.k_proj = backend.linear(m.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = backend.linear(m.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = backend.linear(self.heads * self.head_dim, m.hidden_size)
        self.core = backend.attention(self.heads, self.kv_heads, self.head_dim)
        self.rotary = backend.rotary
        self.packed_qkv = backend.packed_qkv
        self.adapters = nn.ModuleDict()  # LoRA's, by projection name (model/lora.py); empty without

    def project(self, name: str, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """The projection `name` of x (`y`, where already computed without its adapter), with
        its LoRA adapter's delta where it has one."""
        y = getattr(self, name)(x) if y is None else y
        return y + self.adapters[name](x) if name in self.adapters else y

    def project_qkv(self, x_BSD: torch.Tensor) -> list[torch.Tensor]:
        """q, k and v of x, [B, S, heads * head_dim] each: by one GEMM where the backend
        packs them (the three are views of its output), else by three."""
        names = ("q_proj", "k_proj", "v_proj")
        if not self.packed_qkv:
            return [self.project(name, x_BSD) for name in names]
        ys = packed_linear(x_BSD, *(getattr(self, name).weight for name in names))
        return [self.project(name, x_BSD, y) for name, y in zip(names, ys, strict=True)]

    def forward(self, x_BSD, rotary, packed: PackedSequences, cache: LayerCache | None = None):
        batch, seq, _ = x_BSD.shape
        q, k, v = self.project_qkv(x_BSD)
        q = q.view(batch, seq, self.heads, self.head_dim)
        k = k.view(batch, seq, self.kv_heads, self.head_dim)
        v = v.view(batch, seq, self.kv_heads, self.head_dim)
        rope = self.rotary if cache is None else TorchRotary
        q, k = rope.apply(q, rotary, packed), rope.apply(k, rotary, packed)
        if cache is None:
            out = self.core(q, k, v, packed)
        else:
            out = cache.attend(q, k, v, packed.position_ids_BS[0])
        return self.project("o_proj", out.reshape(batch, seq, -1))


class DecoderLayer(nn.Module):
    def __init__(self, m: ModelConfig, backend: Backend, layout: Layout, tier: ExpertTier, recompute: str,
                 frozen_base: bool, ep_chunks: int = 1, slot_of_expert: list[int] | None = None):
        super().__init__()
        self.recompute_layer = recompute == "full"
        self.input_layernorm = backend.rmsnorm(m.hidden_size, m.rms_norm_eps)
        self.self_attn = Attention(m, backend)
        self.post_attention_layernorm = backend.rmsnorm(m.hidden_size, m.rms_norm_eps)
        dispatcher = AllToAllDispatcher(m.num_experts, layout.ep_size, layout.ep_group,
                                        backend.permute(), ep_chunks, slot_of_expert=slot_of_expert)
        self.mlp = MoEBlock(m.hidden_size, m.intermediate_size, m.num_experts, m.num_experts_per_tok,
                            dispatcher, tier, m.num_experts // layout.ep_size,
                            recompute_experts=recompute == "selective", z_loss_grad=m.router_z_loss_coef != 0,
                            frozen_base=frozen_base)

    def forward(self, x_BSD, rotary, packed, cache: LayerCache | None = None):
        if self.recompute_layer:
            return recomputed(self._forward, x_BSD, rotary, packed, cache)
        return self._forward(x_BSD, rotary, packed, cache)

    def _forward(self, x_BSD, rotary, packed, cache=None) -> tuple[torch.Tensor, RouterStats]:
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), rotary, packed, cache)
        y_BSD, stats = self.mlp(self.post_attention_layernorm(x_BSD))
        return x_BSD + y_BSD, stats


class MixtralBody(nn.Module):
    def __init__(self, m: ModelConfig, backend: Backend, layout: Layout, tier: ExpertTier, recompute: str,
                 recompute_layers: int, frozen_base: bool, ep_chunks: int, placement: ExpertPlacement):
        super().__init__()
        self.embed_tokens = nn.Embedding(m.vocab_size, m.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(m, backend, layout, tier, recompute if i < recompute_layers else "none", frozen_base,
                         ep_chunks, placement.slot_of_expert(i))
            for i in range(m.num_hidden_layers))
        self.norm = backend.rmsnorm(m.hidden_size, m.rms_norm_eps)
        self.rotary = RotaryEmbedding(m.head_dim, m.rope_theta, backend)


class MixtralForCausalLM(nn.Module):
    def __init__(self, m: ModelConfig, backend: Backend, layout: Layout, tier: ExpertTier, recompute: str = "none",
                 recompute_layers: int | None = None, frozen_base: bool = False, ep_chunks: int = 1,
                 placement: ExpertPlacement | None = None):
        """`recompute` in the first `recompute_layers` decoder layers (None: all of them).
        `frozen_base` (LoRA): no weight made here trains, and the tier may hold the expert
        weights its own way (`ExpertTier.expert_weight`); adapters added later train. Each MoE
        layer's exchanges in `ep_chunks` overlapped chunks (distributed/dispatch.py). The
        experts on the EP ranks as `placement` places them (None: in order)."""
        super().__init__()
        self.config = m
        self.tier = tier  # every MoE layer's; read by the training loop for its `calls()`
        # Which experts this rank holds in each layer: read wherever an expert is read or
        # written by its id (distributed/placement.py).
        self.placement = placement or ExpertPlacement(layout.ep_size)
        layers = m.num_hidden_layers if recompute_layers is None else recompute_layers
        self.model = MixtralBody(m, backend, layout, tier, recompute, layers, frozen_base, ep_chunks, self.placement)
        self.lm_head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        if m.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if frozen_base:  # the one place the base is frozen
            self.requires_grad_(False)
        self.cross_entropy = backend.cross_entropy
        self.routing: RouterStats | None = None  # the latest forward's, on this rank

    def forward(self, input_ids_BS, packed: PackedSequences, cache: KVCache | None = None) -> torch.Tensor:
        """Logits [B, S, V] for a packed batch; the routing statistics go to `self.routing`.
        With `cache` (one sequence, B = 1), the tokens continue the ones it holds."""
        x_BSD = self.model.embed_tokens(input_ids_BS)
        rotary = self.model.rotary(packed, cached=cache is not None)
        layer_stats = []
        for i, layer in enumerate(self.model.layers):
            x_BSD, stats = layer(x_BSD, rotary, packed, None if cache is None else cache.layers[i])
            layer_stats.append(stats)
        self.routing = RouterStats.cat(layer_stats)
        return self.lm_head(self.model.norm(x_BSD))

    def pad_exchanges(self, capacity: float) -> None:
        """Every MoE layer's exchange padded to `capacity` times the even share (0: exact
        splits): distributed/dispatch.py."""
        for layer in self.model.layers:
            layer.mlp.dispatcher.capacity = capacity

    def exchange_needed(self) -> torch.Tensor | None:
        """The largest share of its rows any layer sent one rank since the last call, over the
        even share (on the device); None where no exchange was padded."""
        needed = [n for layer in self.model.layers if (n := layer.mlp.dispatcher.take_needed()) is not None]
        return torch.stack(needed).max() if needed else None

    def lm_loss(self, logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                num_targets_global: torch.Tensor) -> torch.Tensor:
        """`causal_lm_loss` by the backend's cross-entropy."""
        return causal_lm_loss(logits_BSV, labels_BS, num_targets_global, self.cross_entropy)

    def router_losses(self, layout: Layout) -> RouterLosses:
        """The latest forward's router losses and expert load over the global batch (a
        collective: every rank calls it after the same forward)."""
        return router_losses(self.routing, layout)

    def kv_cache(self, length: int) -> KVCache:
        """An empty cache for one sequence of up to `length` tokens (training/generate.py)."""
        return KVCache(self.config.num_hidden_layers, length)


def expert_seed(seed: int, layer_index: int, global_expert: int) -> int:
    return (seed * 1_000_003 + layer_index) * 65_537 + global_expert + 1


@torch.no_grad()
def init_weights(model: MixtralForCausalLM, seed: int, layout: Layout) -> None:
    """Normal(0, initializer_range) for matrices, ones for norms; see the module docstring."""
    std = model.config.initializer_range
    device = next(model.parameters()).device
    dense = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        if is_expert_param(name):
            continue
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=dense)
    for layer_index, layer in enumerate(model.model.layers):
        for local, global_expert in enumerate(model.placement.held(layer_index, layout.ep_rank,
                                                                   model.config.num_experts)):
            gen = torch.Generator(device).manual_seed(expert_seed(seed, layer_index, global_expert))
            layer.mlp.experts.gate_up_proj[local].normal_(0.0, std, generator=gen)
            layer.mlp.experts.down_proj[local].normal_(0.0, std, generator=gen)


def causal_lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, num_targets_global: torch.Tensor,
                   cross_entropy=torch_cross_entropy) -> torch.Tensor:
    """Summed token cross-entropy over this rank, divided by the global target count.

    Summing this over ranks gives the mean loss of the global batch (see te_mixtral.distributed.layout).
    `cross_entropy` computes the sum (a backend's: model/layers.py).
    """
    return cross_entropy(logits_BSV, labels_BS) / num_targets_global
