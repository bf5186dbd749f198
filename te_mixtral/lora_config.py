"""LoRA's settings in one place, as PEFT's `LoraConfig` holds them: the `lora` section of a
run config, the projections it can adapt, and its checks; and PEFT's adapter_config.json, out
(`peft_config`, what `--save-adapter` writes) and in (`adopt_adapter`: `lora.init`'s adapter,
whose settings a run takes where it gives none; `require_adapter_revision`: the base's revision
it was made on, once the run has found its hub base).

The adapters themselves are model/lora.py's; what a tier receives of them at each call,
experts/adapters.py's; their weights in PEFT's files, training/peft_adapters.py's. This module
imports no torch: config.py reads it while a config loads.
"""

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from te_mixtral.config_field import Needs, setting
from te_mixtral.errors import UserError, did_you_mean
from te_mixtral.errors import require as _check
from te_mixtral.local_or_hub import base_model

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
    init: str | None = setting(None, path=True, resumable=True,
                               needs=replace(LORA_ON, text="starts LoRA adapters from an exported one: drop "
                                                           "lora.rank 0 (the adapter's rank is taken)"),
                               help="a LoRA adapter folder (adapter_config.json + adapter_model.safetensors: "
                               "--save-adapter's, or PEFT's save_pretrained for Mixtral) whose weights the adapters "
                               "start from, instead of the seed's; its r, lora_alpha, use_rslora and targets are "
                               "the run's lora.rank, alpha, rslora and targets unless given (another is refused), "
                               "its lora_dropout lora.dropout unless given, and the tokenizer "
                               "beside it data.tokenizer. The optimizer starts "
                               "afresh; a resume reads the checkpoint's adapters instead")
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
    # PEFT loads adapters onto the base their config names (base_model_name_or_path): a seeded
    # base has no name to give, so its adapters would load onto nothing.
    _check(cfg.save_adapter is None or cfg.model_path is not None,
           f"save_adapter {cfg.save_adapter} would hold adapters over a base made from the seed, which no file "
           f"holds, so PEFT could not load them: make a base folder (python scripts/make_tiny_mixtral.py "
           f"tiny-mixtral) and train over it with --model tiny-mixtral, or export the model with the adapters "
           f"merged (--save-hf)")


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


# --- PEFT's adapter_config.json ----------------------------------------------------------

# Where each of LORA_DENSE_TARGETS and LORA_EXPERT_TARGETS is in transformers' Mixtral layer,
# as PEFT's `target_modules` and `target_parameters` name it.
_DENSE_STEM, _EXPERT_STEM = "self_attn", "mlp.experts"


def peft_config(cfg) -> dict:
    """The adapter_config.json PEFT reads for the adapters of the run config `cfg` (its
    LoraConfig's fields)."""
    lora = cfg.lora
    expert_targets = [f"{_EXPERT_STEM}.{t}" for t in lora.expert_targets()]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        # Where PEFT's users load the base from, from any folder: a local one by its whole path.
        "base_model_name_or_path": base_model(cfg.model_path),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        # PEFT refuses dropout on a parameter target (training/peft_adapters.py).
        "lora_dropout": 0.0 if expert_targets else lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": list(lora.dense_targets()),
        "target_parameters": expert_targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


# PEFT's settings whose adapters are not plain LoRA on whole projections of every layer, as
# ours are: the setting, and what it gives the adapters.
_NOT_PLAIN = {"use_dora": "DoRA's magnitude vectors", "lora_bias": "a bias on lora_B",
              "rank_pattern": "ranks of their own on some projections",
              "alpha_pattern": "alphas of their own on some projections",
              "layers_to_transform": "adapters on some layers only", "layers_pattern": "adapters on some layers only",
              "exclude_modules": "some projections left out", "modules_to_save": "whole modules trained beside them",
              "trainable_token_indices": "trained token embeddings", "layer_replication": "layers repeated",
              "alora_invocation_tokens": "adapters that act only after their invocation tokens (aLoRA)",
              "use_qalora": "QALoRA's pooled adapter inputs", "arrow_config": "Arrow's routing among adapters",
              "use_bdlora": "block-diagonal adapters"}
