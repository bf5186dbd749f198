"""Hugging Face Mixtral checkpoints in and out of te_mixtral's parameter layout.

In: `--model PATH_OR_HUB_ID` names a local checkpoint folder or a hub id (downloaded to the
hub cache). Its config.json replaces the YAML `model` section, and its tokenizer.json is
used when `data.tokenizer` is unset. Two expert layouts exist on disk, and both load:
- per expert (the published Mixtral checkpoints, and what transformers still writes):
  `model.layers.N.block_sparse_moe.experts.E.w1.weight` (gate, [F, D]), `w3` (up, [F, D]),
  `w2` (down, [D, F]), router `block_sparse_moe.gate.weight`;
- stacked (transformers v5 in memory): `model.layers.N.mlp.experts.gate_up_proj` [E, 2F, D]
  and `down_proj` [E, D, F], router `mlp.gate.weight`.
Our names are the stacked ones, so the dense weights load by name.

Each rank streams from the safetensors files only the tensors it keeps: the dense weights
and its own experts (a slice of a stacked tensor is read as a slice), never the whole model.
safetensors memory-maps the files, so what a rank touches is what it reads. A checkpoint is
input like any other: each tensor's shape is checked against the parameter (or the slice a
rank keeps) before it is read, and a bad index, file or tensor is refused in one line.

Out: `save_hf_checkpoint` writes the per-expert layout above (what transformers'
`save_pretrained` writes and every Mixtral tool reads), one safetensors file per decoder
layer plus one for the embeddings and head, with the sharded index. The experts of a layer
are gathered to rank 0 one expert at a time and written before the next layer is gathered,
so rank 0 holds at most its own shard plus one layer's experts, never the model twice. The
files are written into a temporary folder and moved into place when complete, replacing
only the files of an earlier export (`files.replace_files`: a model card or evaluation
results beside it stay); weights that are not finite are refused before anything is
written, and so is an export whose written values are not (a LoRA merge or the cast to the
export's dtype can overflow), before it replaces anything. Sharded by FSDP (`train.sharding: fsdp`), every rank first gathers each tensor
whole (`DTensor.full_tensor`), one at a time, so the export holds the same bits as an
unsharded run's.
"""

import dataclasses
import hashlib
import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from te_mixtral.config import ModelConfig, RunConfig
from te_mixtral.config_checks import validate, validate_model
from te_mixtral.distributed.layout import Layout, is_expert_param
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.errors import Diverged, UserError, first_line
from te_mixtral.experts.registry import check_tier_model
from te_mixtral.files import (
    folder_bytes,
    fsync_path,
    make_scratch,
    remove_scratch,
    replace_files,
    require_free_space,
    require_writable,
    sibling,
    staged_beside,
    write_failure,
)
from te_mixtral.model.hf_config import hf_config, longest_sequence, model_config_from_hf
from te_mixtral.model.lora import base_weights, is_adapter_param, lora_adapters, merged, weight_tensor
from te_mixtral.training.checkpoint import require_finite, require_finite_weights
from te_mixtral.training.outputs import CHAT_TEMPLATES_DIR, EXPORT_MARKER, export_marker, is_export_file

_PER_EXPERT = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")


