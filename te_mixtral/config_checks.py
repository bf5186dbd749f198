"""The checks of a run config, each a one-line `UserError` a user can act on.

`config.load_config` runs `validate` and `check_needs` once a config is read; a Hugging Face
checkpoint's model section is checked again with `validate_model` when it replaces the
config's. The tier's name and options are the registry's to check
(`experts.registry.check_tier`), and `config.load_run_config` runs both. The lora section's
checks live with its settings (lora_config.py); `validate` runs them. Each check takes the run
config (`config.RunConfig`) unannotated: config.py imports this module, and this one stays
below it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import PurePath

from te_mixtral.errors import UserError, did_you_mean
from te_mixtral.errors import require as _check
from te_mixtral.lora_config import validate_lora, validate_lora_rank

FLOAT32_MAX = 3.4028234663852886e38
NAME_MAX = 255  # the bytes of one file or folder name on Linux's and macOS's filesystems
# What `report_to` may name (te_mixtral/measure/trackers.py has each tracker).
REPORT_TO = ("none", "tensorboard", "wandb", "mlflow")
# Values per block of 8-bit moments: te_mixtral/optim/moments8.py's BLOCK (a test holds them equal;
# this module stays free of torch).
MOMENTS_8BIT_BLOCK = 256


def validate(cfg, world_size: int = 1) -> None:
    """Every check that needs no process group; `world_size` from torchrun's environment.
    The tier's name and options are the registry's to check (`experts.registry.check_tier`)."""
    d, t = cfg.data, cfg.train
    check_paths(cfg)
    _check(0 <= t.seed < 2**32, f"train.seed must be in [0, 2**32), got {t.seed}")
    _check_choices(cfg)
    _check(t.optimizer != "master_adamw" or cfg.precision == "bf16",
           "train.optimizer master_adamw keeps bf16 parameters: it needs train.dtype bf16 (a CUDA run)")
    trackers = [name.strip() for name in cfg.report_to.split(",")]
    unknown = [name for name in trackers if name not in REPORT_TO]
    _check(not unknown and ("none" not in trackers or len(trackers) == 1),
           f"report_to must be none or any of {', '.join(REPORT_TO[1:])}, comma-separated; got {cfg.report_to!r}"
           + (did_you_mean(unknown[0], REPORT_TO) if unknown else ""))
    twice = next((name for name in trackers if trackers.count(name) > 1), None)
    _check(twice is None, f"report_to names {twice} twice; name each tracker once")
    _check(d.seq_len >= 2, f"data.seq_len must be at least 2, got {d.seq_len}")
    _check(d.format == "text" or d.tokenizer is not None or cfg.model_path is not None,
           f"data.format {d.format} needs a tokenizer with a chat template: set data.tokenizer to its folder "
           "(e.g. examples/chat-tokenizer) or model_path to a checkpoint that has one")
    _check(t.steps > 0, f"train.steps must be positive, got {t.steps}")
    _check(t.timing_warmup_steps >= 0,
           f"train.timing_warmup_steps must be 0 or positive, got {t.timing_warmup_steps}")
    _check(t.timing_warmup_steps < t.steps,
           f"train.timing_warmup_steps ({t.timing_warmup_steps}) leaves no timed step of train.steps ({t.steps}): "
           f"set --timing_warmup_steps {t.steps - 1} or fewer, or leave it unset (it then shrinks to fit)")
    _check(t.lr > 0 and math.isfinite(t.lr), f"need a finite lr > 0, got train.lr {t.lr}")
    # The optimizer multiplies fp32 tensors by it: a larger one is no number there (torch raises).
    _check(t.lr <= FLOAT32_MAX, f"train.lr {t.lr} is past the largest float32 ({FLOAT32_MAX:.3g}), the type the "
                                f"optimizer applies it in")
    _check(0 <= t.min_lr <= t.lr,
           f"train.min_lr ({t.min_lr}) must be in [0, train.lr ({t.lr})]: set --min_lr too, or leave it unset "
           f"(it then follows lr / 10)")
    _check(t.batch_size > 0, f"train.batch_size must be positive, got {t.batch_size}")
    _check(t.warmup_steps >= 0, f"train.warmup_steps must be 0 or positive, got {t.warmup_steps}")
    _check(0 < t.grad_clip < math.inf,
           f"train.grad_clip must be a finite norm above 0 (a large one, e.g. 1e9, clips nothing), got {t.grad_clip}")
    _check(0 <= t.weight_decay < math.inf, f"train.weight_decay must be finite and >= 0, got {t.weight_decay}")
    for key in ("beta1", "beta2"):
        _check(0 <= getattr(t, key) < 1, f"train.{key} must be in [0, 1), got {getattr(t, key)}")
    _check(d.max_documents is None or d.max_documents > 0,
           f"data.max_documents must be positive or null, got {d.max_documents}")
    _check(t.log_every > 0, f"train.log_every must be positive, got {t.log_every}")
    _check(cfg.ep_size > 0, f"ep_size must be positive, got {cfg.ep_size}")
    _check(cfg.ep_chunks > 0, f"ep_chunks must be positive, got {cfg.ep_chunks}")
    _check(0 <= cfg.ep_capacity < math.inf, f"ep_capacity must be 0 or a finite share above 0, got {cfg.ep_capacity}")
    _check(cfg.ep_capacity == 0 or cfg.ep_chunks == 1,
           f"ep_capacity pads one exchange per layer; ep_chunks {cfg.ep_chunks} cuts it in chunks: use one of them")
    _check(world_size != 1 or cfg.ep_size == 1,
           f"ep_size {cfg.ep_size} splits each layer's experts over {cfg.ep_size} processes, and this is one: "
           f"launch {cfg.ep_size} (or a multiple) with torchrun, e.g. `torchrun --nproc_per_node={cfg.ep_size} "
           f"run_finetune_ep.py --ep-size {cfg.ep_size}`")
    _check(world_size % cfg.ep_size == 0,
           f"world size ({world_size}) is not divisible by ep_size ({cfg.ep_size}): launch {cfg.ep_size} processes "
           f"(or a multiple), or give an --ep-size that divides {world_size}")
    _check(t.grad_accum_steps >= 1, f"train.grad_accum_steps must be at least 1, got {t.grad_accum_steps}")
    _check(t.batch_size % (world_size * t.grad_accum_steps) == 0,
           f"train.batch_size ({t.batch_size}) is not divisible by the world size ({world_size}) x "
           f"train.grad_accum_steps ({t.grad_accum_steps}): each rank reads batch_size / (world x "
           f"grad_accum_steps) samples per micro-batch")
    _check(0 <= d.eval_fraction < 1, f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    _check(t.eval_every >= 0, f"train.eval_every must be 0 or positive, got {t.eval_every}")
    for key in ("save_every", "checkpoint_every"):
        _check(getattr(t, key) >= 0, f"train.{key} must be 0 or positive, got {getattr(t, key)}")
    _check(cfg.checkpoint_keep >= 1, f"checkpoint_keep must be at least 1, got {cfg.checkpoint_keep}")
    _check(cfg.generate_tokens > 0, f"generate_tokens must be positive, got {cfg.generate_tokens}")
    _check(cfg.dist_timeout_s > 0, f"dist_timeout_s must be positive, got {cfg.dist_timeout_s}")
    validate_lora(cfg)
    _check(world_size != 1 or t.sharding == "none",
           "train.sharding fsdp shards over the ranks, and this is one process: launch several with torchrun, or "
           "leave it none")
    if cfg.model_path is None:  # else the checkpoint's config.json replaces the model section, checked then
        validate_model(cfg)


def value_of(cfg, key: str):
    """The value of a full key (`train.lr`, `tier`) in the run config `cfg`."""
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def path_keys(cfg) -> dict:
    """{full key: its value} of every path key (`setting(path=True)`) of the run config `cfg`."""
    return {key: value for key, f, _, value in _keys(cfg) if f.metadata["path"]}


def check_paths(cfg) -> None:
    """Every path key (`setting(path=True)`) names a path a filesystem can hold."""
    for key, path in path_keys(cfg).items():
        # An empty path is no path: it would stand for the current folder, or switch the key off.
        _check(path != "", f"{key} is an empty path: name one, or leave it unset (null)")
        # An export's name gets a suffix: it is written into `DIR.tmp` and the one it replaces moves to `DIR.old`.
        suffix = len(".tmp") if key in ("save_hf", "save_adapter") else 0
        longest = max((part for part in PurePath(path or "").parts), key=lambda part: len(part.encode()), default="")
        _check(len(longest.encode()) + suffix <= NAME_MAX,
               f"{key} has a name of {len(longest.encode())} bytes ('{longest[:24]}...'); a file or folder name has "
               f"at most {NAME_MAX}" + (f", and {key}'s gets '.tmp' added while it is written" if suffix else ""))


def _keys(cfg):
    """(full key, its field, its type hint, its value) for every key of the run config `cfg`."""
    sections = [("", cfg)] + [(f"{f.name}.", getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                              if dataclasses.is_dataclass(getattr(cfg, f.name))]
    for prefix, section in sections:
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            if not dataclasses.is_dataclass(getattr(section, f.name)):
                yield prefix + f.name, f, hints[f.name], getattr(section, f.name)


def _check_choices(cfg) -> None:
    """Every key annotated `Literal[...]` (config.py) holds one of the values it lists."""
    for key, _, hint, value in _keys(cfg):
        if typing.get_origin(hint) is typing.Literal:
            allowed = typing.get_args(hint)
            if value not in allowed:
                raise UserError(f"{key} must be one of {', '.join(allowed)}, got '{value}'{did_you_mean(value, allowed)}")


def check_needs(cfg, given: set[str], file_cfg=None, typed: frozenset[str] = frozenset(),
                saved: bool = False) -> None:
    """Refuse a key the user gave (`given`: the keys the config file, the command line or the
    launcher set) that changes nothing in this run, because another key does not enable it
    (its `setting(needs=...)`, config_field.py): LoRA's alpha without a rank, generate_tokens
    without a prompt, a model section's key beside model_path.

    A key typed on the command line (`typed`) is refused whatever its value: the user asked for
    it in this run (`--model DIR --num_experts 8` names an architecture the checkpoint replaces,
    even where 8 is the default). A key the file sets at its default is left alone: it changes
    nothing either way.

    `file_cfg` is the config as the config file alone set it. A key the file sets, which the
    file's own settings enable, is left alone where the command line (or the launcher) turns
    off what it needs: a file serves more runs than one, and the command line overrides it
    (`--model` replaces the file's model section, `--lora.rank 0` turns its LoRA off). A file
    that sets a key against itself is refused, unless a run saved it (`saved`:
    saved_config.is_saved): a run writes every key, not only those asked for, each at its value
    of the day (a default may have changed since), so every key it sets is left alone and the
    run loads again as it ran."""
    for key, f, _, value in _keys(cfg):
        needs = f.metadata.get("needs")
        if needs is None or key not in given or needs.hold_in(lambda k: value_of(cfg, k)):
            continue
        from_file = file_cfg is not None and value_of(file_cfg, key) == value
        left_alone = key not in typed and (value == f.default or (
            from_file and (saved or needs.hold_in(lambda k: value_of(file_cfg, k)))))
        _check(left_alone, f"{key} {needs.text}")


def validate_model(cfg) -> None:
    """The checks of the model section, and of what must fit it."""
    m, d = cfg.model, cfg.data
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok"):
        _check(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
    layers = cfg.train.recompute_layers
    _check(layers is None or 1 <= layers <= m.num_hidden_layers,
           f"train.recompute_layers must be in [1, model.num_hidden_layers ({m.num_hidden_layers})], got {layers}")
    _check(m.num_attention_heads % m.num_key_value_heads == 0,
           f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
           f"model.num_key_value_heads ({m.num_key_value_heads})")
    for key in ("rms_norm_eps", "rope_theta", "initializer_range"):
        _check(0 < getattr(m, key) < math.inf, f"model.{key} must be finite and above 0, got {getattr(m, key)}")
    for key in ("router_aux_loss_coef", "router_z_loss_coef"):
        value = getattr(m, key)
        _check(value is None or 0 <= value < math.inf, f"model.{key} must be finite and at least 0, got {value}")
    _check(m.head_dim % 2 == 0, f"model.head_dim must be even for rotary embeddings, got {m.head_dim}")
    _check(m.num_experts_per_tok <= m.num_experts,
           f"model.num_experts_per_tok ({m.num_experts_per_tok}) exceeds model.num_experts ({m.num_experts})")
    _check(d.seq_len <= m.max_position_embeddings,
           f"data.seq_len ({d.seq_len}) exceeds model.max_position_embeddings ({m.max_position_embeddings})")
    _check(d.tokenizer is not None or d.format != "text" or d.tokenizer_vocab_size <= m.vocab_size,
           f"data.tokenizer_vocab_size ({d.tokenizer_vocab_size}) exceeds model.vocab_size ({m.vocab_size})")
    _check(cfg.train.expert_moments == "same" or m.hidden_size * m.intermediate_size % MOMENTS_8BIT_BLOCK == 0,
           f"train.expert_moments 8bit keeps blocks of {MOMENTS_8BIT_BLOCK} values within each expert's weights: "
           f"model.hidden_size x model.intermediate_size ({m.hidden_size} x {m.intermediate_size}) must be a "
           f"multiple of {MOMENTS_8BIT_BLOCK}")
    _check(m.num_experts % cfg.ep_size == 0,
           f"model.num_experts ({m.num_experts}) is not divisible by ep_size ({cfg.ep_size})")
    if cfg.lora.enabled:
        validate_lora_rank(cfg)

