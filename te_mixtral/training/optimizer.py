"""The optimizer a run steps, and its learning-rate schedule.

`train.optimizer` chooses between two AdamWs with the same update rule:
- `adamw`: fp32 parameters, fp32 gradients and moments, torch's fused AdamW on CUDA: 16 bytes
  per parameter, and under bf16 autocast every weight matrix is cast to bf16 in every
  forward. The reference.
- `master_adamw` (bf16 runs): the parameters themselves are bf16, so the forward casts
  nothing, and the optimizer keeps the fp32 master exactly as a 16-bit remainder per weight
  (te_mixtral/optim/): 10 bytes per parameter with bf16 moments, 14 with fp32 moments.
  Written here rather than taken from TE: TE's FusedAdam with the same state runs at about
  half the memory-bandwidth floor (benchmarks/optimizer_step.py measures both).
  Under `train.sharding: fsdp` it steps each rank's shards (te_mixtral/optim/master_adamw.py).
  With `train.expert_moments: 8bit` the experts' moments are block-wise 8-bit
  (te_mixtral/optim/moments8.py): about 8 bytes per expert parameter in all, the experts
  being nearly all of Mixtral's weights; the others keep `moment_dtype`.

Norms and other vectors get no weight decay in either.
"""

import math

import torch
from torch import nn

from te_mixtral.config import RunConfig
from te_mixtral.distributed.layout import clip_factor, clip_grad_norm, is_expert_param
from te_mixtral.distributed.parallelize import shard_like
from te_mixtral.optim import MasterAdamW
from te_mixtral.optim.master_adamw import split_to_bf16

MOMENT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def split_masters(model: nn.Module, cfg: RunConfig) -> dict[str, torch.Tensor] | None:
    """For `master_adamw`: turn the model's fp32 parameters into bf16 ones in place and return
    their int16 remainders by name, for `make_optimizer`. Called before `parallelize`: FSDP
    cannot change the dtype of a parameter it has sharded. None for `adamw`."""
    if cfg.train.optimizer != "master_adamw":
        return None
    return {name: split_to_bf16(p) for name, p in model.named_parameters()}


def make_optimizer(model: nn.Module, cfg: RunConfig,
                   remainders: dict[str, torch.Tensor] | None = None) -> torch.optim.Optimizer:
    """The run's optimizer. For `master_adamw`, `remainders` are what `split_masters` returned
    (the model may have been sharded since: each is sharded like its parameter); without them
    the model's fp32 parameters are split here. Either way the masters equal the fp32 values
    bit for bit."""
    t = cfg.train
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # LoRA: the adapters alone
    experts_8bit = t.optimizer == "master_adamw" and t.expert_moments == "8bit"
    matrices = [p for name, p in trained if p.dim() >= 2 and not (experts_8bit and is_expert_param(name))]
    vectors = [p for _, p in trained if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": t.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    if experts_8bit:
        experts = [p for name, p in trained if is_expert_param(name)]
        groups.append({"params": experts, "weight_decay": t.weight_decay, "moments_8bit": True})
    if t.optimizer == "master_adamw":
        options = {"lr": t.lr, "betas": (t.beta1, t.beta2), "moment_dtype": MOMENT_DTYPES[t.moment_dtype]}
        if remainders is None:
            return MasterAdamW.from_fp32(groups, **options)
        return MasterAdamW(groups, **options, remainders={p: shard_like(remainders[name], p)
                                                          for name, p in model.named_parameters()})
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)


def learning_rate(step: int, cfg: RunConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - 1 - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def clip_gradients(optimizer: torch.optim.Optimizer, model: nn.Module, max_norm: float,
                   layout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip to the global gradient norm `max_norm`: the norm, and what `step` passes on.
    MasterAdamW multiplies each gradient by the clip factor as it reads it, which saves the
    pass over the gradients (a read and a write of each) that scaling them first would take."""
    if isinstance(optimizer, MasterAdamW):
        return clip_factor(model, max_norm, layout)
    return clip_grad_norm(model, max_norm, layout), None


def optimizer_step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> None:
    """The optimizer step, given what `clip_gradients` returned."""
    if grad_scale is None:
        optimizer.step()
    else:
        optimizer.step(grad_scale=grad_scale)
