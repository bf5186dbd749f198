"""Process groups for expert parallelism, and the gradient reduction they imply.

Layout. The world of W ranks is split into W / EP replicas of EP consecutive ranks:

    rank = replica * EP + ep_rank            (e.g. W=4, EP=2: ranks 0,1 | 2,3)

- Within a replica (the *EP group*) each rank holds E / EP experts and exchanges tokens
  with the others by all-to-all. Dense parameters (attention, norms, router, embeddings)
  are replicated on every rank.
- Ranks with the same `ep_rank` in different replicas hold the same experts: they form an
  *expert-replica group*.

Every rank reads different data. The loss on each rank is its summed token loss divided by
the number of target tokens in the whole global batch, so the global loss is the plain
sum over ranks. The gradient of that global loss is then:

- dense parameter: the sum of every rank's gradient → all-reduce SUM over the world;
- expert parameter: the all-to-all backward has already summed the contributions of every
  rank in the EP group, so only the replicas remain → all-reduce SUM over the expert-replica
  group.

No division anywhere: the normalisation is in the loss. (Averaging expert gradients over
the expert-replica group alone would be off by a factor EP; that is the classic bug.)
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.tensor import DTensor

from te_mixtral.distributed.launcher_env import local_rank_from_env, local_world_size_from_env, world_size_from_env
from te_mixtral.errors import UserError, only_here


@dataclass
class Layout:
    rank: int
    world_size: int
    ep_size: int
    ep_group: dist.ProcessGroup | None  # None when the world is a single process
    expert_replica_group: dist.ProcessGroup | None
    # The same layout as a DeviceMesh of shape (replicas, EP), dims named "replica" and "ep":
    # the groups above are its dims' groups. FSDP shards over it (distributed/parallelize.py).
    mesh: DeviceMesh | None = None
    # How long a collective waits for a silent peer, on every group (`timed_mesh`).
    timeout: timedelta | None = None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def require_a_gpu_of_its_own() -> None:
    """Refuse, in this process's own line, a process that torchrun numbered past the GPUs its
    machine shows it (CUDA_VISIBLE_DEVICES shorter than --nproc_per_node, or set otherwise for
    one process): it would take a GPU that is not there, and fail inside CUDA with a traceback."""
    local, shown = local_rank_from_env(), torch.cuda.device_count()
    if local >= shown:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise only_here(UserError(
            f"rank {os.environ.get('RANK', '0')} is process {local} of {local_world_size_from_env()} on its machine, "
            f"which shows it {shown} GPU{'s' if shown != 1 else ''} (CUDA_VISIBLE_DEVICES="
            f"{'unset' if visible is None else repr(visible)}): each process needs a GPU of its own; start at most "
            f"{shown} per machine (--nproc_per_node), or show every process all of the machine's GPUs"))


def init_layout(ep_size: int, device: str, timeout_s: int) -> Layout:
    """Start torch.distributed when launched by torchrun (gloo on CPU, NCCL on CUDA)."""
    world = world_size_from_env()
    if world == 1:
        return Layout(0, 1, ep_size, None, None)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(local_rank_from_env())
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return mesh_layout(ep_size, device, timedelta(seconds=timeout_s))


def mesh_layout(ep_size: int, device: str, timeout: timedelta) -> Layout:
    """The layout of EP groups of `ep_size` over the started world, its groups made anew."""
    world = dist.get_world_size()
    # Row-major, so mesh[replica][ep_rank] = replica * EP + ep_rank as above. The mesh creates
    # every group on every rank in one order (new_group is collective).
    mesh = timed_mesh(device, (world // ep_size, ep_size), ("replica", "ep"), timeout)
    return Layout(dist.get_rank(), world, ep_size, mesh.get_group("ep"), mesh.get_group("replica"), mesh, timeout)


def timed_mesh(device: str, shape: tuple[int, ...], names: tuple[str, ...], timeout: timedelta) -> DeviceMesh:
    """`init_device_mesh`, each of whose groups gives up on a silent peer after `timeout`
    (dist_timeout_s), as the world group does. torch gives every group made after the world
    group its backend's default instead (30 minutes for gloo, 10 for NCCL): a stopped or stuck
    rank would hold the others that long in the EP all-to-all or a gradient sum. Set on the
    groups made, as torchtitan's `set_pg_timeouts` does: passing the timeout in backend options
    would also make a dim that spans the world a group of its own (another NCCL communicator)
    rather than the world group itself."""
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    for name in names:
        _set_pg_timeout(timeout, mesh.get_group(name))
    return mesh


def shutdown(wait_for_peers: bool = False) -> None:
    """Tear the process groups down. After a run that ended well on every rank, wait for the
    peers first: a rank that tears gloo down while a peer still writes its outputs can abort
    that peer at exit ("terminate called without an active exception", exit -6). Not after
    an error, where a peer may never arrive."""
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


def is_expert_param(name: str) -> bool:
    """Whether a parameter (our name, or a Hugging Face checkpoint's) is an expert weight:
    sharded over the EP group rather than replicated on every rank."""
    return ".experts." in name


def all_reduce_gradients(model: torch.nn.Module, layout: Layout) -> None:
    """Sum gradients as the module docstring explains."""
    if layout.world_size == 1:
        return
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        group = layout.expert_replica_group if is_expert_param(name) else None
        if group is None or dist.get_world_size(group) > 1:
            dist.all_reduce(param.grad, group=group)


def all_reduce_sum(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Sum `tensor` over the world in place (a no-op in a single process)."""
    if layout.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def all_reduce_max(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Take the elementwise maximum of `tensor` over the world in place (a no-op in a single
    process): the slowest rank, the fullest memory, whether any rank failed."""
    if layout.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def clip_factor(model: torch.nn.Module, max_norm: float, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm of the *global* gradient, and the factor that clips it to `max_norm` (1 when
    it is within), both on the device.

    Dense gradients are identical on every rank after the all-reduce, so they count once;
    each rank holds a distinct shard of the experts of its replica, so their squares are
    summed over the EP group. Sharded by FSDP (distributed/parallelize.py), every rank holds
    a distinct shard of every gradient, dense and expert alike, so the squares of the local
    shards are summed over the world. One norm kernel per gradient: one pass, no temporaries
    of its size, accumulated in fp32 whatever the gradients' dtype (a norm rounded to bf16 is
    up to 0.4 % off, and a sharded one differently). Not `torch._foreach_norm`: over the
    gradients of 8 layers of Mixtral-8x7B on an H200 it took 10.4 ms, one `vector_norm` per
    tensor 6.7 ms (a copy of the same bytes reads them at 4.3 TB/s: 5.5 ms).
    """
    dense, experts = [], []
    for name, param in model.named_parameters():
        if param.grad is not None:
            (experts if is_expert_param(name) else dense).append(param.grad)
    sharded = any(isinstance(grad, DTensor) for grad in dense + experts)
    if sharded:  # DTensors of two meshes do not mix: work on the local shards (views)
        dense, experts = [grad.to_local() for grad in dense + experts], []
    device = next(model.parameters()).device
    squares = torch.stack([torch.stack([torch.linalg.vector_norm(grad, dtype=torch.float32) for grad in grads])
                           .square().sum().to(device) if grads else torch.zeros((), device=device)
                           for grads in (dense, experts)])
    if sharded:
        all_reduce_sum(squares, layout)
    elif layout.ep_group is not None and layout.ep_size > 1:
        dist.all_reduce(squares[1:], group=layout.ep_group)
    total_norm = squares.sum().sqrt()
    # torch.nn.utils.clip_grads_with_norm_'s factor.
    return total_norm, (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, layout: Layout) -> torch.Tensor:
    """Scale the gradients in place by `clip_factor` (one multi-tensor pass); return the norm."""
    total_norm, factor = clip_factor(model, max_norm, layout)
    # DTensor gradients of two meshes do not mix in one multi-tensor call: scale their local shards.
    torch._foreach_mul_([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                         for p in model.parameters() if p.grad is not None], factor)
    return total_norm
