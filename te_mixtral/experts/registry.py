"""Registry of expert-FFN tiers, chosen by name.

Tiers are imported only when asked for, so a machine without Transformer Engine or Triton
can still run the tiers that need neither.
"""

import importlib

from te_mixtral.experts.base import ExpertTier

# name -> "module:Class"; every class implements `ExpertTier`.
_TIERS = {
    "loop": "te_mixtral.experts.loop:LoopTier",
    "grouped_linear": "te_mixtral.experts.grouped_linear:GroupedLinearTier",
    "custom_grouped": "te_mixtral.experts.custom_grouped:CustomGroupedTier",
    "device_mxfp8": "te_mixtral.experts.device_mxfp8:DeviceMXFP8Tier",
}

EXPERT_TIERS = tuple(_TIERS)


def make_tier(name: str, cfg=None) -> ExpertTier:
    """The tier called `name`; a tier with options reads them from the run config `cfg`."""
    module_name, class_name = _TIERS[name].split(":")
    tier_class = getattr(importlib.import_module(module_name), class_name)
    return tier_class.from_config(cfg) if cfg is not None and hasattr(tier_class, "from_config") else tier_class()