def adopt_checkpoint(cfg: RunConfig, model_dir: Path, world_size: int) -> RunConfig:
    """`cfg` with the checkpoint's model config, and its tokenizer when `data.tokenizer` is
    unset, validated again (the checkpoint's model must still fit the EP layout and the tier).

    The router's loss weights are training choices, not architecture: a weight the config
    sets wins; an unset `router_aux_loss_coef` takes the checkpoint's (0.02 for Mixtral: a
    fine-tune keeps balancing the router as it was trained to be)."""
    tokenizer = cfg.data.tokenizer
    if tokenizer is None and (model_dir / "tokenizer.json").is_file():
        tokenizer = str(model_dir)
    model = model_config_from_hf(model_dir, longest_sequence(cfg))
    model = dataclasses.replace(model, router_z_loss_coef=cfg.model.router_z_loss_coef,
                                router_aux_loss_coef=(model.router_aux_loss_coef if cfg.model.router_aux_loss_coef
                                                      is None else cfg.model.router_aux_loss_coef))
    adopted = dataclasses.replace(cfg, model=model,
                                  data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    validate(adopted, world_size)
    validate_model(adopted)
    check_tier_model(adopted)
    return adopted


def _safetensors_files(checkpoint_dir: Path) -> list[Path]:
    """The weight files: model.safetensors alone where there is one (transformers reads it
    before an index, so the run fine-tunes the weights the folder gives everyone else), else
    those the sharded index names, else every .safetensors file.

    An index is input like any other: it must be a mapping of tensor names to plain file
    names in its own folder (a name such as `../x.safetensors` would read outside it), and
    every file it names must exist.
    """
    if (checkpoint_dir / "model.safetensors").is_file():
        return [checkpoint_dir / "model.safetensors"]
    index = checkpoint_dir / "model.safetensors.index.json"
    if not index.exists():
        files = sorted(checkpoint_dir.glob("*.safetensors"))
        if not files:
            raise UserError(f"no .safetensors files in {checkpoint_dir}")
        return files
    try:
        raw = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {index}: {first_line(e)}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise UserError(f"{index} has no 'weight_map' of tensor names to file names")
    files = []
    for name in sorted(set(weight_map.values())):
        # Compared by name, not resolved: a hub snapshot's files are links into its blob store.
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise UserError(f"{index} names '{name}', which is not a file in {checkpoint_dir}")
        if not (checkpoint_dir / name).is_file():
            raise UserError(f"{index} names {name}, which is missing from {checkpoint_dir}")
        files.append(checkpoint_dir / name)
    return files


# A float of any width converts to the run's dtype; anything else (integers, packed 8-bit
# weights without their scales) is not weights this model can read.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def read_tensor(f, file: Path, key: str, expected: list[int], rows: slice | None = None) -> torch.Tensor:
    """Tensor `key` of the open file `f` (only `rows` of its first dimension when given),
    after checking that its whole shape is `expected`. `copy_` would broadcast a wrong shape
    (a one-element norm weight fills every row), so the check is here, before any read."""
    view = f.get_slice(key)
    if (shape := list(view.get_shape())) != list(expected):
        raise UserError(f"{file}: tensor '{key}' has shape {shape}, the model needs {list(expected)}")
    if view.get_dtype() not in _FLOAT_DTYPES:
        raise UserError(f"{file}: tensor '{key}' holds {view.get_dtype()}, not floating-point weights")
    return view[rows] if rows is not None else f.get_tensor(key)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, checkpoint_dir: str | Path, layout: Layout) -> int:
    """Copy a Hugging Face Mixtral checkpoint into `model`, this rank's experts only; return
    the number of bytes of tensor data read. Every tensor's shape is checked against the
    parameter it fills, and a tensor found twice is refused (which copy would win?)."""
    checkpoint_dir = Path(checkpoint_dir)
    params = base_weights(model)
    num_experts = model.config.num_experts
    # Each layer's experts this rank holds, by id: their local index (distributed/placement.py).
    local_of = [{expert: local for local, expert in enumerate(model.placement.held(layer, layout.ep_rank, num_experts))}
                for layer in range(model.config.num_hidden_layers)]
    ffn = model.config.intermediate_size
    loaded = set()
    seen: dict[str, Path] = {}
    bytes_read = 0
    for file in _safetensors_files(checkpoint_dir):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in seen:
                        raise UserError(f"tensor '{key}' is in both {seen[key]} and {file}")
                    seen[key] = file
                    per_expert = _PER_EXPERT.fullmatch(key)
                    if per_expert:
                        prefix, expert, part = per_expert.groups()
                        if not 0 <= int(expert) < num_experts:
                            raise UserError(f"{file}: tensor '{key}' names expert {expert}, but the config has "
                                            f"{num_experts} experts")
                        name, rows = {"w1": (f"{prefix}.mlp.experts.gate_up_proj", slice(0, ffn)),
                                      "w3": (f"{prefix}.mlp.experts.gate_up_proj", slice(ffn, 2 * ffn)),
                                      "w2": (f"{prefix}.mlp.experts.down_proj", slice(None))}[part]
                        if name not in params:
                            raise UserError(f"{file}: tensor '{key}' has no place in a Mixtral model of "
                                            f"{model.config.num_hidden_layers} layers")
                        local = local_of[int(prefix.rsplit(".", 1)[1])].get(int(expert))
                        if local is None:  # another rank's
                            continue
                        target = params[name][local, rows]
                        tensor = read_tensor(f, file, key, target.shape)
                        target.copy_(tensor)
                        bytes_read += tensor.nbytes
                        loaded.add((name, local, part))
                        continue
                    name = key.replace(".block_sparse_moe.", ".mlp.")
                    if name not in params:
                        raise UserError(f"{file}: tensor '{key}' has no place in a Mixtral model")
                    if is_expert_param(name):  # stacked: read only this rank's experts, one by one
                        layer = local_of[int(name.split(".")[2])]
                        for expert, local in layer.items():
                            tensor = read_tensor(f, file, key, [num_experts, *params[name].shape[1:]],
                                                 slice(expert, expert + 1))
                            params[name][local:local + 1].copy_(tensor)
                            bytes_read += tensor.nbytes
                        loaded.update((name, local, "stacked") for local in layer.values())
                        continue
                    tensor = read_tensor(f, file, key, params[name].shape)
                    loaded.add(name)
                    params[name].copy_(tensor)
                    bytes_read += tensor.nbytes
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {file}: {first_line(e)}") from None
    _check_complete(params, loaded, seen, num_experts, model.config.tie_word_embeddings)
    return bytes_read


