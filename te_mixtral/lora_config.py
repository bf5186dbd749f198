"""LoRA's settings in one place, as PEFT's `LoraConfig` holds them: the `lora` section of a
run config, the projections it can adapt, and its checks.

The adapters themselves are model/lora.py's; what a tier receives of them at each call,
experts/adapters.py's. This module imports no torch: config.py reads it while a config loads.
"""

import math
from dataclasses import dataclass, replace
from typing import Literal

from te_mixtral.config_field import Needs, setting
from te_mixtral.errors import UserError, did_you_mean
from te_mixtral.errors import require as _check

# The projections LoRA can adapt, by the names PEFT's `target_modules` (attention) and
# `target_parameters` (experts: each stacked weight is one target) give them.
LORA_DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_EXPERT_TARGETS = ("gate_up_proj", "down_proj")


# What the keys that shape the adapters need (config_field.Needs).
LORA_ON = Needs(("lora.rank",), lambda rank: rank > 0, "applies to LoRA adapters: set lora.rank (LoRA is off)")


@dataclass
class LoRAConfig:
    """Low-rank adapters over a frozen base (te_mixtral/model/lora.py); rank 0 trains every weight."""

    rank: int = setting(0, help="rank r of every adapter; 0: no adapters, every weight trains (full fine-tuning)")
    alpha: float = setting(16.0, needs=LORA_ON, help="adapter scale numerator: the update is alpha / r * B @ A "
                           "(alpha / sqrt(r) with rslora)")
    dropout: float = setting(0.0, needs=LORA_ON,
                             help="dropout on each adapter's input while training (the base path sees none)")
    rslora: bool = setting(False, needs=LORA_ON, help="rank-stabilised scaling alpha / sqrt(r) instead of alpha / r")
    targets: str = setting(",".join(LORA_DENSE_TARGETS + LORA_EXPERT_TARGETS), needs=LORA_ON,
                           help="comma-separated projections to adapt, as PEFT names them: attention's "
                           f"{', '.join(LORA_DENSE_TARGETS)} and the experts' stacked "
                           f"{' and '.join(LORA_EXPERT_TARGETS)} (one adapter per expert each)")
    base: Literal["default", "nf4"] = setting("default",
                                              needs=replace(LORA_ON, text="holds the base frozen for LoRA: set "
                                                                          "lora.rank (e.g. 16)"),
                                              help="how the frozen base's expert weights are held: default "
                                              "(the run's compute dtype; FP8 in tier device_mxfp8) or nf4 (QLoRA's "
                                              "4-bit NormalFloat, dequantised inside tier custom_grouped's GEMMs: "
                                              "experts/quant/frozen_nf4.py)")
    change_on_resume: bool = setting(False, workload=False, resumable=True, needs=Needs(
                                     ("resume", "lora.rank"), lambda resume, rank: resume and rank > 0,
                                     "lets a LoRA run's resume change its adapters: it needs resume and lora.rank"),
                                     help="with resume: accept lora.targets leaving out some of the checkpoint's (their "
                                     "trained adapters are dropped) or another lora.alpha or rslora (the trained "
                                     "adapters rescale); without it such a resume is refused")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)

    def target_list(self) -> tuple[str, ...]:
        """The projections `targets` names, as written."""
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    def dense_targets(self) -> tuple[str, ...]:
        """Attention's adapted projections, in LORA_DENSE_TARGETS' order; () without LoRA."""
        return tuple(t for t in LORA_DENSE_TARGETS if self.enabled and t in self.target_list())

    def expert_targets(self) -> tuple[str, ...]:
        """The experts' adapted stacked weights, in LORA_EXPERT_TARGETS' order; () without LoRA."""
        return tuple(t for t in LORA_EXPERT_TARGETS if self.enabled and t in self.target_list())


def validate_lora(cfg) -> None:
    """The checks of the lora section, and of what LoRA leaves out."""
    lora, t = cfg.lora, cfg.train
    _check(lora.rank >= 0, f"lora.rank must be 0 (off) or positive, got {lora.rank}")
    if not lora.enabled:
        return
    _check(0 < lora.alpha < math.inf, f"lora.alpha must be finite and above 0, got {lora.alpha}")
    _check(0 <= lora.dropout < 1, f"lora.dropout must be in [0, 1), got {lora.dropout}")
    known = LORA_DENSE_TARGETS + LORA_EXPERT_TARGETS
    targets = lora.target_list()
    _check(bool(targets), "lora.targets names no projection: give one or more of " + ", ".join(known))
    for target in targets:
        if target not in known:
            raise UserError(f"lora.targets: unknown projection '{target}'{did_you_mean(target, known)}; known: "
                            f"{', '.join(known)}")
    _check(len(set(targets)) == len(targets), f"lora.targets names a projection twice: {lora.targets}")
    _check(t.optimizer == "adamw", "lora trains small fp32 adapters with train.optimizer adamw; master_adamw "
           "(bf16 parameters) is for full fine-tuning")
    _check(t.sharding == "none", "lora keeps the frozen base whole on each rank (experts split by EP); "
           "train.sharding fsdp is for full fine-tuning")


def validate_lora_rank(cfg) -> None:
    """Refuse a lora.rank above what any adapted projection can use. An adapter's update
    B @ A [out, in] has rank at most min(in, out): past that, r adds parameters, memory and
    time to every adapter and nothing it can learn. PEFT accepts any r above 0 (its LoRA
    checks nothing else), so such a config is legal there; here it is refused, as the slip it
    almost always is (1024 for 16), naming the largest rank that still counts."""
    m, targets = cfg.model, cfg.lora.target_list()
    attention, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    in_out = {"q_proj": (m.hidden_size, attention), "k_proj": (m.hidden_size, kv), "v_proj": (m.hidden_size, kv),
              "o_proj": (attention, m.hidden_size), "gate_up_proj": (m.hidden_size, 2 * m.intermediate_size),
              "down_proj": (m.intermediate_size, m.hidden_size)}
    useful = max(min(in_out[t]) for t in targets if t in in_out)
    _check(cfg.lora.rank <= useful,
           f"lora.rank {cfg.lora.rank} is above every adapted projection's rank (at most {useful}: min(in, out) of "
           f"{', '.join(targets)}), so the extra rank learns nothing: use --lora.rank {useful} or less")
