"""The boundary between our `ModelConfig` and transformers' `MixtralConfig`.

HF's names stay here: `num_local_experts` in an HF config is the number of experts in the
model (ours: `ModelConfig.num_experts`), not the experts a rank holds.

A config.json is read strictly, because a field read wrong or dropped trains a different
function from the one transformers computes, silently:
- the fields that fix the weights' shapes are required, and every field is type-checked;
- fields that change the function but that our model does not implement (a sliding window
  shorter than the run's sequences, scaled rotary embeddings, another activation, training
  noise and dropout, quantized weights) are refused, each in one line naming the field.

`router_aux_loss_coef` travels both ways: read from a config.json (Mixtral's says 0.02), and
written into an exported one as the run used it. Mixtral's config.json also says
`output_router_logits: false`, so a transformers fine-tune of it computes no aux loss unless
asked; here the coefficient alone decides (training/hf_checkpoint.py's `adopt_checkpoint`
says which value wins).
"""

import json
import typing
from pathlib import Path

from te_mixtral.config import ModelConfig
from te_mixtral.errors import UserError, first_line
from te_mixtral.local_or_hub import hub_unreachable, local_path

# Our `ModelConfig` field -> its `MixtralConfig` key: the same name but for the expert count.
_SAME_NAME = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "num_experts_per_tok", "rms_norm_eps", "max_position_embeddings",
              "initializer_range", "tie_word_embeddings")
_CONFIG_KEYS = {**{key: key for key in _SAME_NAME}, "num_experts": "num_local_experts"}
# The keys that fix the weights' shapes: no default can stand in for them.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "num_local_experts", "num_experts_per_tok")
# What transformers' MixtralConfig assumes when one of the other keys is absent.
_HF_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "initializer_range": 0.02,
                "tie_word_embeddings": False, "rope_theta": 1e6}
# What transformers' MixtralConfig takes when a config.json does not say.
HF_DEFAULT_AUX_LOSS_COEF = 0.001


def _typed(path: Path, key: str, value, expected: type):
    """`value` as `expected` (an int is accepted for a float), or a one-line refusal."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value
    raise UserError(f"{path}: '{key}' must be {'a number' if expected is float else expected.__name__}, "
                    f"got {value!r}")


def _rope_theta_and_type(raw: dict, path: Path) -> tuple[float, str]:
    """The rotary base and scaling type, from transformers v5's `rope_parameters` or the
    older `rope_theta` plus `rope_scaling` (whose type key was `type`, later `rope_type`)."""
    rope = raw.get("rope_parameters")
    if rope is None:
        rope = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", _HF_DEFAULTS["rope_theta"])}
    if not isinstance(rope, dict):
        raise UserError(f"{path}: 'rope_parameters' must be a mapping, got {rope!r}")
    theta = _typed(path, "rope_theta", rope.get("rope_theta", _HF_DEFAULTS["rope_theta"]), float)
    return theta, rope.get("rope_type", rope.get("type", "default"))


def _refuse_unimplemented(raw: dict, path: Path, rope_type: str, longest_sequence: int) -> None:
    """Refuse each field whose value changes the function in a way our model does not follow."""
    if rope_type != "default":
        raise UserError(f"{path}: rotary scaling '{rope_type}' is not implemented here (only unscaled rotary "
                        f"embeddings); the model would compute a different function from transformers'")
    window = raw.get("sliding_window")
    if window is not None and _typed(path, "sliding_window", window, int) < longest_sequence:
        raise UserError(f"{path}: 'sliding_window' {window} is shorter than the longest sequence this run may "
                        f"feed the model ({longest_sequence} tokens: data.seq_len, or max_position_embeddings when "
                        f"generating), and sliding-window attention is not implemented here")
    if raw.get("hidden_act", "silu") != "silu":
        raise UserError(f"{path}: 'hidden_act' {raw['hidden_act']!r} is not implemented here (the experts are "
                        f"SwiGLU, silu)")
    for key in ("router_jitter_noise", "attention_dropout"):
        if _typed(path, key, raw.get(key, 0.0), float) != 0:
            raise UserError(f"{path}: '{key}' {raw[key]} is not implemented here (training would differ from "
                            f"transformers'); set it to 0")
    if raw.get("attention_bias"):
        raise UserError(f"{path}: 'attention_bias' is true, and attention biases are not implemented here")
    if raw.get("quantization_config") is not None:
        raise UserError(f"{path}: the checkpoint is quantized ('quantization_config'); fine-tune an unquantized one")


# What a run reads of a hub checkpoint: configs, tokenizer, chat template and weights.
CHECKPOINT_FILES = ("*.json", "*.jinja", "*.safetensors")


def resolve_model_path(name: str, files: tuple[str, ...] = CHECKPOINT_FILES) -> Path:
    """The local folder of a checkpoint (`model_path`): `name` itself, or a hub id whose
    `files` (patterns; the memory estimate asks for config.json alone) are downloaded to the
    hub cache (every rank may call this, the hub client locks its cache, and a cached snapshot
    returns at once). Where the hub cannot be reached, the cache's copy, or one line at once."""
    path = local_path(name)
    if path is not None:
        if not path.exists():
            raise UserError(f"checkpoint folder {path} does not exist")
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not a Hugging Face checkpoint folder (it has no config.json)")
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if reason := hub_unreachable():  # the hub's client would try for half a minute, then read its cache
        try:
            return Path(snapshot_download(name, allow_patterns=list(files), local_files_only=True))
        except LocalEntryNotFoundError:
            raise UserError(f"model '{name}' is no local folder, and {reason} nor does its cache "
                            f"({constants.HF_HUB_CACHE}) hold it: pass a local checkpoint folder "
                            f"(scripts/make_tiny_mixtral.py writes a tiny one), or download it where the hub can be "
                            f"reached") from None
    try:
        return Path(snapshot_download(name, allow_patterns=list(files)))
    except Exception as e:
        raise UserError(f"'{name}' is not a local folder, and downloading it from the Hugging Face hub failed "
                        f"({first_line(e)}); offline, pass a local checkpoint folder") from None