def base_sha256(checkpoint_dir: Path) -> str:
    """SHA-256 of a Hugging Face checkpoint's weights outside the experts (embeddings,
    attention, norms, routers, head), each by its name, dtype, shape and bytes, however the
    files lay them out: what a LoRA checkpoint records of the frozen base its adapters were
    trained over, so that a resume over other weights in the same folder is refused
    (training/resume_checks.py). The experts, most of the bytes, are left out, as each rank
    reads its own alone: another model differs outside them too."""
    lines = []
    for file in _safetensors_files(checkpoint_dir):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if _PER_EXPERT.fullmatch(key) or is_expert_param(key.replace(".block_sparse_moe.", ".mlp.")):
                        continue
                    tensor = f.get_tensor(key).contiguous()
                    digest = hashlib.sha256(tensor.view(torch.uint8).numpy()).hexdigest()
                    lines.append(f"{key} {tensor.dtype} {list(tensor.shape)} {digest}")
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {file}: {first_line(e)}") from None
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()


def _check_complete(params, loaded, keys, num_experts, tied) -> None:
    """Refuse a checkpoint that lacks a tensor the model needs, naming it: a parameter nothing
    was copied into keeps whatever memory it was built on. Experts are checked for all of
    them, not only this rank's, against the checkpoint's tensor names (`keys`), so that every
    rank refuses alike; the per-expert layout's name is given where the layer is stored that way."""
    for name in params:
        if is_expert_param(name):
            if (name, 0, "stacked") in loaded:  # read whole, every local expert at once
                continue
            prefix, stack = name.rsplit(".mlp.experts.", 1)
            stem = f"{prefix}.block_sparse_moe.experts"
            per_expert = [f"{stem}.{e}.{w}.weight" for e in range(num_experts)
                          for w in (("w1", "w3") if stack == "gate_up_proj" else ("w2",))]
            missing = [key for key in per_expert if key not in keys]
            if missing:
                raise UserError(f"the checkpoint has no weights for "
                                f"'{missing[0] if len(missing) < len(per_expert) else name}'")
        elif not (name in loaded or (tied and name == "lm_head.weight")):
            raise UserError(f"the checkpoint has no weights for '{name}'")


