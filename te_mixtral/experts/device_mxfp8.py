"""The `device_mxfp8` tier: expert GEMMs in 8-bit floating point, split sizes on the device.

Shape suffixes: see te_mixtral/__init__.py. Q counts rows after padding.

One tier, three machines, and no pretending: each mode computes something different and
the tier says which one ran (`describe()`, for the run header and results JSON).

| mode             | where                  | what is computed                                         |
|------------------|------------------------|----------------------------------------------------------|
| `mxfp8-te`       | Blackwell (sm_100-110) | TE `GroupedLinear`, `MXFP8BlockScaling`: MXFP8 on tensor |
|                  | with TE                | cores. Not run on hardware here (quant/te_mxfp8.py).     |
| `fp8-hopper`     | Hopper (sm_90)         | FP8 E4M3 on tensor cores, one scale per row and column,  |
|                  |                        | fwd and bwd (quant/fp8_hopper.py), our Triton GEMMs      |
|                  |                        | (kernels/scaled_grouped_mm.py), SwiGLU fused into the    |
|                  |                        | casts (quant/fp8_swiglu.py). Not MXFP8: Hopper has no    |
|                  |                        | block-scaled FP8.                                        |
| `mxfp8-emulated` | anywhere (CPU, CI)     | MXFP8 numerics exactly per the OCP spec, GEMMs in        |
|                  |                        | fp32/bf16 on the dequantised values (quant/mxfp8.py).    |

With LoRA (`lora.rank` > 0) the base is frozen, and in mode `fp8-hopper` its expert weights
are held in FP8 alone, quantised once as they load (quant/frozen_fp8.py): the tier takes
adapters, runs every call in FP8 (there is no BF16 copy to fall back to) and no weight
gradient. The other modes have no frozen FP8 base and refuse LoRA in one line.

In mode `fp8-hopper` (`auto` on Hopper) a call with fewer rows per local expert than
`min_rows_per_expert` (the config's `fp8.min_rows_per_expert`, by default the break-even measured
on H100 and H200 at four local experts; 0 turns it off), or with fewer than four local experts
fewer rows in all than four experts at that size (`runs_fp8`), runs the BF16 `custom_grouped`
kernels instead: there FP8 is slower than BF16, because its casts cost about the same a call
however few experts it serves, every optimizer step quantises the weights again, and few rows
do not repay it (docs/precision.md states the break-even per GPU, and
`benchmarks/fp8_break_even.py` measures it). `describe()` says so, and `calls()`
(results.json's `tier_calls`) counts the calls that ran each path. The choice is the call's:
rows and local experts are shapes, known on the host, so it needs no sync. No other mode
switches: `mxfp8-te` has no break-even measured (no Blackwell GPU has run it), so it runs MXFP8
at every size rather than at a threshold nobody measured; the emulation is for numerics. A
frozen FP8 base (LoRA) runs FP8 at every size too: it has no BF16 copy to switch to, and it
quantises its weights once as they load, not at every optimizer step.

`mode="auto"` (the config's `fp8.mode` default) picks the hardware path: sm_90 runs
`fp8-hopper`, sm_100 to sm_110 run `mxfp8-te`. The CPU, any other GPU, or a mode the
device cannot run (say `mxfp8-te` on Hopper, or on Blackwell without TE), is a
`TierUnavailable` with one line saying why. A mode never falls back to another, and
emulation runs only where it was asked for by name (`--fp8.mode mxfp8-emulated`).

The tier's options are the config's `fp8` section (`FP8Options`, declared with their choices
in experts/options.py, which imports no torch).

All modes share the frame below: pad every expert's rows to the mode's alignment on the
device (quant/padding.py), run the expert MLP on the padded rows, drop the padding.
`fp8-hopper`'s kernels take any split, so it asks for no padding and its rows are not
copied. No
split size reaches the host in `fp8-hopper` and `mxfp8-emulated`: tests/experts/test_device_mxfp8.py
checks every op the tier issues, tests/gpu runs it under
`torch.cuda.set_sync_debug_mode("error")`. `mxfp8-te` is sync-free only where TE takes
its grouped-tensor path (`describe()["kernel"]` says whether it does).
"""

from collections import Counter
from dataclasses import replace

import torch

