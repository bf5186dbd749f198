"""AdamW over bf16 parameters that keeps an exact fp32 master in 16 extra bits per weight.

Why. fp32 parameters with torch's AdamW cost 16 bytes per weight (parameter, gradient, two
moments), too much for Mixtral-8x7B on a few GPUs, and the model then casts every weight
to bf16 in every forward. Keeping the parameters in bf16 halves that, but updating bf16
weights directly loses most small updates to rounding. Here the parameter *is* the top
half of an fp32 master and the optimizer keeps the bottom half, an int16 `remainder`
(`bits.py`): the master is rebuilt exactly at every step, updated in fp32 and split again,
so training follows an fp32-master AdamW, and the model computes on the bf16 parameter
with no casts. Per weight: 2 (param) + 2 (grad) + 2 (remainder) + 2 x moment bytes, i.e.
10 bytes with bf16 moments or 14 with fp32 moments.

Semantics are torch.optim.AdamW's (decoupled weight decay on the master, bias correction,
eps added to sqrt of the bias-corrected second moment; `adamw_torch.py` has the formula),
per parameter group (lr, betas, eps, weight_decay). Not supported: amsgrad, maximize,
sparse gradients. The bf16 parameter is the master rounded to nearest with ties away from
zero (see `bits.py` for why not ties-to-even); bf16 moments are rounded to nearest even.

Gradients are read from `param.grad`: bf16 normally, or fp32 where the parameter's
`grad_dtype` allows fp32 gradients (torch >= 2.10).

Implementations (`impl`): "triton" runs `adamw_kernel.py` (one launch per tensor; on CPU
tensors it needs TRITON_INTERPRET=1), "torch" runs `adamw_torch.py`, and "auto" picks the
kernel for CUDA tensors when Triton imports and torch otherwise. The kernel, in Triton's
interpreter or compiled for a GPU, gives the same bits as the torch path on the CPU.

State per parameter: `remainder` (int16), `exp_avg`, `exp_avg_sq` (`moment_dtype`), `step`
(a CPU float32 tensor, as torch keeps it, so reading it never waits for the GPU).
`load_state_dict` restores them bit for bit in their own dtypes: torch's own loader would
cast every floating state tensor to the parameter's dtype, which would round fp32 moments
to bf16 and turn the int16 remainders into numbers.

8-bit moments, per parameter group (`"moments_8bit": True`, a group option like lr): the two
moments of that group's parameters are kept in 8 bits a value, in blocks of 256 with a
power-of-two scale each (`moments8.py` says how and why; about 2.03 bytes for both instead
of 4 in bf16 or 8 in fp32). The master stays exact; the update is computed in fp32 as above
from the moments read back, and the new moments are rounded to 8 bits when stored. Their
state is `MOMENTS_8BIT` in place of `exp_avg` and `exp_avg_sq`. Meant for the experts:
te_mixtral/training/optimizer.py puts them in such a group under `train.expert_moments 8bit`.

Sharded parameters (FSDP2's DTensors, te_mixtral/distributed/parallelize.py). The update is
elementwise, so each rank updates its local shard alone: the state of a DTensor parameter is
made of DTensors sharded like it (torch.zeros_like keeps the placement), and the step runs
on their local tensors. A sharded step therefore gives, shard by shard, the bits of the
unsharded step, and torch.distributed.checkpoint's state-dict functions see the state as
they see torch's AdamW's. FSDP2 cannot change a parameter's dtype once it has sharded it,
so a model built in fp32 is split first (`split_to_bf16`), sharded, and its remainders then
sharded like the parameters (`__init__`'s `remainders`).

Typical use, from a model built in fp32:

    optimizer = MasterAdamW.from_fp32(groups, lr=3e-4, moment_dtype=torch.bfloat16)
    # the model's parameters are now bf16; optimizer.master(p) is p's exact fp32 master
"""

import functools
from collections.abc import Iterable
from itertools import chain

import torch
from torch.distributed.tensor import DTensor