# --- out --------------------------------------------------------------------------------


def gather_experts(stacked_L: torch.Tensor, layout: Layout, dtype: torch.dtype, placement: ExpertPlacement,
                   layer: int) -> list[torch.Tensor] | None:
    """Every expert of one stacked parameter of `layer`, on rank 0's CPU by expert id (the
    ranks hold them as `placement` places them); None elsewhere.

    One gather per local expert index: rank r sends its expert `i`, which is slot r * L + i,
    so the transient buffer is EP experts, not the layer's whole tensor.
    """
    num_local = stacked_L.shape[0]
    experts = [None] * (num_local * layout.ep_size)
    for local in range(num_local):
        piece = stacked_L[local].detach().contiguous()
        if layout.ep_size == 1:
            pieces = [piece]
        else:
            pieces = [torch.empty_like(piece) for _ in range(layout.ep_size)] if layout.is_main else None
            dist.gather(piece, pieces, dst=0, group=layout.ep_group)
        if layout.is_main:
            for ep_rank, tensor in enumerate(pieces):
                # A copy even when nothing changes: views of one parameter share memory,
                # which safetensors refuses to save.
                experts[ep_rank * num_local + local] = tensor.to("cpu", dtype, copy=True)
    return placement.in_expert_order(layer, experts) if layout.is_main else None


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`tensors` in a safetensors file at `path`, as transformers and PEFT read them, on disk
    when this returns and readable by others (safetensors makes its files owner-only; exports
    are meant to be shared)."""
    save_file({name: t.contiguous() for name, t in tensors.items()}, path, metadata={"format": "pt"})
    path.chmod(0o644)
    fsync_path(path)


class _ShardWriter:
    """Writes numbered safetensors files and the index that maps each tensor to its file."""

    def __init__(self, folder: Path, num_files: int):
        self.folder, self.num_files = folder, num_files
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self.written = 0
        self.finite = True  # every value written so far

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        self.written += 1
        self.finite = self.finite and all(bool(torch.isfinite(t).all()) for t in tensors.values())
        name = f"model-{self.written:05d}-of-{self.num_files:05d}.safetensors"
        write_safetensors(tensors, self.folder / name)
        self.weight_map.update(dict.fromkeys(tensors, name))
        self.total_bytes += sum(t.nbytes for t in tensors.values())

    def write_index(self) -> None:
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _hf_config_json(m: ModelConfig, dtype: torch.dtype, tokenizer, model_source: Path | None) -> str:
    """The source checkpoint's config.json when there is one (it keeps fields we do not model,
    such as the special token ids), else one made from our config; the dtype is the export's."""
    dtype_name = str(dtype).removeprefix("torch.")
    if model_source is not None:
        raw = json.loads((model_source / "config.json").read_text())
        raw.update(dtype=dtype_name)
        raw.pop("torch_dtype", None)
        return json.dumps(raw, indent=2)
    cfg = hf_config(m)
    cfg.architectures = ["MixtralForCausalLM"]
    cfg.dtype = dtype_name
    cfg.eos_token_id = tokenizer.eos_id
    cfg.bos_token_id = tokenizer.backend.token_to_id("<s>")
    return cfg.to_json_string()


