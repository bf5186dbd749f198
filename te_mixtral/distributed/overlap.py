"""Gradient sums overlapped with the backward (`train.sharding: none`, several ranks).

The sums are layout.py's: dense gradients over the world, expert gradients over their
replicas, plain SUM with no division (the loss is already divided by the global target
count), in the gradients' own dtype. Done after backward, one all-reduce per parameter
(`layout.all_reduce_gradients`), they would all wait for the last layer's backward; here
they start while the backward of the layers below still runs.

How. The parameters are grouped into buckets of about `BUCKET_BYTES`, one group (world or
expert replicas) and one dtype each, in reverse registration order: roughly the order in
which the backward produces their gradients, LM head first, embeddings last. A hook that
runs once a parameter's gradient is complete (`register_post_accumulate_grad_hook`) counts
it; a bucket whose count is full is copied into one flat tensor and all-reduced
asynchronously. `finish` waits for them all and copies the sums back into the gradients.

- Launch order. Every rank must issue the same collectives in the same order on a group,
  whatever order its backward happened to finish the buckets in: a bucket is launched only
  after the buckets before it on its group (so a ready bucket may wait for an earlier one).
- Own groups. The reducer all-reduces on process groups of its own, so that launches from
  inside the backward never interleave with the model's own collectives there (the
  dispatch all-to-all, the router losses' all-reduce), whose order they would have to match.
- Gradient accumulation. The hooks count only while `sync` is on: the earlier micro-batches
  of a step add into `.grad` and communicate nothing; the last one launches the buckets.
- Buckets never completed in a backward (a parameter that got no gradient on some rank)
  are launched by `finish`, the missing gradients counting as zeros; every rank then
  receives the sum, so the replicas stay identical.

Hand-written rather than torch's: DDP wraps a module over one group and cannot wrap the
experts again over another, and `replicate` (torch.distributed._composable, a private API)
turns every parameter into a DTensor, which unsharded checkpoints, the HF export, gradient
clipping and both optimizers would all have to learn, for the same all-reduces.

Memory. A bucket's gradients move into its flat tensor rather than being copied: the
originals are dropped at launch and `finish` hands the sums back as views of the flat
tensor. So the buckets cost no more than one bucket's concatenation in flight (as DDP's
`gradient_as_bucket_view`), which matters where the full model only just fits.
"""

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from te_mixtral.distributed.layout import Layout, is_expert_param, timed_mesh

BUCKET_BYTES = 25 * 2**20  # DDP's default: large enough for the bandwidth, small enough to start early


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: dist.ProcessGroup
    nbytes: int = 0
    ready: int = 0  # how many of `params` have their gradient in this backward
    flat: torch.Tensor | None = None  # the gradients, concatenated and being summed
    work: dist.Work | None = None


@dataclass
class _Queue:
    """The buckets of one group, launched strictly in this order."""
    buckets: list[_Bucket] = field(default_factory=list)
    launched: int = 0


class GradientReducer:
    """Sums a model's gradients over `layout` during its backward (the module docstring)."""

    def __init__(self, model: nn.Module, layout: Layout, bucket_bytes: int = BUCKET_BYTES):
        mesh = timed_mesh(layout.mesh.device_type, tuple(layout.mesh.shape), ("replica", "ep"), layout.timeout)
        # Experts of an EP group as wide as the world have no replicas: nothing to sum.
        groups = {"dense": dist.new_group(timeout=layout.timeout),
                  "experts": mesh.get_group("replica") if mesh.size(0) > 1 else None}
        self.queues = {kind: _Queue() for kind, group in groups.items() if group is not None}
        self.sync = True
        filling: dict[tuple[str, torch.dtype], _Bucket] = {}
        for name, param in reversed(list(model.named_parameters())):
            kind = "experts" if is_expert_param(name) else "dense"
            if not param.requires_grad or kind not in self.queues:
                continue
            bucket = filling.get((kind, param.dtype))
            if bucket is None or bucket.nbytes + param.nbytes > bucket_bytes:
                bucket = filling[(kind, param.dtype)] = _Bucket([], groups[kind])
                self.queues[kind].buckets.append(bucket)
            bucket.params.append(param)
            bucket.nbytes += param.nbytes
            param.register_post_accumulate_grad_hook(partial(self._gradient_ready, self.queues[kind], bucket))

    @property
    def buckets(self) -> list[_Bucket]:
        return [bucket for queue in self.queues.values() for bucket in queue.buckets]

    def _gradient_ready(self, queue: _Queue, bucket: _Bucket, param: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket.ready += 1
        while queue.launched < len(queue.buckets):
            first = queue.buckets[queue.launched]
            if first.ready < len(first.params):
                break
            self._launch(first)
            queue.launched += 1

    @staticmethod
    def _launch(bucket: _Bucket) -> None:
        bucket.flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                 for p in bucket.params])
        for param in bucket.params:
            param.grad = None  # the flat tensor holds it now (see Memory in the module docstring)
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket's sum (launching those the backward did not complete, in
        order) and make it the gradients; ready for the next step's backward."""
        for queue in self.queues.values():
            for bucket in queue.buckets[queue.launched:]:
                self._launch(bucket)
            queue.launched = 0
        for bucket in self.buckets:
            bucket.work.wait()
            for param, summed in zip(bucket.params, bucket.flat.split([p.numel() for p in bucket.params])):
                param.grad = summed.view_as(param)
            bucket.ready, bucket.flat, bucket.work = 0, None, None