from te_mixtral.errors import TierUnavailable, UserError
from te_mixtral.experts.base import ExpertLoad, ExpertMemory, ExpertTier
from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.options import FP8_MODES, FP8Options
from te_mixtral.experts.quant import te_mxfp8
from te_mixtral.experts.quant.frozen_fp8 import FrozenFP8Weight
from te_mixtral.experts.quant.mxfp8 import MXFP8EmulatedGemms
from te_mixtral.experts.quant.padding import (
    PaddedRows,
    pad_rows,
    padded_rows,
    unpad_rows,
)
from te_mixtral.experts.quant.scaled_grouped import GroupedGemms, scaled_grouped_swiglu

HOPPER = (9, 0)
BLACKWELL = ((10, 0), (12, 0))  # [first, past-the-end) capabilities where TE runs MXFP8


def _sm(capability) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def select_mode(requested: str, device_type: str, capability=None, te_reason=lambda: None) -> str:
    """The mode that runs for `requested` on this device, or `TierUnavailable` saying why.

    `capability` is the CUDA compute capability, `te_reason()` why TE's MXFP8 cannot run
    (None if it can); both are arguments so every branch is testable without the hardware.
    """
    blackwell = capability is not None and BLACKWELL[0] <= tuple(capability) < BLACKWELL[1]
    mode = requested
    if requested == "auto":
        if capability == HOPPER:
            mode = "fp8-hopper"
        elif blackwell:
            mode = "mxfp8-te"
        else:
            where = device_type if capability is None else f"{device_type} {_sm(capability)}"
            # Both ways out: the emulation refuses LoRA, whose frozen FP8 base is Hopper's alone.
            raise TierUnavailable(f"tier 'device_mxfp8' has no 8-bit grouped GEMM for {where}; use --fp8.mode "
                                  "mxfp8-emulated to emulate MXFP8 numerics instead, or with LoRA (a frozen FP8 base "
                                  "needs a Hopper GPU) another tier, e.g. --tier custom_grouped")

    reason = None
    if device_type not in ("cpu", "cuda"):
        reason = f"it runs on the CPU or a CUDA GPU, not {device_type}"
    elif mode == "mxfp8-emulated":
        pass
    elif device_type != "cuda":
        reason = "it needs a CUDA GPU"
    elif mode == "fp8-hopper" and capability != HOPPER:
        reason = f"it needs a Hopper GPU (sm_90) and this one is {_sm(capability)}"
    elif mode == "mxfp8-te":
        if not blackwell:
            reason = f"MXFP8 tensor cores need a Blackwell GPU (sm_100 to sm_110), this one is {_sm(capability)}"
        else:
            reason = te_reason()
    if reason is not None:
        chosen = " (picked by mode 'auto')" if requested == "auto" else ""
        raise TierUnavailable(f"tier 'device_mxfp8' cannot run mode '{mode}'{chosen} here: {reason}")
    return mode


# Each mode's GEMMs scale their inputs in blocks along the reduction dimension, which is the
# hidden size D in one GEMM and the expert FFN size F in another: both must be a multiple of
# the block (32 elements for MXFP8; 16-byte alignment, 16 elements, for Hopper's FP8 GEMM).
# The expert rows are padded to a block by the tier; these two cannot be.
DIM_MULTIPLE = {"mxfp8-emulated": 32, "mxfp8-te": 32, "fp8-hopper": 16}


def check_dims(mode: str, hidden_size: int, intermediate_size: int) -> None:
    """Raise a one-line `UserError` if `mode`'s GEMMs cannot take the model's sizes."""
    multiple = DIM_MULTIPLE[mode]
    for key, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if size % multiple:
            raise UserError(f"tier 'device_mxfp8' in mode '{mode}' needs model.{key} to be a multiple of "
                            f"{multiple}, got {size}")


class _GemmsMLP:
    """The expert MLP from a set of grouped GEMMs (`scaled_grouped.scaled_grouped_swiglu`)."""

    def __init__(self, gemms: GroupedGemms):
        self.gemms = gemms
        self.recipe, self.kernel = gemms.recipe, gemms.kernel
        self.row_align, self.min_rows = gemms.row_align, gemms.min_rows

    def mlp(self, x_QD, padded: PaddedRows, gate_up_L2FD, down_LDF):
        return scaled_grouped_swiglu(x_QD, padded.offsets_L, gate_up_L2FD, down_LDF, self.gemms)