def hub_revision(model_dir: Path) -> str | None:
    """The commit of a checkpoint folder `resolve_model_path` took from the hub cache, where
    huggingface_hub keeps each revision as `snapshots/COMMIT`; None for a local folder."""
    return model_dir.name if model_dir.parent.name == "snapshots" else None


def longest_sequence(cfg) -> int | None:
    """The most tokens the run config `cfg` (a `RunConfig`) feeds the model at once, as
    `model_config_from_hf` takes it, for the run and its memory estimate alike: a training or
    evaluation sample (data.seq_len); with generate, None (max_position_embeddings): a prompt
    and its continuation may run that long, and the prompt's length is known only once the
    run's tokenizer reads it."""
    return None if cfg.generate is not None else cfg.data.seq_len


def model_config_from_hf(checkpoint_dir: str | Path, longest_sequence: int | None = None) -> ModelConfig:
    """Our `ModelConfig` from a checkpoint's config.json (see the module docstring).

    `longest_sequence` is the most tokens the run feeds the model at once: a sliding window
    at least that long changes nothing. None (the length is not known yet) means
    `max_position_embeddings`, the most any run may feed.
    """
    path = Path(checkpoint_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read a Hugging Face config at {path}: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a Hugging Face config: it holds a {type(raw).__name__}, not a mapping")
    if raw.get("model_type") != "mixtral":
        raise UserError(f"{path} describes a '{raw.get('model_type')}' model, not mixtral")
    missing = [key for key in _REQUIRED if raw.get(key) is None]
    if missing:
        raise UserError(f"{path} lacks {', '.join(repr(k) for k in missing)}: the weights' shapes depend on them")

    types = typing.get_type_hints(ModelConfig)
    fields = {ours: _typed(path, theirs, raw.get(theirs, _HF_DEFAULTS.get(theirs)), types[ours])
              for ours, theirs in _CONFIG_KEYS.items() if theirs in raw or theirs in _HF_DEFAULTS}
    for key in _REQUIRED:
        if raw[key] <= 0:
            raise UserError(f"{path}: '{key}' must be positive, got {raw[key]}")
    head_dim = raw.get("head_dim")
    fields["head_dim"] = (fields["hidden_size"] // fields["num_attention_heads"] if head_dim is None
                          else _typed(path, "head_dim", head_dim, int))
    fields["rope_theta"], rope_type = _rope_theta_and_type(raw, path)
    _refuse_unimplemented(raw, path, rope_type,
                          fields["max_position_embeddings"] if longest_sequence is None else longest_sequence)
    fields["router_aux_loss_coef"] = _typed(path, "router_aux_loss_coef",
                                            raw.get("router_aux_loss_coef", HF_DEFAULT_AUX_LOSS_COEF), float)
    return ModelConfig(**fields)


def hf_config(m: ModelConfig):
    """The transformers `MixtralConfig` of our model config."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **{theirs: getattr(m, ours) for ours, theirs in _CONFIG_KEYS.items()}, head_dim=m.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        router_aux_loss_coef=m.aux_loss_coef,
    )
