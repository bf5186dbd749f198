"""Activation recompute: keep less of the forward for the backward, and run part of the
forward again in the backward instead (`train.recompute`).

    none       keep everything the forward saves: the fastest step, the most memory.
    selective  recompute the expert FFN from its input rows: its hidden rows (gate_up's
               output, silu(gate), the SwiGLU product: R x 4F per layer, the largest
               activations of an MoE layer at Mixtral's shapes) are dropped after the
               forward and computed again in the backward. Routing and dispatch are not
               run again: the tier's inputs (the dispatched rows and their per-expert
               counts) are what is kept, so the recompute cannot route differently. Costs
               one more expert forward per step; `custom_grouped` on CUDA recomputes inside
               its op (`ExpertTier.recompute_hidden`) and runs only the gate_up GEMM again,
               two thirds of an expert forward.
    full       each decoder layer keeps only its input; its whole forward (norms, attention,
               routing, dispatch, experts, combine) runs again in its backward. Costs one
               more forward of every layer.

`train.recompute_layers` N applies the mode to the first N decoder layers only; the others
keep everything, as with none, and run no second forward. Every kept layer costs its share
of the memory none needs, so the memory estimate picks N: the fewest layers recomputing that
still fit (`--estimate-memory` names it). Which layers recompute does not change the peak,
which comes when every layer's saved tensors are held at once, at the start of the backward.

torch's `checkpoint` with `use_reentrant=False` does the work on both layer backends.
Transformer Engine has its own (`transformer_engine.pytorch.checkpoint`); what it adds to
torch's is FP8 *delayed-scaling* bookkeeping (a recompute must not push a second amax into
the history or move the scales) and tensor-parallel RNG trackers. Neither exists here: TE
layers run in bf16, and TE's one 8-bit recipe in this package (device_mxfp8's mxfp8-te) is
MXFP8 block scaling, whose scales come from the tensor at hand on every call, so running it
twice gives the same bits and leaves no state behind.

Pitfalls.
- Under expert parallelism a full recompute runs the dispatch's all-to-alls (counts and
  rows) and the combine's again, inside the backward. That is expected, and safe: every
  rank recomputes its layers in the same order, so the collectives pair up.
- The recomputed routing must equal the forward's: same input, same router weights and
  deterministic kernels give the same top-k. torch's checkpoint checks that each recomputed
  tensor has the shape it had (`determinism_check`), so a routing that changed how many rows
  an expert gets fails loudly instead of mixing two routings in one gradient.
- Anything the forward records as a side effect happens twice under full recompute:
  forward hooks on modules inside a layer (the router's included) fire in the forward and
  again in the recompute. Nothing in this package records statistics in the forward
  (measure/phases.py overwrites its captured inputs with equal values and counts expert
  rows outside the model). The router losses' statistics travel as the layers' return
  values and are gathered by the model's forward, outside the recomputed region, so the
  recompute's second copy is discarded (model/router_losses.py); any statistic added later
  must do the same or skip the recompute (checkpoint's `context_fn` gives a context for the
  recompute alone). tests/model/test_recompute.py and test_router_losses.py count.
- LoRA's dropout (`lora.dropout`) draws random masks in the forward: the recompute must draw
  the very same, or the adapters' gradients would be of other masks than the loss.
  `preserve_rng_state` keeps its default, which restores the RNG state before running again
  (tests/model/test_recompute.py holds it to that).
"""

import torch
from torch.utils.checkpoint import checkpoint


def recomputed(fn, *args):
    """`fn(*args)`, keeping for the backward only what `args` hold and running `fn` again
    in the backward. Without autograd (evaluation, generation) there is nothing to keep, so
    `fn` just runs."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)
