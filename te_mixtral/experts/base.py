"""The one interface every expert-FFN tier implements.

Shape suffixes: see te_mixtral/__init__.py.

A tier computes, for every local expert l and the rows routed to it,

    y = (silu(x @ gate_l.T) * (x @ up_l.T)) @ down_l.T

where `gate_up_L2FD[l]` stacks gate (first F rows) over up (last F rows), exactly as
Hugging Face transformers v5 stores `MixtralExperts.gate_up_proj`. All tiers read the same
two stacked parameters (the one parameter layout), so a checkpoint trained with one tier
loads into any other.

With LoRA, the tier also gets the experts' low-rank adapters (`adapters`, an
`ExpertAdapters`: te_mixtral/experts/adapters.py) and adds their deltas to both projections;
the base weights are then frozen. A tier that cannot run adapters says so (`takes_adapters`).

Rows arrive sorted by local expert: rows [0, n_0) belong to expert 0, the next n_1 to
expert 1, and so on, with `tokens_per_expert_L` = (n_0, ..., n_{L-1}) an int64 tensor on
the rows' device. Experts with zero rows, and R == 0, are valid inputs.
"""

import abc
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from te_mixtral.experts.adapters import ExpertAdapters


def swiglu(gate_up_RF2: torch.Tensor) -> torch.Tensor:
    """The activation every tier applies between its two GEMMs: silu(gate) * up."""
    gate_RF, up_RF = gate_up_RF2.chunk(2, dim=-1)
    return F.silu(gate_RF) * up_RF


@dataclass(frozen=True)
class ExpertLoad:
    """What the fit check (te_mixtral/planning/memory.py) tells a tier when it asks what the
    tier holds: the device, the rows one forward routes to this rank's experts, and the bytes
    of an element of the activations and of the parameters."""

    device: str  # "cuda" or "cpu"
    rows: int  # R
    local_experts: int  # L
    activation_bytes: int  # the compute dtype's
    weight_bytes: int  # the parameters' (with LoRA, the frozen base's: the compute dtype)


@dataclass(frozen=True)
class ExpertMemory:
    """What a tier holds for one decoder layer on this rank, in bytes: the tier says, the fit
    check adds (te_mixtral/planning/memory.py). `autograd` is a plain PyTorch expert FFN's."""

    hidden: int  # what the forward saves for the backward: the hidden rows, and the tier's own extras
    hidden_grad: int  # in flight in the backward beside the input's and output's gradients
    weight_copies: int = 0  # copies of the expert weights (FP8, say) the tier makes while a layer runs
    weight_copies_saved: int = 0  # of those, what a layer that recomputes nothing keeps for its backward
    weight_copies_cached: int = 0  # of those, kept from a layer's first forward to the optimizer step
    weights_saved: int = 0  # bytes the tier's storage of the expert weights saves on the parameters'
    holds: str = ""  # how the tier holds the experts when it saves some, for the estimate's title

    @classmethod
    def autograd(cls, intermediate_size: int, load: ExpertLoad, fused: bool = False) -> "ExpertMemory":
        """Autograd's SwiGLU FFN: gate_up's output (R x 2F), silu(gate) and the product (R x F
        each), and their gradients in the backward; `fused`: a tier that keeps gate_up's output
        alone and makes the rest again in the backward."""
        a, R, F = load.activation_bytes, load.rows, intermediate_size
        return cls(hidden=a * R * (2 * F if fused else 4 * F), hidden_grad=a * R * (F if fused else 2 * F))

    def held_in(self, frozen_weight: type, load: ExpertLoad, hidden_size: int,
                intermediate_size: int) -> "ExpertMemory":
        """This, with the layer's expert weights (gate_up [L, 2F, D], down [L, D, F]) held in
        `frozen_weight`'s format (a `FrozenWeight` class, experts/quant/frozen.py) in place of
        the parameters' dtype."""
        L, D, F = load.local_experts, hidden_size, intermediate_size
        shapes = ((L, 2 * F, D), (L, D, F))
        saved = sum(load.weight_bytes * math.prod(shape) - frozen_weight.stored_bytes(shape) for shape in shapes)
        return replace(self, weights_saved=saved, holds=f"its experts in {frozen_weight.format}")


