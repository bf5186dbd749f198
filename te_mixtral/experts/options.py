"""The expert tiers' own options, as a run config holds them: one dataclass per tier that has
any, a section of the config (`RunConfig.fp8`), its choices declared as `Literal`s; and the
names of the whole-model baselines, which the keys of te_mixtral's own model need.

This module imports no torch: config.py reads it while a config loads, before anything
heavy is imported. The tier reads its section (`from_config`) and checks what its own
choices cannot say (`check_options`, `check`).
"""

import typing
from dataclasses import dataclass, replace
from typing import Literal

from te_mixtral.config_field import Needs, setting

# The whole-model baselines (experts/registry.py has the expert tiers): name -> what runs, as the
# run header records it; "experts" is transformers' own name of its experts implementation
# (`experts_implementation`), which model/hf_model.py passes on. Named here, not in the
# registry, because the config's keys of te_mixtral's own model need them before torch loads.
BASELINES = {
    "hf": {"backend": "transformers", "experts": "grouped_mm"},
    "hf_eager": {"backend": "transformers", "experts": "eager"},
}


def own_model(what: str) -> Needs:
    """What a key of te_mixtral's own model (its layers, its recompute) needs: one of its tiers,
    not a baseline, which runs transformers' model. `what` starts the refusal."""
    return Needs(("tier",), lambda tier: tier not in BASELINES,
                 f"{what}; tiers {' and '.join(BASELINES)} run transformers' model: drop it, or run one of "
                 "te_mixtral's tiers")


# The modes tier device_mxfp8 runs in (its module's docstring says what each computes).
FP8Mode = Literal["auto", "mxfp8-te", "fp8-hopper", "mxfp8-emulated"]
FP8_MODES = typing.get_args(FP8Mode)
# The modes whose 8-bit path is Hopper's FP8 (auto picks it on Hopper).
HOPPER_FP8_MODES = ("auto", "fp8-hopper")
# What the options of the Hopper FP8 path need (config_field.Needs), in min_rows_per_expert's words:
# a base that trains. LoRA's frozen base is held in FP8 alone, so it has no weight copies to
# cache, and runs FP8 at every size.
HOPPER_FP8 = Needs(("tier", "fp8.mode", "lora.rank"),
                   lambda tier, mode, rank: tier == "device_mxfp8" and mode in HOPPER_FP8_MODES and rank == 0,
                   "is tier device_mxfp8's threshold on Hopper: it needs tier device_mxfp8 in fp8.mode auto or "
                   "fp8-hopper, without LoRA (lora.rank 0: a frozen FP8 base runs FP8 at every size)")


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
                                               "(auto on Hopper), whose FP8 weight copies it keeps or drops: it "
                                               "needs tier device_mxfp8 in fp8.mode auto or fp8-hopper, without LoRA "
                                               "(lora.rank 0: a frozen FP8 base is held in FP8 alone, with no copy to "
                                               "keep)"),
                                 help="device_mxfp8 on Hopper: keep each expert weight's FP8 copies (a byte "
                                 "per element per orientation, every layer) from its first use to the "
                                 "optimizer step; false: quantise it at every use, so that with recompute "
                                 "only the layer in flight holds them")

    @property
    def hopper_fp8(self) -> bool:
        """Whether the mode is Hopper's FP8 (asked for, or picked by auto on Hopper)."""
        return self.mode in HOPPER_FP8_MODES
