"""One typed configuration for a run, loaded from YAML, overridden from the command line,
validated once.

A YAML file has three sections (`model`, `data`, `train`) and a few top-level keys
(`tier`, `ep_size`, ...). Command-line overrides name a key either in full
(`--train.lr 1e-4`) or by its bare name when that name is unique (`--lr 1e-4`); values are
parsed as YAML scalars. Every problem is raised as a `UserError` whose message is one line
a user can act on.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from te_mixtral.errors import UserError

TIER_NAMES = ("hf", "loop", "grouped_linear", "custom_grouped", "device_mxfp8")
DTYPES = ("auto", "fp32", "bf16")
BACKENDS = ("auto", "torch", "te")
DEVICES = ("auto", "cpu", "cuda")
MXFP8_MODES = ("auto", "mxfp8-te", "fp8-hopper", "mxfp8-emulated")


@dataclass
class ModelConfig:
    """Mixtral architecture; defaults are Mixtral-8x7B's."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False


@dataclass
class DataConfig:
    # "embedded" (text shipped with Python, no network), a local .json/.jsonl/.txt file or
    # folder, or a Hugging Face hub data set name.
    dataset: str = "embedded"
    text_field: str = "text"
    split: str = "train"
    # A tokenizer.json file or a folder holding one; None trains a small BPE on the data
    # and caches it.
    tokenizer: str | None = None
    tokenizer_vocab_size: int = 2048
    seq_len: int = 256
    max_documents: int | None = None
    # Share of the packed samples held out for evaluation: a fixed draw that depends on the
    # data alone (not the seed), never trained on. 0 turns evaluation off.
    eval_fraction: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 30
    batch_size: int = 4  # samples per optimizer step, summed over all ranks
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    timing_warmup_steps: int = 3  # steps left out of the timing statistics
    log_every: int = 5
    eval_every: int = 0  # evaluate on the held-out samples every N steps (0: at the end only)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tier: str = "loop"
    ep_size: int = 1
    backend: str = "auto"  # layer backend: TE modules, or plain PyTorch
    device: str = "auto"
    output_dir: str | None = None
    loss_check: str | None = None  # a reference run's results JSON
    dist_timeout_s: int = 300
    # device_mxfp8 tier: auto (the GPU's own 8-bit path: MXFP8 on Blackwell, FP8 on Hopper),
    # or one of mxfp8-te, fp8-hopper, mxfp8-emulated (MXFP8 numerics on any device).
    mxfp8_mode: str = "auto"
    # After training, time each phase of a step on its own (te_mixtral/measure/phases.py).
    profile_phases: bool = False
    # A Hugging Face Mixtral checkpoint to fine-tune (local folder or hub id): its config.json
    # replaces the `model` section, and its tokenizer.json is used when data.tokenizer is unset.
    model_path: str | None = None
    save_hf: str | None = None  # export the fine-tuned model to this folder as an HF checkpoint
    save_every: int = 0  # also export to save_hf every N steps (0: at the end only)
    checkpoint_dir: str | None = None  # training checkpoints (per-rank shards) for `resume`
    checkpoint_every: int = 0  # steps between training checkpoints (0: at the end only)
    checkpoint_keep: int = 2  # newest checkpoints kept; older ones are deleted
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir
    generate: str | None = None  # after training, print a greedy continuation of this prompt
    generate_tokens: int = 32
    # The memory a rank may use, checked before anything is built: a GPU name (h100, h200,
    # b200) or a size (80GiB, 141GB); unset, the device's own (see te_mixtral/measure/memory.py).
    gpu: str | None = None

    @property
    def precision(self) -> str:
        """The precision the run actually computes in (resolved from `train.dtype`)."""
        if self.train.dtype != "auto":
            return self.train.dtype
        return "bf16" if self.resolved_device() == "cuda" else "fp32"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


def _field_types(cls) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in SECTIONS}


