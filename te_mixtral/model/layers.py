"""Two layer backends behind one switch: Transformer Engine modules, or plain PyTorch.

Both give the same parameter names and shapes (`weight` of [out, in] for a linear layer,
`weight` of [D] for RMSNorm), so one checkpoint loads into either.

Attention over packed samples. A sample holds several documents back to back, and a token
must attend only to earlier tokens *of its own document*:
- TE path: the batch is flattened to THD (total tokens, heads, head dim) and TE's fused
  attention takes the document boundaries as `cu_seqlens`, so no FLOP is spent across
  documents.
- PyTorch path: SDPA with an explicit block-diagonal causal mask built from the same
  boundaries (simple, and fine for the small CPU runs it serves; it computes the masked
  blocks and throws them away).
"""

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Backend:
    name: str
    linear: type
    rmsnorm: type
    attention: type
    permute: type  # token dispatch's local permute and weighted combine (distributed/dispatch.py)


def _torch_linear(in_features: int, out_features: int) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=False)


def _te_linear(in_features: int, out_features: int) -> nn.Module:
    import transformer_engine.pytorch as te

    return te.Linear(in_features, out_features, bias=False)


def _te_rmsnorm(dim: int, eps: float) -> nn.Module:
    import transformer_engine.pytorch as te

    return te.RMSNorm(dim, eps=eps)


TORCH = Backend("torch", _torch_linear, RMSNorm, TorchAttention, TorchPermute)
TE = Backend("te", _te_linear, _te_rmsnorm, TEAttention, TEPermute)


def resolve_backend(name: str, device: str) -> Backend:
    """`auto` picks TE when it is importable on a CUDA device, else plain PyTorch."""
    from te_mixtral.te_support import require_te, te_available

    if name == "torch" or (name == "auto" and not (device == "cuda" and te_available())):
        return TORCH
    if device != "cuda":
        raise UserError("backend 'te' needs a CUDA device; use --backend torch (or auto) on this machine")
    require_te()
    return TE
