"""Two layer backends behind one switch: Transformer Engine modules, or plain PyTorch.

Both give the same parameter names and shapes (`weight` of [out, in] for a linear layer,
`weight` of [D] for RMSNorm), so one checkpoint loads into either.

Rotary position embedding: Hugging Face Mixtral's rotate-half RoPE, positions restarting at
each document. The PyTorch path computes it in float32 from the position ids; the TE path
runs TE's fused RoPE kernel over the same documents (their `cu_seqlens`), which computes in
float32 too: one kernel for what PyTorch spends a cat, a negation and five elementwise
passes on.

Attention over packed samples. A sample holds several documents back to back, and a token
must attend only to earlier tokens *of its own document*:
- TE path: the batch is flattened to THD (total tokens, heads, head dim) and TE's fused
  attention takes the document boundaries as `cu_seqlens`, so no FLOP is spent across
  documents.
- PyTorch path: SDPA with an explicit block-diagonal causal mask built from the same
  boundaries (simple, and fine for the small CPU runs it serves; it computes the masked
  blocks and throws them away).

What the TE backend fuses besides (`--te_fusions`, on by default; off, for A/B timing, it
runs as the PyTorch path does here, TE's modules one by one):
- q, k and v in one GEMM each way (packed_projection.py), as TE's example packs them; the
  attention then gets q and k from the RoPE kernel and v as a view of the packed output,
  which TE's attention copies whole before its kernels (its layout check wants k and v
  strided alike), as it does in TE's example.
- The LM loss in TE's fused cross-entropy (`parallel_cross_entropy`, Triton kernels): the
  forward reads the bf16 logits twice and writes their float32 gradient, the backward scales
  it in place. PyTorch's path casts the logits to float32 and keeps their log-softmax, then
  in the backward fills a gradient, runs the log-softmax backward and casts back: about
  twice the bytes over [T, V], the largest tensor of the step.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from te_mixtral.distributed.dispatch import TorchPermute
from te_mixtral.distributed.te_permute import TEPermute
from te_mixtral.errors import UserError


@dataclass
class PackedSequences:
    """Where the documents are in a [B, S] batch (te_mixtral/data/packing.py builds it with
    each batch; see its docstring)."""

    position_ids_BS: torch.Tensor  # int64, 0 at each document start
    cu_seqlens: torch.Tensor  # int32 [num_segments + 1], over the flattened B*S tokens
    max_seqlen: int  # longest segment

    def to(self, device) -> "PackedSequences":
        return PackedSequences(self.position_ids_BS.to(device, non_blocking=True),
                               self.cu_seqlens.to(device, non_blocking=True), self.max_seqlen)

    def causal_document_mask(self) -> torch.Tensor:
        """[B, 1, S, S] bool, True where query i may attend key j."""
        # A document starts wherever the position restarts at 0.
        doc_BS = (self.position_ids_BS == 0).cumsum(-1)
        same_doc = doc_BS[:, :, None] == doc_BS[:, None, :]
        seq = self.position_ids_BS.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_BS.device).tril()
        return (same_doc & causal)[:, None]


class RMSNorm(nn.Module):
    """Hugging Face Mixtral's RMSNorm numerics: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class TorchRotary:
    """Tables: cos and sin of every token's angles, [B, S, 1, head_dim] float32."""

    @staticmethod
    def tables(inv_freq: torch.Tensor, packed: PackedSequences):
        freqs = packed.position_ids_BS[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # broadcast over heads
        return angles.cos(), angles.sin()

    @staticmethod
    def apply(x_BSHd: torch.Tensor, tables, packed: PackedSequences) -> torch.Tensor:
        cos, sin = tables
        x32 = x_BSHd.float()
        return (x32 * cos + _rotate_half(x32) * sin).to(x_BSHd.dtype)


class TERotary:
    """Tables: the angles of positions 0 .. max_seqlen - 1, [max_seqlen, 1, 1, head_dim]
    float32; TE's kernel takes each document's positions from `cu_seqlens`, which is where
    the position ids restart (te_mixtral/data/packing.py)."""

    @staticmethod
    def tables(inv_freq: torch.Tensor, packed: PackedSequences):
        freqs = torch.arange(packed.max_seqlen, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    @staticmethod
    def apply(x_BSHd: torch.Tensor, tables, packed: PackedSequences) -> torch.Tensor:
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

        x_THd = apply_rotary_pos_emb(x_BSHd.flatten(0, 1), tables, tensor_format="thd", fused=True,
                                     cu_seqlens=packed.cu_seqlens)
        return x_THd.view_as(x_BSHd)


class TorchAttention(nn.Module):
    # Same constructor as TEAttention so the model builds either; SDPA needs none of it.
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()

    def forward(self, q_BSHd, k_BSHd, v_BSHd, packed: PackedSequences):
        q, k, v = (t.transpose(1, 2) for t in (q_BSHd, k_BSHd, v_BSHd))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.causal_document_mask(), enable_gqa=True)
        return out.transpose(1, 2)


class TEAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        import transformer_engine.pytorch as te

        self.core = te.DotProductAttention(
            num_heads, head_dim, num_gqa_groups=num_kv_heads, attn_mask_type="padding_causal", qkv_format="thd"
        )

    def forward(self, q_BSHd, k_BSHd, v_BSHd, packed: PackedSequences):
        batch, seq = q_BSHd.shape[:2]
        q, k, v = (t.flatten(0, 1) for t in (q_BSHd, k_BSHd, v_BSHd))
        out = self.core(
            q, k, v,
            cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
            max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen,
        )
        return out.view(batch, seq, *q_BSHd.shape[2:])


def torch_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """The token cross-entropy summed over the targets (label -100: none), in float32 from
    logits cast to float32 first, as transformers computes its causal-LM loss."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=-100,
                           reduction="sum")


def te_cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """The same by TE's fused kernel, which computes in float32 from the logits as they are."""
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    # is_cg_capturable: otherwise its backward compares the incoming gradient with a tensor it
    # makes from 1.0 on the host, and that copy waits for the whole forward to finish.
    return parallel_cross_entropy(logits_BSV, labels_BS, reduce_loss=False, ignore_idx=-100,
                                  is_cg_capturable=True).sum()


@dataclass(frozen=True)
class Backend:
    name: str
    linear: type
    rmsnorm: type
    attention: type
    rotary: type  # TorchRotary or TERotary
    permute: type  # token dispatch's local permute and weighted combine (distributed/dispatch.py)
    packed_qkv: bool  # q, k and v projected by one GEMM each way (packed_projection.py)
    cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the summed token loss


def _torch_linear(in_features: int, out_features: int) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=False)


