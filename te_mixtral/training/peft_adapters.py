"""LoRA adapters in PEFT's format, for transformers' `MixtralForCausalLM`, out and in.

`save_adapter` writes `adapter_config.json` (lora_config.peft_config) and
`adapter_model.safetensors` as `PeftModel.save_pretrained` does, so that

    PeftModel.from_pretrained(MixtralForCausalLM.from_pretrained(base), folder)

gives our model's logits. `load_adapter` reads such a folder back into a run's adapters
(`lora.init`: ours, or one PEFT wrote for Mixtral with targets we adapt, whose settings the
run config took as it loaded: lora_config.adopt_adapter), the way PEFT's users go on training
from one (`PeftModel.from_pretrained(..., is_trainable=True)`). How our adapters map onto
PEFT's (te_mixtral/model/lora.py has ours):

- attention: PEFT's `target_modules`; `...self_attn.q_proj.lora_A.weight` is our `A` [r, in],
  `lora_B.weight` our `B` [out, r].
- experts: PEFT's `target_parameters` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`),
  one adapter per expert on a stacked weight. PEFT keeps all experts' A in one matrix
  [E*r, in] (expert-major: rows e*r .. e*r+r-1 are expert e's A), and all B in [out, r*E]
  with the expert as the *fastest* index (column j*E + e is expert e's column j). Two
  targets on one module nest: PEFT wraps the first listed innermost, so its keys gain one
  `base_layer.` per target listed after it.

What PEFT cannot express: dropout on a parameter target (PEFT refuses it: x cannot be
factored out of a stacked weight's product). Dropout acts only while training, so the
adapters are the same without it; with expert targets the saved `lora_dropout` is 0.

The run's tokenizer goes beside them, as in a Hugging Face export (its tokenizer.json, config
and chat templates): the adapters learnt its token ids and template, which need not be the
base's (a run trains its own over a seeded base, and `--tokenizer` names another), and PEFT's
users read it from there (`AutoTokenizer.from_pretrained(folder)`).

Adapters are saved in the dtype they train in (fp32). The experts' adapters are gathered from the EP group to rank 0 one expert at a time, as the
Hugging Face export gathers the experts (hf_checkpoint.py). Read back, every rank reads and
checks each tensor whole (all refuse alike; adapters are small) and keeps its own experts'.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from te_mixtral.config import RunConfig
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import UserError, first_line
from te_mixtral.files import (
    fsync_path,
    make_scratch,
    remove_scratch,
    replace_files,
    sibling,
    staged_beside,
    write_failure,
)
from te_mixtral.lora_config import peft_config
from te_mixtral.training.checkpoint import require_finite_weights
from te_mixtral.training.hf_checkpoint import gather_experts, read_tensor, write_safetensors, write_tokenizer
from te_mixtral.training.outputs import EXPORT_MARKER, export_marker, is_export_file

PREFIX = "base_model.model."  # PeftModel's name of the wrapped transformers model


def expert_key(layer: int, target: str, targets: list[str], factor: str) -> str:
    """PEFT's key of one expert target's lora_A or lora_B (`factor`), nesting included."""
    nesting = "base_layer." * (len(targets) - 1 - targets.index(f"mlp.experts.{target}"))
    return f"{PREFIX}model.layers.{layer}.mlp.experts.{nesting}{factor}.weight"


def peft_expert_tensors(a_ErI: torch.Tensor, b_EOr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our stacked A [E, r, I] and B [E, O, r] as PEFT's lora_A [E*r, I] and lora_B [O, r*E]."""
    experts, rank, _ = a_ErI.shape
    return a_ErI.reshape(experts * rank, -1), b_EOr.permute(1, 2, 0).reshape(b_EOr.shape[1], rank * experts)


