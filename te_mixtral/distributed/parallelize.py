"""Sharded parameters, gradients and optimizer state (`train.sharding: fsdp`), by FSDP2.

With `train.sharding: none` every rank holds every dense weight, its gradient and its AdamW
moments, and a `GradientReducer` (overlap.py) sums the gradients in buckets during the
backward; `reduce_gradients` waits for those sums. With
`fsdp`, torch's `fully_shard` (FSDP2, the engine torchtitan uses) shards them instead, on
the layout's DeviceMesh:

    dense weights   sharded over the whole world (W ranks)      dim-0 shards, as DTensors
    experts         sharded over their replicas (W / EP ranks)  mesh dim "replica"

Each rank of an EP group already holds its own E / EP experts; FSDP splits that stack again
among the replicas that hold the same experts, as torchtitan does over its
`dp_shard_mod_ep` mesh dim. Every rank then keeps 1/W of the dense state and 1/(W/EP) of its
experts' state, and the optimizer, seeing only local shards, updates only those.

A decoder layer is one FSDP unit (its dense weights), its experts another, and the root
holds the embeddings, the final norm and the LM head. Each unit all-gathers its weights
just before its forward (and again before its backward) and reduce-scatters their gradients
as soon as its backward is done, on its own stream, so that communication overlaps the
backward of the layers below: there is no all-reduce after backward.

Gradients are SUMMED, as without sharding (layout.py explains why: the loss is already
divided by the global target count). FSDP averages by default; every unit is told to
divide by 1 and to reduce with a plain SUM, in fp32.

The experts' unit needs a forward of its own to hang FSDP's gather on:
`StackedExperts.forward` runs the tier on them.

bf16 parameters (`train.optimizer: master_adamw`) are sharded as they are, gathered in bf16,
and their gradients reduce-scattered in fp32 and stored in bf16. FSDP cannot change a
sharded parameter's dtype, so the model is turned to bf16 before `parallelize`, and the
optimizer's remainders are sharded afterwards like their parameters (`shard_like`).

Checkpoints see a sharded run's tensors as global ones, as they see an unsharded run's
(distributed/global_state.py), so either resumes into the other.
"""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from te_mixtral.distributed.layout import Layout, all_reduce_gradients, timed_mesh
from te_mixtral.distributed.overlap import GradientReducer


def is_sharded(layout: Layout, sharding: str) -> bool:
    """Whether a run shards: asked for, and more than one rank to shard over."""
    return sharding == "fsdp" and layout.world_size > 1


def parallelize(model: nn.Module, layout: Layout, sharding: str) -> nn.Module:
    """Shard `model` in place as the module docstring says, or, unsharded, give it a
    `GradientReducer` (`model.gradient_reducer`); a no-op in a single process.

    Call it after the weights are initialised or loaded (they are split as they stand) and
    before the optimizer is built (it must see the sharded parameters).
    """
    if layout.world_size == 1:
        return model
    if not is_sharded(layout, sharding):
        model.gradient_reducer = GradientReducer(model, layout)
        return model
    device_type = layout.mesh.device_type
    dense_mesh = timed_mesh(device_type, (layout.world_size,), ("world",), layout.timeout)
    expert_mesh = layout.mesh["replica"]
    # Reduce in fp32 whatever the parameters' dtype; the parameters stay as they are.
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=expert_mesh, mp_policy=policy)
        fully_shard(layer, mesh=dense_mesh, mp_policy=policy)
    fully_shard(model, mesh=dense_mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # each unit keeps its own setting
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def gradient_reducer(model: nn.Module) -> GradientReducer | None:
    """The reducer `parallelize` gave an unsharded model of several ranks, else None."""
    return getattr(model, "gradient_reducer", None)


def reduce_gradients(model: nn.Module, layout: Layout, sharding: str) -> None:
    """After the step's last backward, the gradients summed over the ranks: the reducer's
    sums, which that backward started, awaited; FSDP's reduce-scatters are done already. A
    model `parallelize` did not see is all-reduced here, one parameter at a time."""
    reducer = gradient_reducer(model)
    if reducer is not None:
        reducer.finish()
    elif not is_sharded(layout, sharding):
        all_reduce_gradients(model, layout)


def set_gradient_sync(model: nn.Module, layout: Layout, sharding: str, enabled: bool) -> None:
    """Whether the next backward communicates its gradients. The loop enables it for a step's
    last micro-batch, so gradients travel once per step (the earlier micro-batches add into
    `.grad`, under fsdp into FSDP's whole gradients, kept in fp32), or under fsdp with
    `train.fsdp_reduce: micro_batch` for every micro-batch (FSDP adds each reduce-scattered
    shard into the sharded gradient: only shards are kept). A no-op in a single process."""
    if is_sharded(layout, sharding):
        model.set_requires_gradient_sync(enabled)
    elif (reducer := gradient_reducer(model)) is not None:
        reducer.sync = enabled


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full`, of `param`'s global shape, laid out as `param` is: for a sharded parameter a
    DTensor holding this rank's own slice of it (cut locally, no communication, and copied so
    that the whole can be freed); else `full` itself."""
    if not isinstance(param, DTensor):
        return full
    local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return DTensor.from_local(local.clone(), param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())
