"""Optimizers: `MasterAdamW`, AdamW over bf16 parameters with an exact fp32 master."""

from te_mixtral.optim.master_adamw import MasterAdamW

__all__ = ["MasterAdamW"]