def stacked_expert_tensors(a_flat: torch.Tensor, b_flat: torch.Tensor,
                           experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `peft_expert_tensors`: PEFT's lora_A [E*r, I] and lora_B [O, r*E] as our
    stacked A [E, r, I] and B [E, O, r]."""
    return (a_flat.reshape(experts, -1, a_flat.shape[1]),
            b_flat.reshape(b_flat.shape[0], -1, experts).permute(2, 0, 1))


# A key of a PeftModel's own state_dict: the adapter's name after lora_A or lora_B, which
# save_pretrained leaves out.
_NAMED = re.compile(r"\.(lora_[AB])\.([^.]+)\.weight$")


def saved_keys(keys, file: Path) -> dict[str, str]:
    """The adapter file's keys, each by its name as save_pretrained writes it. PEFT's loader gives
    a saved key its adapter's name and takes a key that has one as it is, so a file of the
    PeftModel's state_dict (`...lora_A.default.weight`) loads into its default adapter: it is read
    alike here; any other name, PEFT leaves unread (its adapters stay as they started), so it is
    refused, as a key there twice is."""
    saved = {}
    for key in keys:
        plain, named = key, _NAMED.search(key)
        if named is not None:
            if named[2] != "default":
                raise UserError(f"{file}: '{key}' carries the adapter name '{named[2]}', which PEFT's from_pretrained "
                                f"does not read (it reads keys as save_pretrained writes them, '...{named[1]}.weight', "
                                f"or of its 'default' adapter): save the adapter with PeftModel.save_pretrained")
            plain = key[:named.start()] + f".{named[1]}.weight"
        if plain in saved:
            raise UserError(f"{file} holds '{plain}' twice, as '{saved[plain]}' and '{key}'")
        saved[plain] = key
    return saved


@torch.no_grad()
def load_adapter(model: torch.nn.Module, folder: str | Path, cfg: RunConfig, layout: Layout) -> None:
    """Copy the adapters of the PEFT adapter `folder` (lora.init) into `model`'s (`cfg`'s, which
    took the folder's settings): this rank's experts of each expert target. A file that lacks
    one of them, holds another, or one of another shape or not finite, is refused in one line."""
    file = Path(folder) / "adapter_model.safetensors"
    if not file.is_file():
        raise UserError(f"lora.init {folder} has no adapter_model.safetensors, the adapters' weights (an "
                        f"adapter_model.bin, PEFT's older pickle, is not read: it can run code)")
    experts = model.config.num_experts
    targets = peft_config(cfg)["target_parameters"]
    # (PEFT's keys of A and B, the shapes they must have, the adapter, the experts this rank holds
    # of a stacked one by id, None for a dense one)
    pairs = []
    for index, layer in enumerate(model.model.layers):
        for target, adapter in layer.self_attn.adapters.items():
            stem = f"{PREFIX}model.layers.{index}.self_attn.{target}"
            pairs.append(((f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"),
                          (list(adapter.A.shape), list(adapter.B.shape)), adapter, None))
        for target, adapter in layer.mlp.experts.adapters.items():
            (_, rank, cols), (_, rows, _) = adapter.A.shape, adapter.B.shape
            pairs.append((tuple(expert_key(index, target, targets, factor) for factor in ("lora_A", "lora_B")),
                          ([experts * rank, cols], [rows, rank * experts]), adapter,
                          model.placement.held(index, layout.ep_rank, experts)))
    try:
        with safe_open(file, framework="pt") as f:
            wanted, held = {key for keys, *_ in pairs for key in keys}, saved_keys(f.keys(), file)
            extra = next((held[key] for key in held if key not in wanted), None)
            if extra is not None:
                raise UserError(f"{file} holds '{extra}', which none of this run's adapters is (lora.targets "
                                f"{cfg.lora.targets}, {model.config.num_hidden_layers} layers)")
            missing = min(wanted - set(held), default=None)
            if missing is not None:
                raise UserError(f"{file} lacks '{missing}', which this run's adapters need")
            for keys, shapes, adapter, held_experts in pairs:  # one adapter at a time, each rank every one
                a, b = (read_tensor(f, file, held[key], shape) for key, shape in zip(keys, shapes))
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    raise UserError(f"{file}: '{keys[0]}' or '{keys[1]}' holds values that are not finite")
                if held_experts is not None:  # this rank's experts of all
                    a, b = (t[held_experts] for t in stacked_expert_tensors(a, b, experts))
                adapter.A.copy_(a)
                adapter.B.copy_(b)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {file}: {first_line(e)}") from None


@torch.no_grad()
def save_adapter(model: torch.nn.Module, out_dir: str | Path, cfg: RunConfig, layout: Layout,
                 tokenizer, run_id: str | None = None) -> Path | None:
    """Write the model's adapters to `out_dir` in PEFT's format, with `tokenizer` (the run's
    `te_mixtral.data.tokenizer.Tokenizer`, read from `cfg.data.tokenizer`; module docstring)
    and the marker naming `run_id`, the run's; the folder on rank 0, None elsewhere. Every rank
    calls it."""
    out_dir = Path(out_dir)
    require_finite_weights(model, layout, f"the adapters {out_dir}")
    config = peft_config(cfg)
    tensors = {}
    for index, layer in enumerate(model.model.layers):
        stem = f"{PREFIX}model.layers.{index}"
        for target, adapter in layer.self_attn.adapters.items():
            tensors[f"{stem}.self_attn.{target}.lora_A.weight"] = adapter.A.detach().cpu()
            tensors[f"{stem}.self_attn.{target}.lora_B.weight"] = adapter.B.detach().cpu()
        for target, adapter in layer.mlp.experts.adapters.items():
            a_E, b_E = (gather_experts(w, layout, w.dtype, model.placement, index) for w in (adapter.A, adapter.B))
            if layout.is_main:
                a, b = peft_expert_tensors(torch.stack(a_E), torch.stack(b_E))
                targets = config["target_parameters"]
                tensors[expert_key(index, target, targets, "lora_A")] = a
                tensors[expert_key(index, target, targets, "lora_B")] = b
    if not layout.is_main:
        return None
    landing = staged_beside(out_dir)
    tmp = sibling(landing, ".tmp")
    try:
        remove_scratch(tmp, "the export")  # left by a run that died while exporting
        make_scratch(tmp)
        write_safetensors(tensors, tmp / "adapter_model.safetensors")
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(tmp, tokenizer, cfg.data.tokenizer)
        # Marks the folder as ours, so that a later export may replace it (training/outputs.py).
        (tmp / EXPORT_MARKER).write_text(export_marker(run_id))
        for path in tmp.iterdir():
            fsync_path(path)
        replace_files(tmp, landing, is_export_file, EXPORT_MARKER)
    except (OSError, SafetensorError) as e:
        raise write_failure(f"the adapter export {out_dir}", e) from None
    return out_dir