def write_tokenizer(folder: Path, tokenizer, tokenizer_path: str | None) -> None:
    """tokenizer.json, and the files beside the tokenizer's source file that `AutoTokenizer`
    reads with it, each one there is; a minimal tokenizer_config.json where it has none. Both
    exports write it: the model and the adapters learnt its token ids and chat template.

    Not the source's added_tokens.json: tokenizer.json already holds every token the run's
    tokenizer has (a chat run's AutoTokenizer added that file's tokens to it), and a text run,
    which reads tokenizer.json alone, never had them (training/outputs.py refuses the file
    beside an export, where transformers would add its tokens)."""
    (folder / "tokenizer.json").write_text(tokenizer.backend.to_str())
    # chat_template.jinja: where transformers v5 saves a chat template, which chat fine-tunes
    # need again; transformers reads it with or without a tokenizer_config.json.
    companions = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    tokenizer_source = Path(tokenizer_path) if tokenizer_path else None
    if tokenizer_source is not None and tokenizer_source.is_file():
        tokenizer_source = tokenizer_source.parent
    if tokenizer_source is not None:
        for name in companions:
            if (tokenizer_source / name).is_file():
                shutil.copyfile(tokenizer_source / name, folder / name)
        # The named templates (tool use, ...), which transformers reads from this folder alone.
        for template in sorted((tokenizer_source / CHAT_TEMPLATES_DIR).glob("*.jinja")):
            (folder / CHAT_TEMPLATES_DIR).mkdir(exist_ok=True)
            shutil.copyfile(template, folder / CHAT_TEMPLATES_DIR / template.name)
    if (folder / "tokenizer_config.json").is_file():
        return
    eos = tokenizer.backend.id_to_token(tokenizer.eos_id)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, indent=2))


