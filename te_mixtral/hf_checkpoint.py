"""Hugging Face Mixtral checkpoints in te_mixtral's parameter layout.

Two expert layouts exist on disk, and both load:
- per expert (the published Mixtral checkpoints, and what transformers still writes):
  `model.layers.N.block_sparse_moe.experts.E.w1.weight` (gate, [F, D]), `w3` (up, [F, D]),
  `w2` (down, [D, F]), router `block_sparse_moe.gate.weight`;
- stacked (transformers v5 in memory): `model.layers.N.mlp.experts.gate_up_proj` [E, 2F, D]
  and `down_proj` [E, D, F], router `mlp.gate.weight`.
Our names are the stacked ones, so the dense weights load by name.

Each rank streams from the safetensors files only the tensors it keeps: the dense weights
and its own experts (a slice of a stacked tensor is read as a slice), never the whole model.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from te_mixtral.config import ModelConfig
from te_mixtral.errors import UserError
from te_mixtral.parallel import Layout

_PER_EXPERT = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")

_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "rms_norm_eps",
                "max_position_embeddings", "initializer_range", "tie_word_embeddings")


def model_config_from_hf(checkpoint_dir: str | Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read a Hugging Face config at {path}: {e}") from None
    if raw.get("model_type") != "mixtral":
        raise UserError(f"{path} describes a '{raw.get('model_type')}' model, not mixtral")
    fields = {k: raw[k] for k in _CONFIG_KEYS if k in raw}
    fields["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    fields["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta", 1e6)))
    return ModelConfig(**fields)


def hf_config(m: ModelConfig):
    """The transformers `MixtralConfig` of our model config."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **{k: getattr(m, k) for k in _CONFIG_KEYS}, head_dim=m.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
    )


def _safetensors_files(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({checkpoint_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"no .safetensors files in {checkpoint_dir}")
    return files


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, checkpoint_dir: str | Path, layout: Layout) -> None:
    """Copy a Hugging Face Mixtral checkpoint into `model`, this rank's experts only."""
    checkpoint_dir = Path(checkpoint_dir)
    params = dict(model.named_parameters())
    num_local = model.config.num_local_experts // layout.ep_size
    first = layout.ep_rank * num_local
    ffn = model.config.intermediate_size
    loaded = set()
    for file in _safetensors_files(checkpoint_dir):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                per_expert = _PER_EXPERT.fullmatch(key)
                if per_expert:
                    prefix, expert, part = per_expert.groups()
                    local = int(expert) - first
                    if not 0 <= local < num_local:
                        continue
                    target = {"w1": (f"{prefix}.mlp.experts.gate_up_proj", slice(0, ffn)),
                              "w3": (f"{prefix}.mlp.experts.gate_up_proj", slice(ffn, 2 * ffn)),
                              "w2": (f"{prefix}.mlp.experts.down_proj", slice(None))}[part]
                    params[target[0]][local, target[1]].copy_(f.get_tensor(key))
                    loaded.add((target[0], local, part))
                    continue
                name = key.replace(".block_sparse_moe.", ".mlp.")
                if name not in params:
                    raise UserError(f"{file.name}: tensor '{key}' has no place in a Mixtral model")
                if ".experts." in name:  # stacked: read only this rank's slice
                    params[name].copy_(f.get_slice(key)[first:first + num_local])
                    loaded.update((name, i, "stacked") for i in range(num_local))
                else:
                    params[name].copy_(f.get_tensor(key))
                    loaded.add(name)
    _check_complete(params, loaded, num_local, model.config.tie_word_embeddings)


def _check_complete(params, loaded, num_local, tied) -> None:
    for name in params:
        if ".experts." in name:
            complete = all((name, i, "stacked") in loaded or
                           all((name, i, p) in loaded for p in (("w1", "w3") if "gate_up" in name else ("w2",)))
                           for i in range(num_local))
        else:
            complete = name in loaded or (tied and name == "lm_head.weight")
        if not complete:
            raise UserError(f"the checkpoint has no weights for '{name}'")