def _coerce(key: str, value, expected):
    """Check `value` against a field's annotated type; ints are accepted for floats."""
    allowed = typing.get_args(expected) if isinstance(expected, types.UnionType) else (expected,)
    if value is None and type(None) in allowed:
        return None
    for typ in allowed:
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if typ is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if typ is not type(None) and isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise UserError(f"config key '{key}' must be {names}, got {value!r}")


def _apply(cfg: RunConfig, key: str, value) -> None:
    section, _, name = key.rpartition(".")
    if section and section not in SECTIONS:
        raise UserError(f"unknown config section '{section}' in '{key}' (sections: {', '.join(SECTIONS)})")
    target = getattr(cfg, section) if section else cfg
    types_ = _field_types(type(target))
    if name not in types_:
        raise UserError(f"unknown config key '{key}'")
    setattr(target, name, _coerce(key, value, types_[name]))


def _flatten(mapping: dict, where: str) -> dict[str, object]:
    flat = {}
    for key, value in mapping.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise UserError(f"'{key}' in {where} must be a mapping of keys")
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def _key_types(key: str) -> tuple:
    """The types a key accepts; () for an unknown key (which `_apply` then reports)."""
    section, _, name = key.rpartition(".")
    if section and section not in SECTIONS:
        return ()
    expected = _field_types(SECTIONS[section] if section else RunConfig).get(name)
    if expected is None:
        return ()
    return typing.get_args(expected) if isinstance(expected, types.UnionType) else (expected,)


def _parse_override(key: str, text: str):
    """A command-line value: a YAML scalar, except that text keys take the text as written
    (a prompt such as `Q: why?` or a path such as `yes` is not YAML), `null` aside."""
    if str in _key_types(key) and text not in ("null", "~"):
        return text
    return yaml.safe_load(text)


def is_switch(bare: str) -> bool:
    """Whether a command-line key is a true/false switch, so `--resume` alone means true."""
    try:
        return _key_types(_full_key(bare.replace("-", "_"))) == (bool,)
    except UserError:
        return False


def _full_key(bare: str) -> str:
    """Resolve a bare override name (`lr`) to its full key (`train.lr`)."""
    if "." in bare or bare in _field_types(RunConfig):
        return bare
    owners = [s for s, cls in SECTIONS.items() if bare in _field_types(cls)]
    if len(owners) == 1:
        return f"{owners[0]}.{bare}"
    if owners:
        raise UserError(f"'{bare}' is ambiguous: write one of {', '.join(f'{s}.{bare}' for s in owners)}")
    raise UserError(f"unknown config key '{bare}'")


