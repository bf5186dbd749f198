"""Optimizers: `MasterAdamW`, AdamW over bf16 parameters with an exact fp32 master.

    master_adamw.py   MasterAdamW: the fp32 master kept as bf16 + a 16-bit remainder
    adamw_kernel.py   its update of one tensor as a single Triton kernel (CUDA), moments as they are or 8-bit
    adamw_torch.py    the same update in plain torch: the CPU path and the kernel's reference
    bits.py           fp32 <-> bf16 by integer operations on the bit patterns
    moments8.py       Adam's moments in 8 bits: blocks of 256 values with a power-of-two scale
"""

from te_mixtral.optim.master_adamw import MasterAdamW

__all__ = ["MasterAdamW"]
