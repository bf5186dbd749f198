"""The padded exchange's capacity over a run: the training loop's side of
te_mixtral/distributed/dispatch.py's padded all-to-all.

A step's exchanges are padded to `capacity` times each rank's even share of rows. After the
step's backward, with the losses it reads anyway, the loop reads the largest share any layer
of any rank had to send one rank: if that outgrew the capacity, some rows were dropped, so
the step's gradients are thrown away and it runs again with the capacity raised past the
need. A step is never applied with a row missing; a rerun costs one step's time, counted in
its timing, and the run's results say which steps ran again.

A checkpoint keeps the capacity the run raised it to (`state`), and a resume goes on at it
(`resume`): started again at the configured one, it would pad other rows than the run never
stopped, and run again steps that run had room for. LoRA's dropout draws its masks over the
padded rows, so either would train the resumed run on other masks.
"""

import contextlib
from dataclasses import dataclass, field

import torch

from te_mixtral.distributed.layout import Layout, all_reduce_max
from te_mixtral.model.mixtral import MixtralForCausalLM

# Raised past the share that overflowed by this much, so that the next steps' routing, which
# drifts slowly, rarely needs another rerun.
HEADROOM = 1.1


@dataclass
class ExchangeCapacity:
    capacity: float  # times the even share; 0: exact exchanges (the host learns every split)
    configured: float = field(init=False)
    steps_run_again: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.configured = self.capacity

    def start(self, model: MixtralForCausalLM) -> None:
        if self.capacity:
            model.pad_exchanges(self.capacity)

    @contextlib.contextmanager
    def exact(self, model: MixtralForCausalLM):
        """Exact exchanges inside: evaluation and generation, whose forwards no step checks."""
        if self.capacity:
            model.pad_exchanges(0)
        try:
            yield
        finally:
            self.start(model)

    def needed(self, model: MixtralForCausalLM, layout: Layout) -> list[torch.Tensor]:
        """[] for exact exchanges; else the step's largest share over every rank, float64 [1]."""
        if not self.capacity:
            return []
        return [all_reduce_max(model.exchange_needed().double()[None], layout)]

    def short(self, needed: list[float]) -> bool:
        return bool(needed) and needed[0] > self.capacity

    def raise_to(self, model: MixtralForCausalLM, needed: float, step: int, say: bool) -> None:
        old, self.capacity = self.capacity, needed * HEADROOM
        model.pad_exchanges(self.capacity)
        self.steps_run_again.append(step)
        if say:
            print(f"te_mixtral: step {step}: a rank had {needed:.2f}x its even share of rows for another, more than "
                  f"the padded exchange's {old:.2f}x; the step runs again at {self.capacity:.2f}x", flush=True)

    def state(self) -> dict:
        """What a checkpoint keeps for `resume` (TrainState.exchange): empty for exact exchanges."""
        return {"capacity": self.capacity, "steps_run_again": list(self.steps_run_again)} if self.configured else {}

    def resume(self, saved: dict, say: bool) -> None:
        """Go on where the checkpoint's run was (`saved`, its `state()`): at the capacity it had
        raised to, unless this run configures more, or exact exchanges."""
        if not (self.capacity and saved):
            return
        self.steps_run_again = list(saved["steps_run_again"])
        if saved["capacity"] > self.capacity:
            self.capacity = saved["capacity"]
            if say:
                print(f"te_mixtral: the padded exchange goes on at {self.capacity:.2f}x, where the checkpoint's run "
                      f"had raised it (ep_capacity {self.configured:g})", flush=True)

    def record(self) -> dict:
        """For results.json: empty for exact exchanges."""
        if not self.configured:
            return {}
        return {"ep_capacity": {"configured": self.configured, "final": self.capacity,
                                "steps_run_again": self.steps_run_again}}
