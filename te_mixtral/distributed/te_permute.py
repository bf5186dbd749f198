"""The local permute of token dispatch (dispatch.py's `LocalPermute`) with Transformer
Engine's fused MoE kernels, used on the TE backend.

`moe_permute` with an index map sorts each token's K copies by expert (a stable radix sort,
as `TorchPermute`'s argsort) and gathers the rows in one kernel. `moe_unpermute` undoes it
and merges each token's K rows, each multiplied by its routing weight in float32, in one
kernel, where the PyTorch version makes four passes over [T*K, D] (scatter, fp32 copy,
product, sum) and keeps an fp32 copy of the expert output for the backward. Both are
differentiable, the weights included, so the router still learns through the combine.
"""

import torch


class TEPermute:
    def sort(self, x_TD: torch.Tensor, experts_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from transformer_engine.pytorch import moe_permute

        x_sorted, row_id_map = moe_permute(x_TD, experts_TK.to(torch.int32), num_out_tokens=experts_TK.numel(),
                                           map_type="index")
        return x_sorted, row_id_map

    def unsort(self, y_sorted: torch.Tensor, row_id_map: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        from transformer_engine.pytorch import moe_unpermute

        if weights_TK.requires_grad and not y_sorted.requires_grad:
            # TE's unpermute backward (its autograd.Function `_moe_unpermute_index_map`)
            # computes the weights' gradient in the kernel that computes the rows', and runs
            # it only when the rows need a gradient: rows that need none (frozen experts and
            # inputs) would leave the router with no gradient, silently. Rows that ask for one
            # keep the weights' gradient; theirs goes nowhere.
            y_sorted = y_sorted.detach().requires_grad_()
        return moe_unpermute(y_sorted, row_id_map, merging_probs=weights_TK.float(), map_type="index")
