"""The expert tiers' own options, as a run config holds them: one dataclass per tier that has
any, a section of the config (`RunConfig.fp8`), its choices declared as `Literal`s.

This module imports no torch: config.py reads it while a config loads, before anything
heavy is imported. The tier reads its section (`from_config`) and checks what its own
choices cannot say (`check_options`, `check`).
"""

import typing
from dataclasses import dataclass, replace
from typing import Literal

from te_mixtral.config_field import Needs, setting

# The modes tier device_mxfp8 runs in (its module's docstring says what each computes).
FP8Mode = Literal["auto", "mxfp8-te", "fp8-hopper", "mxfp8-emulated"]
FP8_MODES = typing.get_args(FP8Mode)
# The modes whose 8-bit path is Hopper's FP8 (auto picks it on Hopper).
HOPPER_FP8_MODES = ("auto", "fp8-hopper")
# What the options of the Hopper FP8 path need (config_field.Needs), in min_rows_per_expert's words.
HOPPER_FP8 = Needs(("tier", "fp8.mode"), lambda tier, mode: tier == "device_mxfp8" and mode in HOPPER_FP8_MODES,
                   "is tier device_mxfp8's threshold on Hopper: it needs tier device_mxfp8 in fp8.mode auto or "
                   "fp8-hopper")


@dataclass
class FP8Options:
    """Tier device_mxfp8's options (te_mixtral/experts/device_mxfp8.py). Not the workload: a
    results page compares the runs that differ in them."""

    mode: FP8Mode = setting("auto", workload=False,
                            needs=Needs(("tier",), lambda tier: tier == "device_mxfp8",
                                        "is tier device_mxfp8's option: it needs tier device_mxfp8"),
                            help="device_mxfp8 tier: auto (the GPU's own 8-bit path: MXFP8 on Blackwell, FP8 on "
                            "Hopper), or one of mxfp8-te, fp8-hopper, mxfp8-emulated (MXFP8 numerics anywhere)")
    min_rows_per_expert: int = setting(1024, workload=False,
                                       needs=HOPPER_FP8,
                                       help="device_mxfp8 on Hopper: a layer call with fewer rows per local "
                                       "expert (with fewer than 4 local experts: fewer rows in all than 4 "
                                       "experts at this size) runs the BF16 custom_grouped kernels, where FP8 is "
                                       "slower (the break-even measured on H100 and H200 at 4 local experts; per "
                                       "GPU and how to measure yours: docs/precision.md); 0: FP8 at every size. "
                                       "Blackwell's mode and a frozen LoRA base run FP8 at every size")
    weight_cache: bool = setting(True, workload=False,
                                 needs=replace(HOPPER_FP8, text="is for tier device_mxfp8 in mode fp8-hopper "
                                               "(auto on Hopper), whose FP8 weight copies it keeps or drops: it needs tier "
                                               "device_mxfp8 in fp8.mode auto or fp8-hopper"),
                                 help="device_mxfp8 on Hopper: keep each expert weight's FP8 copies (a byte "
                                 "per element per orientation, every layer) from its first use to the "
                                 "optimizer step; false: quantise it at every use, so that with recompute "
                                 "only the layer in flight holds them")

    @property
    def hopper_fp8(self) -> bool:
        """Whether the mode is Hopper's FP8 (asked for, or picked by auto on Hopper)."""
        return self.mode in HOPPER_FP8_MODES