def _fp8_swiglu_experts(cache_weights: bool):
    # Imported here: its Triton kernels load only where the mode runs (the registry imports
    # this module on machines without Triton).
    from te_mixtral.experts.quant.fp8_swiglu import FP8SwiGLUExperts

    return FP8SwiGLUExperts(cache_weights=cache_weights)


# What runs each mode, made from the tier's options: an object with `mlp`, `recipe`,
# `kernel`, `row_align` and `min_rows`.
_MODE_RUNNERS = {
    "mxfp8-emulated": lambda tier: _GemmsMLP(MXFP8EmulatedGemms()),
    "fp8-hopper": lambda tier: _fp8_swiglu_experts(tier.cache_weights),
    "mxfp8-te": lambda tier: te_mxfp8.TEGroupedExperts(),
}


_BF16_BELOW = CustomGroupedTier()  # what fp8-hopper runs under its break-even size


# The local experts at which `min_rows_per_expert` is measured (benchmarks/fp8_break_even.py).
BREAK_EVEN_EXPERTS = 4


def runs_fp8(rows: int, local_experts: int, min_rows_per_expert: int) -> bool:
    """fp8-hopper's break-even rule (also the memory estimate's): FP8 unless the rows give
    each local expert fewer than `min_rows_per_expert` on average, or, with fewer than
    BREAK_EVEN_EXPERTS local experts, the call has fewer rows in all than that many experts at
    the threshold would (0: FP8 always).

    The threshold is a break-even measured at four local experts, and FP8's cost a call hardly
    depends on how many experts it serves: at one local expert its step took about as long at
    16 rows as at 1024, longer than BF16's at every size measured (docs/precision.md). So with
    fewer experts FP8 needs the rows in all that pay at four; with more, each expert still
    needs the threshold's rows, its weights being quantised again every optimizer step."""
    return rows >= min_rows_per_expert * max(local_experts, BREAK_EVEN_EXPERTS)


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return f"{torch.cuda.get_device_name(device)} ({_sm(torch.cuda.get_device_capability(device))})"


