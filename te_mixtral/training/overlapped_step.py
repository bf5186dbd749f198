"""The optimizer step overlapped with the next forward (`train.optimizer_overlap`).

Why. master_adamw's update is bound by memory bandwidth (18 bytes a weight with bf16 moments,
read and written once), and the next forward waits for all of it, although it needs the
embeddings' new weights first and the LM head's last. Here the update runs on a CUDA stream of
its own, one unit at a time in the order the forward uses them (the embeddings, each decoder
layer, the final norm, the LM head), and each unit's forward waits for its own unit only: the
later units' update runs beside the earlier units' forward, on the SMs and the bandwidth that
their GEMMs and attention leave free.

What stays the same. The same update of every weight, to the bit: the same kernels with the
same settings, only later. The host side (step counts, learning rates) moves when `step` is
called, as without overlap; only the GPU's work waits. What reads the weights or the optimizer
state outside a forward (checkpoints, exports, evaluation, the report) calls `wait` first.

Memory. The gradients are dropped when the loop zeroes them, as before, but the allocator gives
their memory back only once the update stream has read them (`record_stream`): as the forward
advances, not before it starts.

On a CPU there are no streams: `step` updates everything at once, as the optimizer would.
"""

import torch
from torch import nn

from te_mixtral.optim import MasterAdamW


def forward_units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The model's trained parameters by the module whose forward first uses them, in the
    forward's order: embeddings, each decoder layer, final norm, LM head (a tied head's weight
    is the embeddings'). Parameters outside them join the first unit, which waits before all."""
    body = model.model
    modules = [body.embed_tokens, *body.layers, body.norm, model.lm_head]
    seen: set[nn.Parameter] = set()
    units = []
    for module in modules:
        params = [p for p in module.parameters() if p.requires_grad and p not in seen]
        seen.update(params)
        units.append((module, params))
    units[0][1][:0] = [p for p in model.parameters() if p.requires_grad and p not in seen]
    return units


class OverlappedStep:
    """`step` launches the optimizer's update on a side stream, unit by unit; each unit's
    forward pre-hook makes the compute stream wait for that unit's update."""

    def __init__(self, model: nn.Module, optimizer: MasterAdamW):
        if not isinstance(optimizer, MasterAdamW):
            raise ValueError("optimizer_overlap steps master_adamw's update unit by unit; "
                             f"got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.units = forward_units(model)
        device = next(model.parameters()).device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._unit_of_last = {params[-1]: module for module, params in self.units if params}
        self._pending: dict[nn.Module, torch.cuda.Event] = {}
        self._hooks = [module.register_forward_pre_hook(self._wait_for) for module, _ in self.units]

    def step(self, grad_scale: torch.Tensor | None) -> None:
        """The optimizer's step, given what `clip_gradients` returned."""
        order = [p for _, params in self.units for p in params]
        if self.stream is None:
            self.optimizer.step(grad_scale=grad_scale, params=order)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self.optimizer.step(grad_scale=grad_scale, params=order, launched=self._mark)
        for p in order:  # read on the side stream: not to be reused before it has
            if p.grad is not None:
                p.grad.record_stream(self.stream)
        if grad_scale is not None:
            grad_scale.record_stream(self.stream)

    def _mark(self, p: nn.Parameter) -> None:
        module = self._unit_of_last.get(p)
        if module is not None:
            self._pending[module] = torch.cuda.Event()
            self._pending[module].record(self.stream)

    def _wait_for(self, module: nn.Module, args) -> None:
        event = self._pending.pop(module, None)
        if event is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(event)

    def wait(self) -> None:
        """Make the compute stream wait for the whole update: before anything but a forward
        reads the weights or the optimizer state."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._pending.clear()

    def remove(self) -> None:
        """Wait, and take the hooks off the model."""
        self.wait()
        for hook in self._hooks:
            hook.remove()