@torch.no_grad()
def save_hf_checkpoint(model: torch.nn.Module, out_dir: str | Path, layout: Layout, dtype: torch.dtype, tokenizer,
                       model_source: Path | None = None, tokenizer_path: str | None = None,
                       run_id: str | None = None) -> Path | None:
    """Write `model` to `out_dir` as a Hugging Face Mixtral checkpoint (see the module
    docstring); return the folder on rank 0, None elsewhere.

    Every rank must call this (all check the weights are finite); the first replica's EP
    group sends its experts, the other replicas hold copies of the same weights and return
    once the check is done (sharded, they stay to gather each tensor whole). `tokenizer` is a
    `te_mixtral.data.tokenizer.Tokenizer`; `model_source` is the checkpoint folder the weights came
    from and `tokenizer_path` the tokenizer's (`data.tokenizer`): their config files are
    carried over. `run_id` is the run's, written into the export's marker (training/outputs.py).
    """
    out_dir = Path(out_dir)
    require_finite_weights(model, layout, f"the Hugging Face export {out_dir}")
    # The `hf` tier wraps transformers' model, whose v5 in-memory names are ours under `hf.`.
    params = {name.removeprefix("hf."): p for name, p in base_weights(model).items()}
    sharded = any(isinstance(p, DTensor) for p in params.values())
    sends = layout.rank < layout.ep_size  # the first replica's EP group
    device = next(model.parameters()).device
    # Finite weights can still make an infinite export: a LoRA weight merged with its adapter
    # (B @ A overflows), or an fp32 value past bf16's largest. So rank 0 checks what it
    # writes, and every rank learns the verdict (`require_finite`) before the export is published.
    what, whose = (f"the Hugging Face export {out_dir}",
                   "the values it would hold (the weights merged with any LoRA adapters, in its dtype)")
    if not (sends or sharded):
        require_finite(False, layout, device, what, whose)
        return None
    m = model.config
    landing = staged_beside(out_dir)
    tmp = sibling(landing, ".tmp")
    writer = None
    if layout.is_main:
        try:
            remove_scratch(tmp, "the export")  # left by a run that died while exporting
            make_scratch(tmp)
        except OSError as e:
            raise write_failure(f"{tmp} for the Hugging Face export", e) from None
        writer = _ShardWriter(tmp, m.num_hidden_layers + 1)

    def cpu(tensor):
        return tensor.detach().to("cpu", dtype).contiguous()

    adapters = lora_adapters(model)

    def whole(name):  # sharded: a collective, which every rank runs for every tensor in one order
        p = weight_tensor(params[name])
        p = p.full_tensor() if isinstance(p, DTensor) else p
        # LoRA: the weight with its adapter merged in, one tensor at a time.
        return merged(p, adapters[name].A, adapters[name].B, adapters[name].scale) if name in adapters else p

    try:
        # named_parameters lists a tied head once, under the embedding: HF re-ties it on load.
        tensors = {name: whole(name) for name in ("model.embed_tokens.weight", "model.norm.weight",
                                                  "lm_head.weight") if name in params}
        if writer:
            writer.write({name: cpu(t) for name, t in tensors.items()})
        for index in range(m.num_hidden_layers):
            prefix = f"model.layers.{index}"
            stacks = [whole(f"{prefix}.mlp.experts.{part}") for part in ("gate_up_proj", "down_proj")]
            dense = {name: whole(name) for name in params if name.startswith(prefix + ".") and not is_expert_param(name)
                     and not is_adapter_param(name)}
            if not sends:
                continue
            gate_up, down = (gather_experts(stack, layout, dtype, model.placement, index) for stack in stacks)
            if not writer:
                continue
            tensors = {name.replace(".mlp.", ".block_sparse_moe."): cpu(t) for name, t in dense.items()}
            ffn = m.intermediate_size
            for expert in range(len(gate_up)):
                stem = f"{prefix}.block_sparse_moe.experts.{expert}"
                # Halves of one tensor share memory, which safetensors refuses: copy them, and
                # drop the whole so that a layer's experts are held once, not twice.
                gate_up_2FD, gate_up[expert] = gate_up[expert], None
                tensors[f"{stem}.w1.weight"] = gate_up_2FD[:ffn].clone()
                tensors[f"{stem}.w3.weight"] = gate_up_2FD[ffn:].clone()
                tensors[f"{stem}.w2.weight"] = down[expert]
            writer.write(tensors)
        try:
            require_finite(writer is not None and not writer.finite, layout, device, what, whose)
        except Diverged:
            if writer:
                remove_scratch(tmp, "the export")
            raise
        if writer:
            writer.write_index()
            (tmp / "config.json").write_text(_hf_config_json(m, dtype, tokenizer, model_source))
            if model_source is not None and (model_source / "generation_config.json").is_file():
                shutil.copyfile(model_source / "generation_config.json", tmp / "generation_config.json")
            write_tokenizer(tmp, tokenizer, tokenizer_path)
            # Marks the folder as ours, so that a later export may replace it (training/outputs.py).
            (tmp / EXPORT_MARKER).write_text(export_marker(run_id))
            for path in tmp.rglob("*"):
                fsync_path(path)
            replace_files(tmp, landing, is_export_file, EXPORT_MARKER)
    except (OSError, SafetensorError) as e:  # safetensors raises its own error on a full disk
        raise write_failure(f"the Hugging Face export {out_dir}", e) from None
    return out_dir if writer else None


def check_export_space(model: torch.nn.Module, out_dir: str | Path, layout: Layout, dtype: torch.dtype) -> None:
    """On rank 0, before training: refuse an export folder that cannot be created or hold
    the model (all experts, in the export dtype). An earlier export stays until the new one
    is complete, so it takes space; `DIR.tmp`, left by an export that died, is deleted first."""
    if not layout.is_main:
        return
    out_dir = staged_beside(Path(out_dir))
    require_writable(out_dir.parent, "save_hf's parent folder")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = sum(p.numel() * (layout.ep_size if is_expert_param(name) else 1) for name, p in base_weights(model).items()
                if not is_adapter_param(name))
    require_free_space(out_dir.parent, numel * itemsize, "the Hugging Face export",
                       folder_bytes(sibling(out_dir, ".tmp")))