class ExpertTier(abc.ABC):
    """Base class of the tiers: everything the model and the training loop call on a tier.

    A tier overrides `__call__` and sets `name`; the rest has defaults that suit a tier
    written in plain PyTorch with no options.
    """

    name: str  # the name the registry lists it under (te_mixtral/experts/registry.py)
    # Its options' dataclass (experts/options.py), which the run config holds as a section
    # (`RunConfig.fp8`) and `--help` lists under the tier; None: it has none.
    options: type | None = None
    takes_adapters: bool = False  # whether `__call__` runs LoRA adapters (lora.rank > 0)
    frozen_bases: tuple[str, ...] = ()  # the `lora.base` formats besides "default" it holds a frozen base in
    # Whether rows past the last expert's may follow the real ones (the padded exchange's,
    # distributed/dispatch.py): the tier leaves them out of every result but its own output
    # rows there, which it may fill with anything.
    takes_padded_rows: bool = False

    @classmethod
    def frozen_format(cls, lora_base: str) -> str:
        """The format this tier holds a LoRA run's frozen expert weights in, `lora.base` being
        `lora_base` (one it takes): the base a checkpoint's adapters were trained over, which a
        resume must hold alike (training/resume_checks.py)."""
        return lora_base

    @classmethod
    def from_config(cls, cfg) -> "ExpertTier":
        """The tier for a run config (`te_mixtral.config.RunConfig`); a tier with options reads them here."""
        return cls()

    @classmethod
    def check_options(cls, cfg) -> None:
        """Raise a one-line `UserError` if the run config `cfg` gives one of this tier's options
        a value it cannot take. Checked whichever tier runs: every config carries every tier's
        options (a saved config.yaml lists them all), and one set for a tier that is not
        running is a mistake to name, not to ignore."""

    @classmethod
    def check(cls, cfg) -> None:
        """Raise a one-line `UserError` if the run config `cfg` sets an option of this tier, or
        pairs this tier with a setting, that it cannot take. The registry calls it once the
        config loads, before anything runs; a tier with no options has nothing to check."""

    @classmethod
    def memory(cls, cfg, load: ExpertLoad) -> ExpertMemory:
        """What this tier holds per layer for a run of `cfg` (`load`: the device, the rows
        routed to this rank's experts, ...); a plain autograd tier holds autograd's."""
        return ExpertMemory.autograd(cfg.model.intermediate_size, load)

    @classmethod
    def lighter(cls, cfg) -> list[tuple[str, dict]]:
        """(command-line setting, config overrides) of this tier's options that would hold less
        than `cfg`'s, at some cost in time: what the fit check suggests when a run does not fit."""
        return []

    def check_available(self, device: torch.device) -> None:
        """Raise `TierUnavailable` with a one-line reason if this tier cannot run on `device`."""

    def describe(self) -> dict:
        """What runs, beyond the tier's name (recipe, kernel, ...): merged into the run header."""
        return {}

    def calls(self) -> dict[str, int]:
        """How many calls ran each of the tier's paths, for a tier that has more than one
        (results.json's `tier_calls`); empty for a tier with one."""
        return {}

    def sync_free(self) -> bool:
        """Whether a call on a GPU never waits for it from the host (split sizes stay on the
        device, every shape comes from shapes), so that a CUDA graph can capture it: what
        generation's decode step asks (training/generate.py). A tier that says so is checked
        under `torch.cuda.set_sync_debug_mode("error")` in tests/gpu."""
        return False

    def expert_weight(self, shape: tuple[int, ...], frozen: bool = False) -> nn.Module:
        """The storage of one stacked expert weight of the model this tier runs: a parameter
        in the default dtype, or, for a base that does not train (`frozen`: LoRA's), what a
        tier reads instead (FP8 alone, device_mxfp8.py; NF4 with `lora.base nf4`,
        custom_grouped.py), which the model passes to `__call__` in its place. The model says
        whether its base is frozen; the tier learns it here."""
        return nn.Parameter(torch.empty(shape))

    def recomputes_hidden(self, x_RD: torch.Tensor) -> bool:
        """Whether `recompute_hidden` runs for these rows. Selective recompute
        (model/recompute.py) calls it where it does, and otherwise runs the whole tier again
        in the backward under torch's checkpoint."""
        return False

    def recompute_hidden(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None) -> torch.Tensor:
        """`__call__` keeping only its inputs for the backward, which computes again only what
        it needs of the hidden rows (a tier that can do better than re-running itself)."""
        raise NotImplementedError(f"tier {self.name} is recomputed by torch's checkpoint")

    @abc.abstractmethod
    def __call__(
        self,
        x_RD: torch.Tensor,
        tokens_per_expert_L: torch.Tensor,
        gate_up_L2FD: torch.Tensor,
        down_LDF: torch.Tensor,
        adapters: ExpertAdapters | None = None,
    ) -> torch.Tensor:
        """Return y_RD, differentiable with respect to x, both weights and the adapters."""
