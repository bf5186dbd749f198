"""torchtitan 0.2.2's MoE, written for CUDA, run on a CPU for the tests.

Three of its steps have no CPU path, and each is swapped here for the same computation a CPU
can run, in the tests only (benchmarks/torchtitan_peer.py refuses a machine without CUDA):

- its router and reorderer count tokens per expert with `torch.histc` on the int64 expert
  ids, which CUDA takes and the CPU does not ("histogram_cpu" has no int64 kernel):
  `count_in_float` runs those two modules' forwards with the ids counted as floats, cast
  back to int64 (every count is a whole number well below 2**24, so exact);
- its grouped-GEMM padding (`generate_permute_indices`) launches a Triton kernel, and takes
  `use_cpu=True` for its own CPU reference implementation of the same indices;
- `ParallelDims` builds its device mesh on "cuda" when no accelerator is visible.

`PATCHES` lists the last two as (module, name, value), for pytest's monkeypatch in this
process or a plain setattr in a torchrun worker.
"""

from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.distributed import parallel_dims
from torchtitan.models.moe import kernels, utils
from torchtitan.models.moe.moe import TokenChoiceTopKRouter, TokenReorderer

PATCHES = [
    (utils, "generate_permute_indices", partial(kernels.generate_permute_indices, use_cpu=True)),
    (parallel_dims, "device_type", "cpu"),
]


class _HistcInFloat(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.histc.default and not args[0].is_floating_point():
            return func(args[0].float(), *args[1:], **(kwargs or {})).to(args[0].dtype)
        return func(*args, **(kwargs or {}))


def count_in_float(model) -> None:
    """Run `model`'s routers' and reorderers' forwards under `_HistcInFloat`. Only those: a
    dispatch mode around the whole forward would stop torch.compile's FlexAttention."""
    mode = _HistcInFloat()

    def enter(module, inputs):
        mode.__enter__()

    def leave(module, inputs, output):
        mode.__exit__(None, None, None)

    for module in model.modules():
        if isinstance(module, (TokenChoiceTopKRouter, TokenReorderer)):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)
