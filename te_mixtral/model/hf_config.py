"""The boundary between our `ModelConfig` and transformers' `MixtralConfig`.

HF's names stay here: `num_local_experts` in an HF config is the number of experts in the
model (ours: `ModelConfig.num_experts`), not the experts a rank holds.

`router_aux_loss_coef` travels both ways: read from a config.json (Mixtral's says 0.02), and
written into an exported one as the run used it. Mixtral's config.json also says
`output_router_logits: false`, so a transformers fine-tune of it computes no aux loss unless
asked; here the coefficient alone decides (training/hf_checkpoint.py's `adopt_checkpoint`
says which value wins).
"""

import json
from pathlib import Path

from te_mixtral.config import ModelConfig
from te_mixtral.errors import UserError

# Our `ModelConfig` field -> its `MixtralConfig` key: the same name but for the expert count.
_SAME_NAME = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "num_experts_per_tok", "rms_norm_eps", "max_position_embeddings",
              "initializer_range", "tie_word_embeddings")
_CONFIG_KEYS = {**{key: key for key in _SAME_NAME}, "num_experts": "num_local_experts"}
# What transformers' MixtralConfig takes when a config.json does not say.
HF_DEFAULT_AUX_LOSS_COEF = 0.001


def model_config_from_hf(checkpoint_dir: str | Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read a Hugging Face config at {path}: {e}") from None
    if raw.get("model_type") != "mixtral":
        raise UserError(f"{path} describes a '{raw.get('model_type')}' model, not mixtral")
    fields = {ours: raw[theirs] for ours, theirs in _CONFIG_KEYS.items() if theirs in raw}
    fields["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    fields["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta", 1e6)))
    fields["router_aux_loss_coef"] = float(raw.get("router_aux_loss_coef", HF_DEFAULT_AUX_LOSS_COEF))
    return ModelConfig(**fields)


def hf_config(m: ModelConfig):
    """The transformers `MixtralConfig` of our model config."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **{theirs: getattr(m, ours) for ours, theirs in _CONFIG_KEYS.items()}, head_dim=m.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        router_aux_loss_coef=m.aux_loss_coef,
    )
