"""8-bit expert FFNs from other libraries, as callables with the tiers' signature
(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF) -> y_RD, for the benchmarks to set beside
ours. Each builder raises ImportError (or TE's own error) where its library cannot run here.

- `te_fp8(recipe_name)`: TE `GroupedLinear` under a TE recipe (`Float8CurrentScaling`,
  `Float8BlockScaling`, `DelayedScaling`), through `quant/te_mxfp8.TEGroupedExperts`, the
  plumbing the `device_mxfp8` tier uses for MXFP8 on Blackwell, with rows padded per expert
  to TE's alignment as that tier pads them.
- `torchao_fp8_rowwise()`: torchao's FP8 MoE training GEMM
  (`torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm`: row-wise E4M3
  through `torch._scaled_grouped_mm`, with its own Triton casts; rows padded to 16 per
  expert, as `torch._scaled_grouped_mm` needs them).
"""


from te_mixtral.experts.base import swiglu
from te_mixtral.experts.quant.padding import pad_rows, padded_rows, unpad_rows


def te_fp8(recipe_name: str):
    from transformer_engine.common import recipe

    from te_mixtral.experts.quant.te_mxfp8 import TEGroupedExperts

    experts = TEGroupedExperts(getattr(recipe, recipe_name)())

    def ffn(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF):
        padded = padded_rows(tokens_per_expert_L, x_RD.shape[0], experts.row_align, experts.min_rows)
        return unpad_rows(experts.mlp(pad_rows(x_RD, padded), padded, gate_up_L2FD, down_LDF), padded)

    return ffn


def torchao_fp8_rowwise():
    from torchao.prototype.moe_training import (
        _to_fp8_rowwise_then_scaled_grouped_mm as fp8_grouped_mm,
    )

    def ffn(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF):
        # Its own padding of groups to 16 rows is not implemented in torchao 0.18: rows are
        # padded here as torch._scaled_grouped_mm needs (16 per expert, 16 for an empty one).
        padded = padded_rows(tokens_per_expert_L, x_RD.shape[0], 16, 16)
        # B operands per expert, column-major: the transpose of a row-major [L, N, I] weight.
        h_QF = swiglu(fp8_grouped_mm(pad_rows(x_RD, padded), gate_up_L2FD.transpose(-2, -1), padded.offsets_L,
                                     pad_token_groups_for_grouped_mm=False))
        y_QD = fp8_grouped_mm(h_QF, down_LDF.transpose(-2, -1), padded.offsets_L, pad_token_groups_for_grouped_mm=False)
        return unpad_rows(y_QD, padded)

    return ffn


# name -> builder, in the order the tables list them
FP8_PEERS = {
    "TE fp8 current": lambda: te_fp8("Float8CurrentScaling"),
    "TE fp8 block": lambda: te_fp8("Float8BlockScaling"),
    "TE fp8 delayed": lambda: te_fp8("DelayedScaling"),
    "torchao fp8 rowwise": torchao_fp8_rowwise,
}