def load_config(path: str | None = None, overrides: dict[str, str] | None = None, world_size: int = 1) -> RunConfig:
    """Defaults, then the YAML file, then the overrides (raw strings parsed as YAML), validated."""
    cfg = RunConfig()
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise UserError(f"cannot read config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise UserError(f"config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config {path} must be a mapping of keys")
        for key, value in _flatten(raw, path).items():
            _apply(cfg, key, value)
    for bare, text in (overrides or {}).items():
        key = _full_key(bare.replace("-", "_"))
        _apply(cfg, key, _parse_override(key, text))
    validate(cfg, world_size)
    return cfg


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Every check that needs no process group; `world_size` from torchrun's environment."""
    d, t = cfg.data, cfg.train
    _check(cfg.tier in TIER_NAMES, f"unknown tier '{cfg.tier}' (tiers: {', '.join(TIER_NAMES)})")
    _check(cfg.backend in BACKENDS, f"backend must be one of {', '.join(BACKENDS)}, got '{cfg.backend}'")
    _check(cfg.device in DEVICES, f"device must be one of {', '.join(DEVICES)}, got '{cfg.device}'")
    _check(cfg.mxfp8_mode in MXFP8_MODES,
           f"mxfp8_mode must be one of {', '.join(MXFP8_MODES)}, got '{cfg.mxfp8_mode}'")
    _check(t.dtype in DTYPES, f"train.dtype must be one of {', '.join(DTYPES)}, got '{t.dtype}'")
    _check(d.seq_len >= 2, f"data.seq_len must be at least 2, got {d.seq_len}")
    _check(t.steps > 0, f"train.steps must be positive, got {t.steps}")
    _check(0 <= t.timing_warmup_steps < t.steps,
           f"train.timing_warmup_steps ({t.timing_warmup_steps}) must be below train.steps ({t.steps})")
    _check(t.lr > 0 and 0 <= t.min_lr <= t.lr, "need 0 <= train.min_lr <= train.lr and lr > 0")
    _check(t.log_every > 0, f"train.log_every must be positive, got {t.log_every}")
    _check(cfg.ep_size > 0, f"ep_size must be positive, got {cfg.ep_size}")
    _check(world_size % cfg.ep_size == 0,
           f"world size ({world_size}) is not divisible by ep_size ({cfg.ep_size})")
    _check(t.batch_size % world_size == 0,
           f"train.batch_size ({t.batch_size}) is not divisible by the world size ({world_size}): "
           f"each rank reads batch_size / world samples")
    _check(0 <= d.eval_fraction < 1, f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    _check(t.eval_every >= 0, f"train.eval_every must be 0 or positive, got {t.eval_every}")
    _check(t.eval_every == 0 or d.eval_fraction > 0,
           "train.eval_every needs held-out data: set data.eval_fraction (e.g. 0.05)")
    for key in ("save_every", "checkpoint_every"):
        _check(getattr(cfg, key) >= 0, f"{key} must be 0 or positive, got {getattr(cfg, key)}")
    _check(cfg.save_every == 0 or cfg.save_hf is not None, "save_every needs save_hf (the folder to export to)")
    _check(cfg.checkpoint_dir is not None or (cfg.checkpoint_every == 0 and not cfg.resume),
           "checkpoint_every and resume need checkpoint_dir")
    _check(cfg.checkpoint_keep >= 1, f"checkpoint_keep must be at least 1, got {cfg.checkpoint_keep}")
    _check(cfg.generate_tokens > 0, f"generate_tokens must be positive, got {cfg.generate_tokens}")
    _check(cfg.dist_timeout_s > 0, f"dist_timeout_s must be positive, got {cfg.dist_timeout_s}")
    _check(not (cfg.profile_phases and cfg.tier == "hf"),
           "profile_phases times te_mixtral's own model; tier 'hf' runs transformers' model")
    _check(cfg.tier != "hf" or world_size == 1,
           f"tier 'hf' runs Hugging Face's model in a single process; launch it with one process, not {world_size}")
    if cfg.model_path is None:  # else the checkpoint's config.json replaces the model section, checked then
        validate_model(cfg)


def validate_model(cfg: RunConfig) -> None:
    """The checks of the model section, and of what must fit it."""
    m, d = cfg.model, cfg.data
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok"):
        _check(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
    _check(m.num_attention_heads % m.num_key_value_heads == 0,
           f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
           f"model.num_key_value_heads ({m.num_key_value_heads})")
    _check(m.head_dim % 2 == 0, f"model.head_dim must be even for rotary embeddings, got {m.head_dim}")
    _check(m.num_experts_per_tok <= m.num_local_experts,
           f"model.num_experts_per_tok ({m.num_experts_per_tok}) exceeds model.num_local_experts "
           f"({m.num_local_experts})")
    _check(d.seq_len <= m.max_position_embeddings,
           f"data.seq_len ({d.seq_len}) exceeds model.max_position_embeddings ({m.max_position_embeddings})")
    _check(d.tokenizer is not None or d.tokenizer_vocab_size <= m.vocab_size,
           f"data.tokenizer_vocab_size ({d.tokenizer_vocab_size}) exceeds model.vocab_size ({m.vocab_size})")
    _check(m.num_local_experts % cfg.ep_size == 0,
           f"model.num_local_experts ({m.num_local_experts}) is not divisible by ep_size ({cfg.ep_size})")


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
