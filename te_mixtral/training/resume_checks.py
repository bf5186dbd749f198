"""Whether this run can resume a checkpoint: the checks of a checkpoint's meta.json against the
run's config, before a byte of its weights is read.

A resume continues the saved run exactly: the same model, the same optimizer state, the same
token ids. What would make the resumed run train something else is refused, in one line that
names the difference and the way across (the setting to pass, or the export to start from):

- the tier's family: transformers' model (`hf`, `hf_eager`) names and lays out its weights
  unlike ours;
- the optimizer state: another `train.optimizer` or `train.expert_moments` keeps other state;
- LoRA: a full fine-tune's weights are no adapters, nor the other way round; adapters of
  another rank have other shapes, new targets have none trained; fewer targets would drop
  trained adapters and another alpha or rslora rescale them (`lora.change_on_resume` allows
  those); the frozen base they were trained over (`--model`, however its folder is spelled,
  and its weights as they were then, or the seed it was made from, and its format:
  `lora.base`'s, or the tier's own, FP8 in `device_mxfp8`) must be the same;
- the model (any `model.*` setting) and the tokenizer (its SHA-256: other ids mean other
  words);
- a checkpoint past `train.steps`, or at it where the run exports nothing: nothing left to do.

The layout is no reason to refuse: a checkpoint holds global tensors, and resumes on any world
size, EP size and sharding (training/checkpoint.py), its experts placed as it placed them
(training/expert_placement.py). Older checkpoints lack some of these records; each check
reads the default they were written under.
"""

from pathlib import Path

from te_mixtral.config import RunConfig, to_dict
from te_mixtral.errors import UserError
from te_mixtral.experts.registry import BASELINES, EXPERT_TIERS
from te_mixtral.local_or_hub import base_model
from te_mixtral.saved_config import upgrade_saved


def check_resumable(meta: dict, cfg: RunConfig, meta_file: Path, tokenizer_hash: str,
                    base_hash: str | None = None) -> None:
    """Refuse, in one line naming the way across, to resume the checkpoint whose `meta_file`
    (its meta.json) was read into `meta` with this run's `cfg` where it cannot continue: see
    the module. `tokenizer_hash` is the `tokenizer_sha256` of this run's tokenizer, `base_hash`
    the `base_sha256` of a LoRA run's --model. `meta`'s config is put in today's layout, in
    place (the caller reads it after)."""
    folder = meta_file.parent
    # A checkpoint saved before a config key moved or was renamed: read it in today's layout.
    meta["config"] = upgrade_saved(meta["config"])
    saved_tier = meta["config"].get("tier", cfg.tier)
    if (saved_tier in BASELINES) != (cfg.tier in BASELINES):  # transformers' model or ours: other names
        raise UserError(f"checkpoint {folder} was written by tier {saved_tier}, whose model names and lays out its "
                        f"weights unlike tier {cfg.tier}'s; resume it with --tier {saved_tier}")
    # The settings that decide what state the optimizer keeps (older checkpoints: the defaults).
    for key, default in (("optimizer", "adamw"), ("expert_moments", "same")):
        saved, now = meta["config"].get("train", {}).get(key, default), getattr(cfg.train, key)
        if saved != now:
            raise UserError(f"checkpoint {folder} was written with train.{key} {saved}, which keeps other "
                            f"optimizer state than {now}; resume it with --{key} {saved}")
    _check_lora_adapters(meta["config"].get("lora", {}), cfg, folder)
    if cfg.lora.enabled:  # the checkpoint holds the adapters; the base is read or made again
        saved_path = meta["config"].get("model_path")
        saved_seed = meta["config"].get("train", {}).get("seed")
        # One folder however it is spelled (`/x/m`, `/x/m/`, `m` from /x); older checkpoints
        # kept only the spelling, read from here.
        if meta.get("base_model", base_model(saved_path)) != base_model(cfg.model_path):
            saved_base, now_base = (f"the base model {path}" if path is not None else
                                    f"the base made from seed {seed}"
                                    for path, seed in ((saved_path, saved_seed), (cfg.model_path, cfg.train.seed)))
            again = f"with --model {saved_path}" if saved_path is not None else "without --model"
            raise UserError(f"checkpoint {folder} holds LoRA adapters trained over {saved_base}, not {now_base}: "
                            f"resume {again}")
        saved_hash = meta.get("base_sha256")  # older checkpoints have none
        if None not in (saved_hash, base_hash) and saved_hash != base_hash:  # the folder holds other weights now
            raise UserError(f"checkpoint {folder} holds LoRA adapters trained over the base model {saved_path} as it "
                            f"was then, whose weights have changed since (SHA-256 of those outside the experts "
                            f"{saved_hash[:12]}..., now {base_hash[:12]}...): resume over the base as it was, or "
                            f"train new adapters over this one")
        if saved_path is None and saved_seed != cfg.train.seed:  # the base was made from the seed
            raise UserError(f"checkpoint {folder} holds LoRA adapters trained over the base made from seed "
                            f"{saved_seed}, not {cfg.train.seed}: resume with --seed {saved_seed}")
        # The same weights held in another format are another base: lora.base's, or the format a
        # tier holds them in whatever lora.base says (device_mxfp8's FP8). Older checkpoints held the default.
        saved_base = meta["config"].get("lora", {}).get("base", "default")
        if saved_base != cfg.lora.base:
            raise UserError(f"checkpoint {folder} holds LoRA adapters trained over the base held in lora.base "
                            f"{saved_base}, not {cfg.lora.base}: resume with --lora.base {saved_base}")
        saved_held, held = (_held_in(tier, saved_base) for tier in (saved_tier, cfg.tier))
        if saved_held != held:
            raise UserError(f"checkpoint {folder} holds LoRA adapters trained over the base held in {saved_held} by "
                            f"tier {saved_tier}, not {held} by tier {cfg.tier}: resume with --tier {saved_tier}")
    if upgrade_saved(meta["config"])["model"] != to_dict(cfg)["model"]:
        raise UserError(f"checkpoint {folder} holds a different model than the config describes; "
                        f"resume with the config it was written with ({meta_file})")
    saved_tokenizer = meta.get("tokenizer_sha256")  # older checkpoints have none
    if saved_tokenizer is not None and saved_tokenizer != tokenizer_hash:
        raise UserError(f"checkpoint {folder} was trained with a different tokenizer (SHA-256 "
                        f"{saved_tokenizer[:12]}..., this run's {tokenizer_hash[:12]}...): its token ids "
                        f"would mean other words; resume with the data and tokenizer it was written with")
    # At train.steps, a run that exports trains no step and exports the checkpoint's weights:
    # a finished run's way to the export that failed (a full disk), or was not asked for.
    exports = cfg.save_hf is not None or cfg.save_adapter is not None
    if meta["step"] > cfg.train.steps or (meta["step"] == cfg.train.steps and not exports):
        raise UserError(f"checkpoint {folder} is at step {meta['step']}, and train.steps is {cfg.train.steps}: "
                        f"nothing left to do (raise --steps to train further, or pass --save-hf or "
                        f"--save-adapter to export it)")


