"""The keys and values of the tokens a generation has seen, so that each new token runs the
model over itself alone (training/generate.py).

Shape suffixes: see te_mixtral/__init__.py; here S counts the cache's positions and T the
tokens of the forward that writes them (the prompt, then one token a step), of one sequence.

Without a cache every new token runs the model over the whole sequence again: n tokens cost
O(n^2) work, and every step reads the weights of every expert, since a few dozen tokens route
to all of them, where one new token needs only its top-k experts' weights. With it a step
reads each dense weight once and K experts' weights per layer, the least a step can read.

Each layer's keys and values live in buffers of the sequence's whole length, [1, S, kv heads,
head dim], made at the first write (in the dtype the keys come in) and zero until written: a
masked key still meets the softmax's weights as 0 x value, and garbage could be NaN. A forward
writes its tokens' rows at their positions and attends to the whole buffer through a mask, key
position <= query position. The positions are a tensor on the device and nothing else in a step
depends on how many tokens are cached, so every decode step has the same shapes, issues the same
kernels and waits for nothing: a CUDA graph can capture one and replay it. Reading the whole
buffer each step is cheap beside the weights: for Mixtral-8x7B, 2 x 32 layers x 8 KV heads x
128 x 2 bytes = 128 KiB per cached position.

Attention runs through SDPA with that mask on either layer backend (TE's fused attention takes
documents, not a cache), and the rotary embedding in PyTorch at each token's position (TE's
kernel counts positions from each document's start): model/mixtral.py picks both when a
forward gets a cache.
"""

import torch
import torch.nn.functional as F


class LayerCache:
    """One decoder layer's cached keys and values."""

    def __init__(self, length: int):
        self.length = length
        self.k_1SHd: torch.Tensor | None = None
        self.v_1SHd: torch.Tensor | None = None

    def attend(self, q_1THd, k_1THd, v_1THd, positions_T: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' keys and values at `positions_T`, then the new tokens'
        attention over every cached token at or before their own position: [1, T, H, Hd]."""
        if self.k_1SHd is None:
            self.k_1SHd, self.v_1SHd = (t.new_zeros(1, self.length, *t.shape[2:]) for t in (k_1THd, v_1THd))
        self.k_1SHd.index_copy_(1, positions_T, k_1THd)
        self.v_1SHd.index_copy_(1, positions_T, v_1THd)
        seen_TS = torch.arange(self.length, device=positions_T.device) <= positions_T[:, None]
        q, k, v = (t.transpose(1, 2) for t in (q_1THd, self.k_1SHd, self.v_1SHd))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen_TS, enable_gqa=True).transpose(1, 2)


class KVCache:
    """Every layer's cache for one sequence of up to `length` tokens."""

    def __init__(self, num_layers: int, length: int):
        self.layers = [LayerCache(length) for _ in range(num_layers)]
