"""Every name a run's `tier` can take, in one place.

Two kinds of name. An expert tier (`EXPERT_TIERS`) is an `ExpertTier` the MoE block calls
for its expert FFN; the rest of te_mixtral's model is the same whichever runs. A baseline
(`BASELINES`, listed in options.py, which the config reads before torch loads) replaces the
whole model: `hf` runs transformers' `MixtralForCausalLM` as is, single-process, with the
experts implementation transformers picks by default (`grouped_mm`), as its users run it;
`hf_eager` the same model with transformers' per-expert loop (`eager`).
te_mixtral/model/hf_model.py builds both; the model layer sits above this package, so it is
named here, not imported.

The tier modules import Transformer Engine and Triton only when a tier runs, so this
registry imports on a machine with neither.
"""

from te_mixtral.errors import UserError, did_you_mean
from te_mixtral.experts.base import ExpertLoad, ExpertMemory, ExpertTier
from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.experts.grouped_linear import GroupedLinearTier
from te_mixtral.experts.loop import LoopTier
from te_mixtral.experts.options import BASELINES

EXPERT_TIERS: dict[str, type[ExpertTier]] = {tier.name: tier for tier in (
    LoopTier,
    GroupedLinearTier,
    CustomGroupedTier,
    DeviceMXFP8Tier,
)}

# The baseline results pages measure every run against: what transformers' users run.
DEFAULT_BASELINE = "hf"

# Every name `--tier` accepts, baselines first: the order results pages list runs in.
RUN_NAMES = (*BASELINES, *EXPERT_TIERS)

# The tier every other is checked against (loss checks, results pages).
REFERENCE_TIER = LoopTier.name


def make_tier(name: str, cfg=None) -> ExpertTier:
    """The expert tier called `name`; a tier with options reads them from the run config `cfg`."""
    tier_class = EXPERT_TIERS[name]
    return tier_class() if cfg is None else tier_class.from_config(cfg)


def expert_memory(cfg, load: ExpertLoad) -> ExpertMemory:
    """What the run's tier holds per layer (`ExpertTier.memory`); a baseline's experts, autograd's."""
    tier = EXPERT_TIERS.get(cfg.tier)
    return ExpertMemory.autograd(cfg.model.intermediate_size, load) if tier is None else tier.memory(cfg, load)


def lighter_settings(cfg) -> list[tuple[str, dict]]:
    """The run's tier's options that would hold less (`ExpertTier.lighter`); a baseline has none."""
    tier = EXPERT_TIERS.get(cfg.tier)
    return [] if tier is None else tier.lighter(cfg)


def check_tier(cfg, world_size: int) -> None:
    """Raise a one-line `UserError` if the run config `cfg` names no tier, or a tier option or
    launch that tier cannot take. `config.load_run_config` calls this right after the config loads."""
    if cfg.tier not in RUN_NAMES:
        raise UserError(f"unknown tier '{cfg.tier}'{did_you_mean(cfg.tier, RUN_NAMES)}; tiers: {', '.join(RUN_NAMES)}")
    for tier in EXPERT_TIERS.values():
        tier.check_options(cfg)
    if cfg.lora.enabled and (cfg.tier in BASELINES or not EXPERT_TIERS[cfg.tier].takes_adapters):
        takers = ", ".join(name for name, tier in EXPERT_TIERS.items() if tier.takes_adapters)
        raise UserError(f"tier '{cfg.tier}' does not run LoRA adapters (lora.rank {cfg.lora.rank}); tiers that do: "
                        f"{takers}")
    if cfg.lora.enabled and cfg.lora.base != "default" and cfg.lora.base not in EXPERT_TIERS[cfg.tier].frozen_bases:
        takers = ", ".join(name for name, tier in EXPERT_TIERS.items() if cfg.lora.base in tier.frozen_bases)
        raise UserError(f"tier '{cfg.tier}' cannot hold a frozen base in lora.base {cfg.lora.base}; tiers that can: "
                        f"{takers}")
    if cfg.ep_capacity > 0 and (cfg.tier in BASELINES or not EXPERT_TIERS[cfg.tier].takes_padded_rows):
        takers = ", ".join(name for name, tier in EXPERT_TIERS.items() if tier.takes_padded_rows)
        raise UserError(f"tier '{cfg.tier}' needs its split sizes on the host, so it cannot take the padded exchange "
                        f"(ep_capacity {cfg.ep_capacity}); tiers that can: {takers}")
    if cfg.tier in EXPERT_TIERS:
        EXPERT_TIERS[cfg.tier].check(cfg)
    if cfg.tier in BASELINES and world_size != 1:
        raise UserError(f"tier '{cfg.tier}' runs Hugging Face's model in a single process; launch it with one "
                        f"process, not {world_size}")
    if cfg.model_path is None:  # else the checkpoint's config.json replaces the model section, checked then
        check_tier_model(cfg)


def check_tier_model(cfg) -> None:
    """Raise a one-line `UserError` if the run's tier cannot take the sizes of its model:
    the config's model section (`check_tier`), or a checkpoint's once its config.json
    replaces it (training/hf_checkpoint.py's `adopt_checkpoint`)."""
    if BASELINES.get(cfg.tier, {}).get("experts") == "grouped_mm":
        _check_grouped_mm_rows(cfg)


def _check_grouped_mm_rows(cfg) -> None:
    """transformers' `grouped_mm` experts multiply the stacked expert weights in their own
    dtype, and torch's grouped_mm raises deep in the forward unless each row of them is a
    multiple of 16 bytes: refuse such widths up front, naming the tier that runs them."""
    element_bytes = 2 if cfg.train.optimizer == "master_adamw" else 4  # master_adamw keeps bf16 parameters
    multiple = 16 // element_bytes
    odd = [f"model.{key} {width}" for key, width in (("hidden_size", cfg.model.hidden_size),
                                                     ("intermediate_size", cfg.model.intermediate_size))
           if width % multiple]
    if odd:
        raise UserError(f"tier '{cfg.tier}' runs transformers' grouped_mm experts, whose weight rows must be whole "
                        f"16-byte units: {' and '.join(odd)} not a multiple of {multiple} ({element_bytes}-byte "
                        f"parameters); use --tier hf_eager, the same model with transformers' per-expert loop")
