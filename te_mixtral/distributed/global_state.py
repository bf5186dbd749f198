"""The weights and the optimizer state as *global* tensors, whatever the layout: what lets a
checkpoint written on W ranks at EP=E resume on W' ranks at EP=E', sharded or not.

Shape suffixes: see te_mixtral/__init__.py.

A rank holds pieces. The global tensor of an expert parameter stacks all E experts
([E, 2F, D], [E, D, F]); the global tensor of a dense parameter is the parameter. Each piece a
rank holds is described here as a view of its global tensor, without a copy:

    one process                 the tensor itself: already global
    dense, sharding none        the tensor itself, the same on every rank (replicated)
    dense, fsdp                 FSDP's own DTensor: Shard(0) over the world
    experts, sharding none      a DTensor on the layout's mesh (replica, ep), placements
                                (Replicate(), Shard(0)): EP rank e holds experts [e*L, (e+1)*L)
    experts, fsdp               FSDP has cut those L experts again among the replicas: a
                                DTensor on the same ranks ordered (ep, replica), placements
                                (Shard(0), Shard(0)): the EP cut first, then FSDP's

Optimizer state shaped like its parameter is laid out like it; scalars (AdamW's step counts)
are plain tensors, the same on every rank. Keys are `model.<parameter name>` and
`optimizer.<parameter name>.<state key>`, whatever the parameters are called.

torch.distributed.checkpoint (DCP) does the rest. Saving, each rank writes its pieces, and a
piece several ranks hold (a replicated tensor, the experts of EP replicas) is written once.
Loading, each rank reads exactly the slices its views cover, from whichever files hold them,
and copies them into the views, that is into the live parameters and optimizer state.

Pitfalls: the FSDP cut and DTensor's Shard(0) must agree on where each rank's rows are. Both
cut as `torch.chunk` does (the first ranks take ceil(L / replicas) rows); that is what
makes FSDP's local shard the right slice of the global tensor. And DCP reads each piece
stored in a file whole before it cuts out the slice a rank wants, so loading briefly holds,
in host memory, the largest piece the saving run wrote: a whole layer's stacked experts when
one process wrote them.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from te_mixtral.distributed.layout import Layout, is_expert_param


def _ep_major(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks of `mesh` (replica, ep) ordered (ep, replica). It only describes where a
    rank's rows are, so it makes no process groups (making them would be a collective)."""
    return DeviceMesh(mesh.device_type, mesh.mesh.T.contiguous(), mesh_dim_names=("ep", "replica"),
                      _init_backend=False)


class GlobalView:
    """Builds the global views of a model's tensors for one layout (see the module)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.ep_major = _ep_major(layout.mesh) if layout.mesh is not None else None

    def of(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The global view of `t`, parameter `name` or a state tensor laid out like it."""
        t = t.detach()
        if self.layout.world_size == 1 or t.dim() == 0 or not is_expert_param(name):
            return t  # global already: one process, a scalar, or a dense tensor (replicated, or FSDP's DTensor)
        if isinstance(t, DTensor):  # FSDP's shard of this rank's experts; t.shape is theirs, [L, ...]
            local, mesh, placements = t.to_local(), self.ep_major, (Shard(0), Shard(0))
        else:
            local, mesh, placements = t, self.layout.mesh, (Replicate(), Shard(0))
        shape = torch.Size((t.shape[0] * self.layout.ep_size, *t.shape[1:]))
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter that has none its optimizer state (AdamW creates it at a
    parameter's first step), so that a checkpoint has it to save or somewhere to load into.

    One step at lr 0 over exactly those parameters (every other gradient set aside for it,
    so nothing else steps), then their step counts put back to 0: their state is then what
    their first real step would create, and no weight moves (torch.distributed.checkpoint's
    state-dict functions use the same zero step)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fresh = {id(p) for p in params if "step" not in optimizer.state.get(p, {})}
    if not fresh:
        return
    grads, lrs = [p.grad for p in params], [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in fresh else None
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for p, grad in zip(params, grads):
        if id(p) in fresh:
            optimizer.state[p]["step"].zero_()
        p.grad = grad
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def global_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, layout: Layout) -> dict[str, torch.Tensor]:
    """Every trained parameter and every optimizer state tensor as a global view (see the
    module): views of the live tensors, so that loading into them restores the run in place.
    A frozen parameter (LoRA's base) is left out: it never changes, and comes back from where
    it came (the `--model` checkpoint, or the seed)."""
    view = GlobalView(layout)
    for module in model.modules():
        # FSDP's root keeps its weights gathered after a forward with no backward (an
        # evaluation), and `named_parameters` then gives those, not the sharded parameters the
        # optimizer holds state for: shard them again.
        if isinstance(module, FSDPModule):
            module.reshard()
    materialize_optimizer_state(optimizer)
    state = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        state[f"model.{name}"] = view.of(name, p)
        for key, t in optimizer.state[p].items():
            if isinstance(t, torch.Tensor):
                state[f"optimizer.{name}.{key}"] = view.of(name, t)
    return state