# PEFT's settings that leave a saved adapter computing what its weights and the settings
# read_peft_adapter takes say: bookkeeping, training-only ones, how fresh adapters start,
# and details of settings that are off. Any other setting PEFT writes is off by default (None,
# False, {}); on, it may change what the adapters compute, so it is refused, a new one too.
_NO_EFFECT = {"task_type", "auto_mapping", "peft_version", "inference_mode",
              "fan_in_fan_out",  # PEFT turns it off on Linear layers (and refuses it on stacked weights)
              "init_lora_weights", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
              "qalora_group_size", "megatron_core", "ensure_weight_tying", "runtime_config"}
_READ = {"peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "target_modules",
         "target_parameters", "base_model_name_or_path", "revision"}


@dataclass(frozen=True)
class PeftAdapter:
    """What a PEFT LoRA adapter's config says of it, as our lora settings."""

    rank: int
    alpha: float
    dropout: float
    rslora: bool
    targets: str  # ours, comma-separated, in LORA_DENSE_TARGETS + LORA_EXPERT_TARGETS order
    base: str | None  # base_model_name_or_path
    revision: str | None  # the base's revision it was made on: a branch, tag or commit


def read_peft_adapter(folder: str) -> PeftAdapter:
    """The adapter_config.json in `folder` (lora.init) as our settings; one line refusing a folder
    that is not a LoRA adapter, or one whose adapters ours cannot be."""
    where = f"lora.init {folder}"
    path = Path(folder) / "adapter_config.json"
    _check(path.is_file(), f"{where} is not an adapter folder: it has no adapter_config.json (--save-adapter and "
                           f"PEFT's save_pretrained write one, beside adapter_model.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    _check(isinstance(raw, dict), f"{path} is not an adapter config: it holds a {type(raw).__name__}, not a mapping")
    _check(raw.get("peft_type") == "LORA", f"{where} holds a {raw.get('peft_type')} adapter, not LoRA")
    rank, alpha, rslora = raw.get("r"), raw.get("lora_alpha"), raw.get("use_rslora", False)
    dropout = raw.get("lora_dropout", 0.0)
    _check(isinstance(rank, int) and not isinstance(rank, bool) and rank > 0,
           f"{path}: r must be a positive whole number, got {rank!r}")
    _check(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < math.inf,
           f"{path}: lora_alpha must be a number above 0, got {alpha!r}")
    _check(isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1,
           f"{path}: lora_dropout must be a number in [0, 1), got {dropout!r}")
    _check(isinstance(rslora, bool), f"{path}: use_rslora must be true or false, got {rslora!r}")
    for key, value in raw.items():
        if not value or key in _READ | _NO_EFFECT:
            continue
        if key in _NOT_PLAIN:
            raise UserError(f"{where} holds {_NOT_PLAIN[key]} ({key}), which te_mixtral's LoRA adapters cannot hold")
        raise UserError(f"{where} holds {key} {value!r}, a PEFT setting te_mixtral's LoRA does not have (its "
                        f"adapters may compute otherwise here than in PEFT): train new adapters without lora.init")
    _check(raw.get("bias", "none") == "none", f"{where} trains biases (bias {raw.get('bias')}), which te_mixtral's "
                                              f"LoRA adapters cannot hold")
    dense, experts = raw.get("target_modules") or [], raw.get("target_parameters") or []
    _check(isinstance(dense, list) and isinstance(experts, list),
           f"{where} names its targets by a pattern ({dense!r}); te_mixtral adapts projections by name: "
           f"{', '.join(LORA_DENSE_TARGETS + LORA_EXPERT_TARGETS)}")
    found = [_our_target(name, _DENSE_STEM, LORA_DENSE_TARGETS, where) for name in dense]
    found += [_our_target(name, _EXPERT_STEM, LORA_EXPERT_TARGETS, where) for name in experts]
    _check(bool(found), f"{where} adapts no projection")
    targets = ",".join(t for t in LORA_DENSE_TARGETS + LORA_EXPERT_TARGETS if t in found)
    base, revision = raw.get("base_model_name_or_path"), raw.get("revision")
    return PeftAdapter(rank, float(alpha), float(dropout), rslora, targets,
                       base if isinstance(base, str) and base else None,
                       revision if isinstance(revision, str) and revision else None)


def _our_target(name, stem: str, ours: tuple[str, ...], where: str) -> str:
    """Which of `ours` PEFT's target `name` adapts in every layer: PEFT takes a name for each module
    (or parameter) whose full name ends with it, so `q_proj`, `self_attn.q_proj` alike."""
    for target in ours:
        if isinstance(name, str) and f".{stem}.{target}".endswith(f".{name}"):
            return target
    raise UserError(f"{where} adapts {name!r}, which te_mixtral's LoRA cannot hold: it adapts "
                    f"{', '.join(LORA_DENSE_TARGETS + LORA_EXPERT_TARGETS)} of every layer")


def adopt_adapter(cfg, given: set[str]) -> None:
    """lora.init's adapter settings (`read_peft_adapter`), and the tokenizer beside it, as the run
    config `cfg`'s where the config and the command line gave none (`given`: the keys they set); a
    setting given otherwise is refused naming both, and so is an adapter over another base than
    the run's, where the adapter names its base. `--lora.rank 0` turns LoRA off, lora.init with it (config_checks.check_needs)."""
    lora = cfg.lora
    if lora.init is None or ("lora.rank" in given and lora.rank == 0):
        return
    adapter = read_peft_adapter(lora.init)
    for key, peft_name, same in (("rank", "r", int.__eq__), ("alpha", "lora_alpha", float.__eq__),
                                 ("rslora", "use_rslora", bool.__eq__),
                                 ("targets", "targets", lambda a, b: set(a.split(",")) == set(b.split(",")))):
        wanted = getattr(adapter, key)
        if f"lora.{key}" not in given:
            setattr(lora, key, wanted)
        elif not same(getattr(lora, key) if key != "targets" else ",".join(lora.target_list()), wanted):
            raise UserError(f"lora.init {lora.init} holds adapters of {peft_name} {wanted}, and lora.{key} is "
                            f"{getattr(lora, key)}: drop lora.{key} (the adapter's is taken), or train new adapters "
                            f"without lora.init")
    # Dropout acts only while training: the adapters compute the same under any, so a run may
    # train on with its own (as PEFT's users pass from_pretrained a config of their own).
    if "lora.dropout" not in given:
        lora.dropout = adapter.dropout
    # The adapters learnt the token ids of the tokenizer beside them (--save-adapter writes the
    # run's there), which need not be the base's that the run would read otherwise.
    if "data.tokenizer" not in given and (Path(lora.init) / "tokenizer.json").is_file():
        cfg.data.tokenizer = lora.init
    ours = base_model(cfg.model_path)
    if adapter.base is not None and base_model(adapter.base) != ours:
        now = f"--model {cfg.model_path}" if cfg.model_path is not None else "made from the seed"
        raise UserError(f"lora.init {lora.init} holds adapters trained over {adapter.base}, and this run's base is "
                        f"{now}: pass --model {adapter.base} (or, where that is this base by another name, set "
                        f"base_model_name_or_path in its adapter_config.json)")


def require_adapter_revision(cfg, hub_revision: str | None) -> None:
    """Refuse lora.init's adapter where its config says it was made on another commit of the
    run's hub base than the one the run reads (`hub_revision`: the commit of the run's hub
    cache, model/hf_config.hub_revision; None for a local folder). PEFT records the revision
    get_peft_model was given: a branch or tag moves, so what it was then cannot be known, and
    it is not compared; nor is a local base, which has no revision."""
    lora = cfg.lora
    if lora.init is None or not lora.enabled or hub_revision is None:
        return
    made_on = read_peft_adapter(lora.init).revision
    if made_on is None or re.fullmatch(r"[0-9a-f]{40}", made_on) is None or made_on == hub_revision:
        return
    raise UserError(f"lora.init {lora.init} holds adapters made on revision {made_on} of {cfg.model_path}, and this "
                    f"run's --model {cfg.model_path} is its revision {hub_revision}: train over that revision's folder "
                    f"(hf download {cfg.model_path} --revision {made_on} --local-dir DIR; --model DIR, and "
                    f"base_model_name_or_path DIR in the adapter's config), or train new adapters without lora.init")