from te_mixtral.optim.adamw_torch import (
    StepScalars,
    adamw_update_8bit_torch,
    adamw_update_torch,
)
from te_mixtral.optim.bits import join_master, split_master
from te_mixtral.optim.moments8 import check_blockable, scales_shape

IMPLS = ("auto", "triton", "torch")
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
# The state of a parameter whose group has moments_8bit (moments8.py): exp_avg, and the square
# root of exp_avg_sq, each as uint8 codes shaped like the parameter and fp32 scales per block.
MOMENTS_8BIT = ("exp_avg_codes", "exp_avg_scales", "sqrt_exp_avg_sq_codes", "sqrt_exp_avg_sq_scales")


@functools.cache
def _triton_updates():
    """The kernels' launchers (moments as they are, 8-bit moments), or None where Triton does not import."""
    try:
        from te_mixtral.optim.adamw_kernel import (
            adamw_update_8bit_triton,
            adamw_update_triton,
        )
    except ImportError:
        return None
    return adamw_update_triton, adamw_update_8bit_triton


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local shard (a view: writes go through), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def split_to_bf16(p: torch.nn.Parameter) -> torch.Tensor:
    """Make fp32 parameter `p` its bf16 top half in place; return the bottom half (the int16
    remainder). The Parameter object stays the same: modules keep referring to it."""
    if p.dtype != torch.float32 or isinstance(p, DTensor):
        raise ValueError(f"split_to_bf16 needs unsharded fp32 parameters, got {type(p.data).__name__} "
                         f"{p.dtype} {tuple(p.shape)}")
    bf16_bits, remainder = split_master(p.detach())
    p.data = bf16_bits.view(torch.bfloat16).view(p.shape)
    return remainder.view(p.shape)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW for bf16 parameters with an exact fp32 master (bf16 param + int16 remainder)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 moment_dtype: torch.dtype = torch.float32, impl: str = "auto",
                 remainders: dict[torch.Tensor, torch.Tensor] | None = None):
        """`remainders`: each parameter's int16 remainder (from `split_to_bf16`), laid out like
        the parameter (a DTensor sharded like it, for a sharded one); zero where absent."""
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
        if moment_dtype not in MOMENT_DTYPES:
            raise ValueError(f"moment_dtype must be torch.float32 or torch.bfloat16, not {moment_dtype}")
        if impl == "triton" and _triton_updates() is None:
            raise ValueError("impl='triton' but triton does not import here")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "moments_8bit": False}
        super().__init__(params, defaults)
        self.moment_dtype = moment_dtype
        self.impl = impl
        for p in self._params():
            if p.dtype != torch.bfloat16 or not _local(p).is_contiguous():
                raise ValueError(f"MasterAdamW needs contiguous bf16 parameters, got {p.dtype} "
                                 f"{tuple(p.shape)}; build it with MasterAdamW.from_fp32 from fp32 ones")
        for group in self.param_groups:
            for p in group["params"] if group["moments_8bit"] else ():
                check_blockable(_local(p).shape, "a parameter in a group with moments_8bit")
                if isinstance(p, DTensor) and any(pl.is_shard() and pl.dim != 0 for pl in p.placements):
                    raise ValueError(f"8-bit moments need a parameter sharded along its first dimension only, "
                                     f"got placements {p.placements}")
        for p, remainder in (remainders or {}).items():
            if isinstance(remainder, DTensor) != isinstance(p, DTensor) or remainder.shape != p.shape or remainder.dtype != torch.int16:
                raise ValueError(f"the remainder of a {tuple(p.shape)} parameter must be an int16 tensor laid out "
                                 f"like it, got {type(remainder).__name__} {remainder.dtype} {tuple(remainder.shape)}")
            self.state[p]["remainder"] = remainder

    @classmethod
    def from_fp32(cls, params, **kwargs) -> "MasterAdamW":
        """Convert fp32 parameters to bf16 in place and return an optimizer whose masters
        equal the original fp32 values exactly.

        `params` is what the constructor takes (parameters, or groups of them). Each
        Parameter object stays the same (modules keep referring to it); only its data
        becomes the bf16 top half of the old value, the bottom half going to the optimizer.
        """
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        groups = [{**g, "params": list(g["params"])} for g in groups]
        remainders = {p: split_to_bf16(p) for p in chain.from_iterable(g["params"] for g in groups)}
        return cls(groups, **kwargs, remainders=remainders)

    def _params(self) -> Iterable[torch.nn.Parameter]:
        return chain.from_iterable(g["params"] for g in self.param_groups)

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master of parameter `p` (a new tensor, a DTensor sharded like a sharded
        `p`): for export and for checks."""
        remainder = self.state[p].get("remainder") if p in self.state else None
        if remainder is None:  # never stepped nor built from fp32: the master is the bf16 value
            return p.detach().float()
        local = _local(p.detach())
        master = join_master(local.view(torch.int16), _local(remainder)).view(local.shape)
        if isinstance(p, DTensor):
            return DTensor.from_local(master, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        return master

    def _state(self, p: torch.Tensor, moments_8bit: bool) -> dict:
        state = self.state[p]
        if "remainder" not in state:
            state["remainder"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.contiguous_format)
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in MOMENTS_8BIT if moments_8bit else ("exp_avg", "exp_avg_sq"):
                state[key] = self._zero_moment(p, key)
        return state

    def _zero_moment(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """A zero moment of `p` for state `key`: `moment_dtype`, or 8-bit codes or their scales."""
        if key in ("exp_avg", "exp_avg_sq"):
            return torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.contiguous_format)
        if key.endswith("_codes"):
            return torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
        local = torch.zeros(scales_shape(_local(p).shape), dtype=torch.float32, device=p.device)
        if isinstance(p, DTensor):  # sharded along the rows, as the parameter (the constructor checked)
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                      shape=torch.Size(scales_shape(p.shape)), stride=(local.shape[1], 1))
        return local

    def _update_fn(self, p: torch.Tensor, moments_8bit: bool):
        triton_updates = _triton_updates()
        if self.impl == "triton" or (self.impl == "auto" and p.is_cuda and triton_updates is not None):
            return triton_updates[moments_8bit]
        return adamw_update_8bit_torch if moments_8bit else adamw_update_torch

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None):
        """One AdamW update of every parameter with a gradient; each gradient is multiplied by
        `grad_scale` (a scalar tensor, e.g. the gradient-clipping factor) as it is read, so a
        clip costs no pass of its own over the gradients and the factor never visits the host."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MasterAdamW does not support sparse gradients")
                moments_8bit = group["moments_8bit"]
                state = self._state(p, moments_8bit)
                state["step"] += 1
                scalars = StepScalars.for_step(float(group["lr"]), group["weight_decay"], beta1, beta2,
                                               group["eps"], int(state["step"].item()))
                moments = MOMENTS_8BIT if moments_8bit else ("exp_avg", "exp_avg_sq")
                tensors = (p, state["remainder"], p.grad, *(state[key] for key in moments))
                self._update_fn(p, moments_8bit)(*(_local(t) for t in tensors), scalars,
                                                 self._grad_scale(grad_scale, p.device))
        return loss

    @staticmethod
    def _grad_scale(grad_scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        if grad_scale is None:
            return torch.ones((), dtype=torch.float32, device=device)
        return grad_scale.to(device, torch.float32)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, then the tensors put back with their own dtypes (see the module
        docstring); moments that are not 8-bit take this optimizer's `moment_dtype` (no-op on a
        normal resume)."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for param_id, p in zip(saved_ids, self._params()):
            for key, saved in state_dict["state"].get(param_id, {}).items():
                if key != "step" and isinstance(saved, torch.Tensor):
                    dtype = self.moment_dtype if key in ("exp_avg", "exp_avg_sq") else saved.dtype
                    self.state[p][key] = saved.to(p.device, dtype, copy=True)
