"""Weight gradients added into `.grad` by the GEMM that computes them.

With gradient accumulation every micro-batch after a step's first adds its weight gradient
to the parameter's `.grad`. Left to autograd, the GEMM writes the new gradient and then
autograd's AccumulateGrad reads it and `.grad` and writes the sum: 8 bytes moved per bf16
element. A GEMM epilogue that reads `.grad` and stores the sum moves 4. For the expert
weights, most of the model, that is most of what the additions cost (TE calls this
`fuse_wgrad_accumulation`; it and Megatron add into a separate fp32 `main_grad`).

Here the op adds into `.grad` itself, so the optimizer and every hook see what they always
saw. Its backward adds in place, takes the tensor off the parameter (`.grad = None`) and
returns it as the gradient. AccumulateGrad then finds no `.grad`: it installs the returned
tensor as it is (no copy, no addition) and runs the parameter's post-accumulate hooks as
after any backward (the data-parallel overlap's buckets, FSDP2's reduce-scatter).

Pitfall: a `.grad` taken off the parameter must come back. So this runs only where nothing
else could differ. The engine must be about to run that parameter's AccumulateGrad (not
so under `torch.autograd.grad`, or `backward(inputs=...)` without it, where the returned
gradient goes elsewhere). Grad mode must be off (no double backward through an in-place
add). `.grad` must be a plain contiguous tensor of the parameter's dtype and shape. And no
tensor hook may be registered on the parameter: it would see the sum, not this
micro-batch's gradient.
"""

import torch
from torch.autograd.graph import get_gradient_edge


def accumulation_target(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight.grad` where the weight-gradient GEMM may add into it (see above), else None."""
    grad = weight.grad
    if grad is None or torch.is_grad_enabled() or not (weight.is_leaf and weight.requires_grad):
        return None
    if type(grad) is not torch.Tensor or grad.dtype != weight.dtype or grad.shape != weight.shape:
        return None
    if not grad.is_contiguous() or weight._backward_hooks:
        return None
    # Private, but what torch's own register_multi_grad_hook asks: is this leaf's
    # AccumulateGrad part of the backward now running? Under torch.autograd.grad, which
    # never writes .grad, torch raises rather than answer for a leaf.
    try:
        accumulates = torch._C._will_engine_execute_node(get_gradient_edge(weight).node)
    except RuntimeError:
        return None
    return grad if accumulates else None


def hand_over(weight: torch.Tensor, summed: torch.Tensor) -> torch.Tensor:
    """The gradient to return for `weight` once the GEMM has added into `summed`, its
    `.grad`: AccumulateGrad installs it again, unchanged."""
    weight.grad = None
    return summed