class DeviceMXFP8Tier(ExpertTier):
    """Expert MLP with its GEMMs in MXFP8 or FP8; `mode` is one of `FP8_MODES` (see above)."""

    name = "device_mxfp8"
    options = FP8Options
    takes_adapters = True  # in mode fp8-hopper, over a frozen FP8 base (expert_weight refuses the others)

    def __init__(self, mode: str = "auto", model_dims: tuple[int, int] | None = None, min_rows_per_expert: int = 0,
                 cache_weights: bool = True):
        """`model_dims` (hidden size, expert FFN size), when given, are checked against the
        mode that runs (`check_dims`) by `check_available`, before the model is built.
        `min_rows_per_expert`: in mode `fp8-hopper`, a call with fewer rows per local expert
        runs the BF16 `custom_grouped` kernels instead (0: FP8 at every size).
        `cache_weights` off: `fp8-hopper` quantises the expert weights at every use instead
        of once per optimizer step (fp8_hopper.py). A run config sets them from its `fp8`
        section (`from_config`). A model whose base does not train (LoRA's) asks for frozen
        expert weights (`expert_weight`), which this tier holds in FP8 alone."""
        if mode not in FP8_MODES:
            raise UserError(f"tier 'device_mxfp8' mode must be one of {', '.join(FP8_MODES)}; got {mode!r}")
        self.requested_mode = mode
        self.model_dims = model_dims
        self.min_rows_per_expert = min_rows_per_expert
        self.cache_weights = cache_weights
        self.frozen_base = False  # whether the model's expert weights are this tier's frozen FP8 ones
        self._calls: Counter[str] = Counter()  # calls per path: the mode, or BF16 under the break-even size
        self.mode: str | None = None  # the mode that runs, once a device is known
        self._device: torch.device | None = None
        self._runner = None

    @classmethod
    def from_config(cls, cfg) -> "DeviceMXFP8Tier":
        options: FP8Options = cfg.fp8
        return cls(options.mode, (cfg.model.hidden_size, cfg.model.intermediate_size), options.min_rows_per_expert,
                   options.weight_cache)

    @classmethod
    def frozen_format(cls, lora_base: str) -> str:
        return "fp8"  # its one LoRA: over a frozen FP8 base (mode fp8-hopper), with lora.base default

    @classmethod
    def check_options(cls, cfg) -> None:
        # The mode is one of FP8_MODES already: the config checks every Literal key.
        options: FP8Options = cfg.fp8
        if options.min_rows_per_expert < 0:
            raise UserError(f"fp8.min_rows_per_expert must be 0 or more, got {options.min_rows_per_expert}")

    @classmethod
    def check(cls, cfg) -> None:
        options: FP8Options = cfg.fp8
        if cfg.lora.enabled and not options.hopper_fp8:
            raise UserError(f"tier 'device_mxfp8' runs LoRA over a frozen FP8 base in mode fp8-hopper (auto on Hopper) "
                            f"only, not in mode '{options.mode}'")

    @classmethod
    def memory(cls, cfg, load: ExpertLoad) -> ExpertMemory:
        # On CUDA the hidden rows are custom_grouped's (fused), also under the break-even
        # size, where its BF16 kernels run and no FP8 copy is made. Above it the Hopper path
        # keeps the experts' weights in FP8, one byte per element in each of two orientations,
        # cached from a layer's first forward until the optimizer step, recompute or not; and
        # h's FP8 copy for the down weight gradient (a byte per element) with its row scales.
        # (Blackwell's TE path is counted the same way; it has not been measured.)
        # With LoRA it holds the frozen experts in FP8 alone (a byte per element and a float32
        # scale per row, in place of the base's dtype), runs every call in FP8 and caches no copy:
        # a layer's backward casts the dgrad orientation, a byte per element, while it runs.
        options: FP8Options = cfg.fp8
        cuda = load.device == "cuda"
        frozen = cfg.lora.enabled and cuda
        a, R, L = load.activation_bytes, load.rows, load.local_experts
        D, F = cfg.model.hidden_size, cfg.model.intermediate_size
        memory = ExpertMemory.autograd(F, load, fused=cuda)
        # Only Hopper's mode switches to BF16 under the break-even (`auto` is counted as Hopper's).
        bf16_below = options.hopper_fp8 and not runs_fp8(R, L, options.min_rows_per_expert)
        if not (frozen or (cuda and not bf16_below)):
            return memory
        weights = L * 3 * F * D  # this rank's expert weights in one layer, in elements
        copies = (1 if frozen else 2) * weights
        # The FP8 GEMMs' backward: d(h) beside d(gate_up), and the FP8 copies of both and of h.
        hidden_grad = memory.hidden_grad + R * (2 * a * F + 5 * F)
        if frozen:
            # The SwiGLU output the down adapter reads, kept by the FP8 op.
            adapts_down = "down_proj" in cfg.lora.expert_targets()
            return replace(memory, hidden=memory.hidden + (a * R * F if adapts_down else 0), hidden_grad=hidden_grad,
                           weight_copies=copies).held_in(FrozenFP8Weight, load, D, F)
        # Without the weight cache they are made at every use: a kept layer saves one
        # orientation (dgrad's) for its backward, a recomputed one nothing; both while it runs.
        return replace(memory, hidden=memory.hidden + R * (F + 4), hidden_grad=hidden_grad, weight_copies=copies,
                       weight_copies_saved=copies if options.weight_cache else copies // 2,
                       weight_copies_cached=copies if options.weight_cache else 0)

    @classmethod
    def lighter(cls, cfg) -> list[tuple[str, dict]]:
        options: FP8Options = cfg.fp8
        if options.hopper_fp8 and options.weight_cache and not cfg.lora.enabled:
            return [("--fp8.weight_cache false", {"fp8": replace(options, weight_cache=False)})]
        return []

    def check_available(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise TierUnavailable(
                    f"tier 'device_mxfp8' needs CUDA, which torch {torch.__version__} cannot use here"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        mode = select_mode(self.requested_mode, device.type, capability, te_mxfp8.unavailable_reason)
        if self.model_dims is not None:
            check_dims(mode, *self.model_dims)
        # Mode auto where it is not Hopper's: the config refuses every other mode (FP8Options).
        if not self.cache_weights and mode != "fp8-hopper":
            raise UserError("fp8.weight_cache false is for tier device_mxfp8 in mode fp8-hopper (auto on Hopper), "
                            f"whose FP8 weight copies it drops; mode '{mode}', which runs here, keeps none that way")
        if mode != self.mode:
            self._runner = _MODE_RUNNERS[mode](self)
        self.mode, self._device = mode, device

    def describe(self) -> dict:
        """What runs: {"recipe", "kernel", "device"}, for the run header and results JSON."""
        if self._runner is None:
            raise RuntimeError("DeviceMXFP8Tier.describe() needs check_available(device) first")
        kernel = self._runner.frozen_kernel if self.frozen_base else self._runner.kernel
        if not self.frozen_base and self._bf16_under_break_even():
            kernel += (f"; BF16 custom_grouped kernels for calls under {self.min_rows_per_expert} rows per local expert "
                       f"(under {self.min_rows_per_expert * BREAK_EVEN_EXPERTS} rows in all with fewer than "
                       f"{BREAK_EVEN_EXPERTS} local experts)")
        return {"recipe": self._runner.recipe, "kernel": kernel, "device": _device_name(self._device),
                "precision": "fp8" if self.mode == "fp8-hopper" else "mxfp8"}

    def calls(self) -> dict[str, int]:
        return dict(self._calls)

    def sync_free(self) -> bool:
        # Its calls never wait for the host in fp8-hopper, but a CUDA graph of a decode step
        # gave other tokens than the same step run eagerly on an H200 (TE backend,
        # tests/gpu/test_generate_gpu.py), for a reason not found yet: so not offered.
        return False

    def _bf16_under_break_even(self) -> bool:
        return self.mode == "fp8-hopper" and self.min_rows_per_expert > 0

    def expert_weight(self, shape, frozen=False):
        if not frozen:
            return super().expert_weight(shape)
        if self.mode is None:
            raise RuntimeError("DeviceMXFP8Tier.expert_weight() of a frozen base needs check_available(device) first")
        if self.mode != "fp8-hopper":
            raise TierUnavailable(f"tier 'device_mxfp8' runs LoRA over a frozen FP8 base in mode fp8-hopper (a Hopper "
                                  f"GPU) only; mode '{self.mode}' runs here")
        self.frozen_base = True
        return FrozenFP8Weight(shape, self._runner.value_dtype)

    def recomputes_hidden(self, x_RD) -> bool:
        return self.frozen_base  # a trained base's op is checkpointed whole

    def recompute_hidden(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None):
        """Selective recompute over a frozen FP8 base, inside the op: its backward runs the
        gate_up GEMM (and its SwiGLU cast) again, not the down projection, which a checkpoint
        of the whole op would run too. The gate_up adapter's delta is made again from its
        rank-r factors."""
        return self(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters, keep_hidden=False)

    def __call__(self, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, adapters=None, keep_hidden=True):
        if x_RD.device != self._device:
            self.check_available(x_RD.device)
        frozen = isinstance(gate_up_L2FD, FrozenFP8Weight)
        assert frozen or (adapters is None and keep_hidden), "adapters and own recompute come with a frozen base"
        # Below the break-even size the FP8 casts and the weights' quantisation cost more than
        # the FP8 GEMMs save (docs/precision.md has the measurements). Rows and experts are
        # shapes, known on the host: the choice needs no sync. A frozen base has no BF16 copy
        # (and no per-step quantisation to repay).
        if (not frozen and self.mode == "fp8-hopper"
                and not runs_fp8(x_RD.shape[0], tokens_per_expert_L.numel(), self.min_rows_per_expert)):
            self._calls["bf16 custom_grouped"] += 1
            return _BF16_BELOW(x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF)
        self._calls[f"{self.mode}, frozen FP8 base" if frozen else self.mode] += 1
        runner = self._runner
        padded = padded_rows(tokens_per_expert_L, x_RD.shape[0], runner.row_align, runner.min_rows)
        x_QD = pad_rows(x_RD, padded)
        if frozen:
            y_QD = runner.frozen_mlp(x_QD, padded, gate_up_L2FD, down_LDF, adapters, keep_hidden)
        else:
            y_QD = runner.mlp(x_QD, padded, gate_up_L2FD, down_LDF)
        return unpad_rows(y_QD, padded)