def _held_in(tier: str, lora_base: str) -> str:
    """What a LoRA run's frozen base is held in by `tier` under `lora_base`, as a line names it."""
    held = EXPERT_TIERS[tier].frozen_format(lora_base) if tier in EXPERT_TIERS else lora_base
    return f"lora.base {lora_base}" if held == lora_base else held


# The lora keys whose change on resume changes what the saved adapters compute.
_ADAPTER_KEYS = ("rank", "targets", "alpha", "rslora")


def _check_lora_adapters(saved: dict, cfg: RunConfig, folder: Path) -> None:
    """Refuse to resume LoRA adapters under other lora settings, naming the difference:
    another rank or new targets cannot load (no adapters of that shape or target were
    trained); fewer targets would drop trained adapters, another alpha or rslora rescale
    them, which `lora.change_on_resume` allows."""
    now = to_dict(cfg)["lora"]
    saved = {key: saved.get(key, now[key]) for key in _ADAPTER_KEYS}  # older checkpoints: as now
    if saved["rank"] != now["rank"] and 0 in (saved["rank"], now["rank"]):  # every weight, or adapters alone
        holds, way = (("a full fine-tune's weights (lora.rank 0), not LoRA adapters", "train adapters over its weights "
                       "with") if saved["rank"] == 0 else
                      (f"LoRA adapters of lora.rank {saved['rank']}, not a full fine-tune's weights",
                       "fine-tune every weight from"))
        raise UserError(f"checkpoint {folder} holds {holds}: resume with --lora.rank {saved['rank']}, or {way} its "
                        f"--save-hf export as --model")
    if saved["rank"] != now["rank"]:
        raise UserError(f"checkpoint {folder} was written with lora.rank {saved['rank']}, not {now['rank']} (its "
                        f"weights have other shapes): resume with --lora.rank {saved['rank']}")
    if not cfg.lora.enabled:
        return
    saved_targets = [t.strip() for t in saved["targets"].split(",") if t.strip()]
    added = [t for t in cfg.lora.target_list() if t not in saved_targets]
    if added:
        raise UserError(f"checkpoint {folder} holds no trained adapters for lora.targets {', '.join(added)}: resume "
                        f"with --lora.targets {','.join(saved_targets)}")
    changes = [f"lora.targets leaves out {', '.join(t for t in saved_targets if t not in cfg.lora.target_list())}, "
               f"whose trained adapters would be dropped"] if len(saved_targets) > len(cfg.lora.target_list()) else []
    changes += [f"lora.{key} is {now[key]}, not the checkpoint's {saved[key]}, which rescales the trained adapters"
                for key in ("alpha", "rslora") if saved[key] != now[key]]
    if changes and not cfg.lora.change_on_resume:
        raise UserError(f"checkpoint {folder}: {'; '.join(changes)}; resume with the checkpoint's lora settings, or "
                        f"pass --lora.change_on_resume to do so")