def _te_linear(in_features: int, out_features: int) -> nn.Module:
    import transformer_engine.pytorch as te

    return te.Linear(in_features, out_features, bias=False)


def _te_rmsnorm(dim: int, eps: float) -> nn.Module:
    import transformer_engine.pytorch as te

    return te.RMSNorm(dim, eps=eps)


TORCH = Backend("torch", _torch_linear, RMSNorm, TorchAttention, TorchRotary, TorchPermute, packed_qkv=False,
                cross_entropy=torch_cross_entropy)
TE = Backend("te", _te_linear, _te_rmsnorm, TEAttention, TERotary, TEPermute, packed_qkv=True,
             cross_entropy=te_cross_entropy)
# TE's modules one by one, as the PyTorch path runs them (--te_fusions false): the A/B of the fusions.
TE_UNFUSED = replace(TE, packed_qkv=False, cross_entropy=torch_cross_entropy)


def resolve_backend(name: str, device: str, te_fusions: bool = True) -> Backend:
    """`auto` picks TE when it is importable on a CUDA device, else plain PyTorch; TE's
    fusions only where `te_fusions`."""
    from te_mixtral.te_support import require_te, te_available

    if name == "torch" or (name == "auto" and not (device == "cuda" and te_available())):
        return TORCH
    if device != "cuda":
        raise UserError("backend 'te' needs a CUDA device; use --backend torch (or auto) on this machine")
    require_te()
    return TE if te_fusions else TE_UNFUSED
