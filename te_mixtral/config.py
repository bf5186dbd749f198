"""One typed configuration for a run, loaded from YAML, overridden from the command line,
validated once.

A YAML file has sections (`model`, `data`, `train`, `lora` (lora_config.py), and `fp8`, tier device_mxfp8's
options: te_mixtral/experts/options.py) and a few top-level keys (`tier`, `ep_size`, ...). Command-line overrides name a key either in full
(`--train.lr 1e-4`) or by its bare name when that name is unique (`--lr 1e-4`); values are
parsed as YAML scalars. Every problem is raised as a `UserError` whose message is one line
a user can act on.

Each field carries its own meaning and role (`setting`, config_field.py: help text, whether it is part of
the timed workload, whether it may change on resume, what other keys it needs to change
anything), so the results pages, the resume check, `--help` and the refusal of a key given
where it changes nothing ask the fields (`workload_keys()`, ...) instead of keeping their own
lists. A key that moves or is renamed gets one line in `saved_config.MOVED_KEYS`: configs
saved by older runs are read through `upgrade_saved`.
"""

import copy
import dataclasses
import functools
import os
import types
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from te_mixtral.config_checks import check_needs, check_paths, validate, value_of
from te_mixtral.config_field import Needs, setting
from te_mixtral.config_yaml import load_yaml
from te_mixtral.errors import UserError, closest
from te_mixtral.experts.options import BASELINES, FP8Options, own_model
from te_mixtral.files import require_regular_file, write_text_atomic
from te_mixtral.local_or_hub import brings_tokenizer, is_hub_dataset
from te_mixtral.lora_config import LORA_ON, LoRAConfig, adopt_adapter
from te_mixtral.saved_config import (
    MOVED_KEYS,
    RETYPED_KEYS,
    SECTION_NAMES,
    flatten,
    is_marked,
    is_saved,
    saved_yaml,
    upgrade_key,
    upgrade_saved,
)

# What the keys that describe the architecture need (config_field.Needs): a checkpoint's
# config.json is its architecture, and replaces them all (training/hf_checkpoint.py).
OWN_MODEL = Needs(("model_path",), lambda path: path is None,
                  "comes from model_path's config.json, which replaces the model section (a checkpoint loads whole, "
                  "every layer): drop it, or drop model_path to build the model the section describes")


@dataclass
class ModelConfig:
    """Mixtral architecture; defaults are Mixtral-8x7B's. With model_path the checkpoint's
    config.json is the architecture, and the keys that describe one are refused beside it."""

    vocab_size: int = setting(32000, needs=OWN_MODEL,
                              help="vocabulary size: rows of the token embedding and of the output layer")
    hidden_size: int = setting(4096, needs=OWN_MODEL, help="model width: the size of every token's hidden state")
    intermediate_size: int = setting(14336, needs=OWN_MODEL, help="hidden size of each expert's SwiGLU FFN")
    num_hidden_layers: int = setting(32, needs=OWN_MODEL, help="decoder layers")
    num_attention_heads: int = setting(32, needs=OWN_MODEL, help="query heads per attention layer")
    num_key_value_heads: int = setting(8, needs=OWN_MODEL,
                                       help="key/value heads per attention layer, shared by groups of query heads")
    head_dim: int = setting(128, needs=OWN_MODEL, help="size of one attention head")
    num_experts: int = setting(8, needs=OWN_MODEL,
                               help="experts per MoE layer, over all ranks (each rank holds 1/ep_size; HF calls this "
                               "num_local_experts)")
    num_experts_per_tok: int = setting(2, needs=OWN_MODEL, help="experts each token is routed to (top-k)")
    rms_norm_eps: float = setting(1e-5, needs=OWN_MODEL, help="epsilon of the RMSNorm layers")
    rope_theta: float = setting(1e6, needs=OWN_MODEL, help="base of the rotary position embedding's frequencies")
    max_position_embeddings: int = setting(32768, needs=OWN_MODEL, help="longest sequence the model is configured for")
    initializer_range: float = setting(0.02, needs=OWN_MODEL,
                                       help="standard deviation of the randomly initialised weights")
    tie_word_embeddings: bool = setting(False, needs=OWN_MODEL,
                                        help="share one matrix between the token embedding and the output layer")
    # Training choices rather than architecture, kept here under transformers' names because
    # an HF config.json carries the first (te_mixtral/model/router_losses.py explains both).
    router_aux_loss_coef: float | None = setting(
        None, help="weight of the load-balancing loss (transformers' Mixtral loss); null: the HF checkpoint's "
        "router_aux_loss_coef when model_path loads one (0.02 for Mixtral), else 0")
    router_z_loss_coef: float = setting(0.0, help="weight of the router z-loss (ST-MoE: mean of logsumexp(router "
                                        "logits)^2); 0: off")

    @property
    def aux_loss_coef(self) -> float:
        """The load-balancing loss's weight as used: null means off. (With model_path, the
        checkpoint's value has replaced null before training: training/hf_checkpoint.py.)"""
        return self.router_aux_loss_coef or 0.0


# What the data keys that read one format's records need (config_field.Needs).
TEXT_FORMAT = Needs(("data.format",), lambda fmt: fmt == "text",
                    "names the field of data.format text; the other formats read conversations: drop it, or use "
                    "data.format text")
CHAT_LAYOUT = Needs(("data.format",), lambda fmt: fmt == "chat",
                    "maps the messages of data.format chat; the other formats read their own layout: drop it, or use "
                    "data.format chat")


@dataclass
class DataConfig:
    """What is read, and how it becomes packed samples of tokens (te_mixtral/data/, docs/data.md)."""

    dataset: str = setting("embedded", path=True, help="'embedded' (text shipped with Python, no network), a local "
                           ".json/.jsonl/.txt file or folder, or a Hugging Face hub data set name")
    subset: str | None = setting(None, needs=Needs(("data.dataset",), is_hub_dataset,
                                                   "names a subset of a hub data set, and data.dataset is not one "
                                                   "(the embedded text and local files have none): drop it"),
                                 help="the hub data set's subset (its config name), e.g. wikitext-2-raw-v1 "
                                 "of wikitext; null: its default")
    split: str = setting("train", help="the split read: a hub data set's (train, test, train[:90%], ...); local files "
                         "and the embedded text are one 'train' split, which may be sliced the same way (train[:90%])")
    format: Literal["text", "chat", "sharegpt", "alpaca"] = setting("text", help="text: each record's text_field is a "
                          "document; chat: each record's messages_field is a conversation, rendered with the "
                          "tokenizer's chat template and trained on the assistant's replies only; sharegpt "
                          "(conversations of {from: human|gpt|system, value}) and alpaca (instruction, input, output): "
                          "chat data in those layouts (docs/data.md)")
    text_field: str = setting("text", needs=TEXT_FORMAT,
                              help="the field of each record that holds the text (format text)")
    messages_field: str = setting("messages", needs=CHAT_LAYOUT,
                                  help="the field of each record that holds the conversation, a list of "
                                  "{role: system|user|assistant, content} (format chat)")
    role_key: str = setting("role", needs=CHAT_LAYOUT,
                            help="format chat: the key of a message that holds its role (e.g. from)")
    content_key: str = setting("content", needs=CHAT_LAYOUT,
                               help="format chat: the key of a message that holds its text (e.g. value)")
    roles: str | None = setting(None, needs=CHAT_LAYOUT, help="format chat: the data's role names as system, user or "
                                "assistant, e.g. human:user,gpt:assistant (null: the data uses those names)")
    tokenizer: str | None = setting(None, path=True, help="a tokenizer.json file or a folder holding one (chat data: a folder "
                                    "whose tokenizer_config.json has a chat_template, e.g. examples/chat-tokenizer); "
                                    "null: model_path's, else a small BPE trained on the data and cached")
    tokenizer_vocab_size: int = setting(2048, needs=Needs(
                                        ("data.tokenizer", "data.format", "model_path"),
                                        lambda tokenizer, fmt, model_path: tokenizer is None and fmt == "text"
                                        and not brings_tokenizer(model_path),
                                        "sizes the BPE trained on text data that brings no tokenizer, and this run "
                                        "reads one (data.tokenizer, or model_path's tokenizer.json): drop it"),
                                        help="vocabulary of the BPE trained on text data when there is no tokenizer "
                                        "(data.tokenizer null, and no tokenizer.json at model_path)")
    seq_len: int = setting(256, help="tokens per packed sample")
    max_documents: int | None = setting(None, help="read only the first N documents (null: all)")
    eval_fraction: float = setting(0.0, help="share of the documents or conversations held out for evaluation "
                                   "(rounded, at least one): a fixed draw that depends on the data alone (not the "
                                   "seed), never trained on; 0: no evaluation")


# What the keys that cut a step's rows otherwise need to change on resume without a note
# (config_field.setting's `resumable`): the same rows meet the same weights (gradients equal to
# rounding), but LoRA's dropout draws its masks over the rows as they are cut, so with it a
# resumed run draws other masks than the run it continues would have, as on another EP layout,
# and the change is noted as the layout's is (training/checkpoint.py).
SAME_DROPOUT_MASKS = Needs(("lora.rank", "lora.dropout"), lambda rank, dropout: rank == 0 or dropout == 0,
                           "cuts the rows LoRA's dropout draws its masks over")


# What the keys of training checkpoints and of master_adamw need (config_field.Needs).
CHECKPOINTS = Needs(("checkpoint_dir",), lambda folder: folder is not None,
                    "needs checkpoint_dir (the folder of the training checkpoints)")
MASTER_ADAMW = Needs(("train.optimizer",), lambda optimizer: optimizer == "master_adamw",
                     "is master_adamw's: it needs train.optimizer master_adamw")


@dataclass
class TrainConfig:
    """The optimisation, and the step schedules of what happens between steps (`*_every`:
    every N steps, and always after the last one)."""

    steps: int = setting(30, help="optimizer steps")
    batch_size: int = setting(4, help="samples per optimizer step, summed over all ranks")
    # Resumable: the same samples and the same summed gradients (to rounding) whatever N is,
    # so a resumed run may trade memory for time; only the step's memory and time change (and
    # LoRA's dropout masks, drawn micro-batch by micro-batch: noted then).
    grad_accum_steps: int = setting(1, resumable=SAME_DROPOUT_MASKS,
                                    help="micro-batches per optimizer step: each forward and backward takes "
                                    "batch_size / (world x grad_accum_steps) samples per rank")
    lr: float = setting(3e-4, help="peak learning rate, reached after warmup_steps")
    min_lr: float = setting(3e-5, help="learning rate at the last step (cosine decay from lr)")
    warmup_steps: int = setting(5, help="steps of linear learning-rate warm-up")
    weight_decay: float = setting(0.1, help="AdamW weight decay of the weight matrices (none on norms)")
    beta1: float = setting(0.9, help="AdamW beta1")
    beta2: float = setting(0.95, help="AdamW beta2")
    grad_clip: float = setting(1.0, help="largest global gradient norm; larger gradients are scaled down")
    seed: int = setting(1234, help="seed of the initial weights and of the order samples are read in")
    dtype: Literal["auto", "fp32", "bf16"] = setting("auto", help="auto (bf16 on CUDA, fp32 on CPU), fp32 or bf16")
    optimizer: Literal["adamw", "master_adamw"] = setting("adamw", help="adamw (fp32 parameters, torch's AdamW: the reference) or master_adamw "
                             "(bf16 parameters, the fp32 master kept exactly as 16-bit remainders; bf16 runs only)")
    moment_dtype: Literal["bf16", "fp32"] = setting(
        "bf16", help="master_adamw's moments: bf16 (10 bytes per parameter in all) or fp32 (14)",
        needs=replace(MASTER_ADAMW, text="is master_adamw's choice: train.optimizer adamw keeps fp32 moments "
                      "anyway; drop it, or use train.optimizer master_adamw"))
    expert_moments: Literal["same", "8bit"] = setting("same", needs=MASTER_ADAMW,
                                                      help="master_adamw's moments of the expert weights: same "
                                                      "(moment_dtype, as the others') or 8bit (block-wise 8-bit, about 2 "
                                                      "bytes for both moments instead of 4 or 8; te_mixtral/optim/moments8.py)")
    recompute: Literal["none", "selective", "full"] = setting(
        "none", needs=own_model("applies to te_mixtral's own model"),
        help="activation recompute: none, selective (the expert FFN runs again in the backward instead of keeping its "
        "hidden rows) or full (each decoder layer keeps only its input and runs again in its backward); "
        "te_mixtral/model/recompute.py")
    recompute_layers: int | None = setting(None, needs=Needs(("train.recompute",),
                                                             lambda recompute: recompute != "none",
                                                             "counts the layers that recompute: it needs "
                                                             "train.recompute selective or full"),
                                           help="with recompute selective or full: how many decoder layers "
                                           "recompute, from the first; the others keep everything, as with none "
                                           "(null: every layer). --estimate-memory names the fewest that fit")
    sharding: Literal["none", "fsdp"] = setting("none", help="none (every rank holds all dense weights, their gradients and optimizer "
                            "state; gradients all-reduced in buckets during backward) or fsdp (FSDP2 shards them over the ranks, "
                            "experts over their replicas; te_mixtral/distributed/parallelize.py)")
    # Resumable: the same summed gradients either way (to rounding); only memory and traffic change.
    fsdp_reduce: Literal["step", "micro_batch"] = setting("step", resumable=True, needs=Needs(
                               ("train.sharding", "train.grad_accum_steps"), lambda sharding, micro_batches:
                               sharding == "fsdp" and micro_batches > 1,
                               "is FSDP's choice, between the micro-batches of a step: it needs train.sharding "
                               "fsdp and train.grad_accum_steps above 1 (unsharded gradients are whole either way, and "
                               "a step of one micro-batch reduces once either way)"),
                               help="with fsdp and grad_accum_steps > 1, when gradients are reduce-scattered: step "
                               "(once, in the last micro-batch; until then FSDP keeps every whole gradient, in fp32) "
                               "or micro_batch (after each micro-batch: N times the traffic, only shards kept)")
    timing_warmup_steps: int = setting(3, help="first steps left out of the timing statistics")
    log_every: int = setting(5, workload=False, help="print the loss every N steps")
    eval_every: int = setting(0, workload=False,
                              needs=Needs(("data.eval_fraction",), lambda fraction: fraction > 0,
                                          "needs held-out data: set data.eval_fraction (e.g. 0.05)"),
                              help="evaluate on the held-out samples every N steps (0: at the end only)")
    save_every: int = setting(0, workload=False, resumable=True,
                              needs=Needs(("save_hf", "save_adapter"),
                                          lambda hf, adapter: hf is not None or adapter is not None,
                                          "needs save_hf or save_adapter (the folder to export to)"),
                              help="also export to save_hf and save_adapter every N steps (0: at the end only)")
    checkpoint_every: int = setting(0, workload=False, resumable=True, needs=CHECKPOINTS,
                                    help="steps between training checkpoints (0: at the end only)")


# The recompute modes, from the most kept to the least (the fit check suggests them in this order).
RECOMPUTE = typing.get_args(TrainConfig.__annotations__["recompute"])


def recomputed_layers(train: TrainConfig, num_layers: int) -> int:
    """How many of the model's decoder layers recompute (the first ones): none without
    recompute, `train.recompute_layers` if set, else all."""
    if train.recompute == "none":
        return 0
    return num_layers if train.recompute_layers is None else train.recompute_layers


# What the keys of the exchange between expert-parallel ranks need (config_field.Needs).
EP_EXCHANGE = Needs(("ep_size",), lambda ep_size: ep_size > 1,
                    "shapes the exchange between expert-parallel ranks: it needs ep_size above 1 (with one, nothing "
                    "is exchanged)")

EP_PLACEMENT = Needs(("ep_size", "tier"), lambda ep_size, tier: ep_size > 1 and tier not in BASELINES,
                     "places te_mixtral's experts on the expert-parallel ranks: it needs ep_size above 1 and one of "
                     f"te_mixtral's tiers ({' and '.join(BASELINES)} run transformers' model, every expert on one rank)")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # A tier's own options, declared beside the tiers (te_mixtral/experts/options.py).
    fp8: FP8Options = field(default_factory=FP8Options)
    # The tier and its layout (tier, ep_size, and the tiers' options) are not the workload:
    # they are what a results page compares.
    tier: str = setting("loop", workload=False, headline=True,
                        help="expert FFN tier (loop, grouped_linear, custom_grouped, device_mxfp8) or a whole-model "
                        "baseline: hf (transformers' Mixtral as its users run it) or hf_eager (its per-expert loop)")
    ep_size: int = setting(1, workload=False, headline=True,
                           help="expert-parallel group size: ranks that split each layer's experts")
    # Not the workload: the same tokens meet the same experts, only the rows' order inside
    # a tier changes (gradients equal to rounding), so a resumed run may change it too (noted
    # with LoRA's dropout, whose masks the chunks cut otherwise).
    ep_chunks: int = setting(1, workload=False, resumable=SAME_DROPOUT_MASKS, needs=EP_EXCHANGE,
                             help="with ep_size > 1: cut each MoE layer's tokens into this many chunks whose "
                             "all-to-alls run under the other chunks' experts, forward and backward "
                             "(te_mixtral/distributed/dispatch.py); 1: no overlap. Off by default: on H200s the "
                             "exchanges do not run under our expert GEMMs, and chunks cost 3-5 percent (docs/parallelism.md)")
    ep_capacity: float = setting(0.0, workload=False, resumable=SAME_DROPOUT_MASKS, needs=EP_EXCHANGE,
                                 help="with ep_size > 1: 0 exchanges each MoE layer's rows exactly, the host waiting "
                                 "for their counts every layer; > 0 sends each rank blocks of this many times its "
                                 "even share of rows, padded, so the host never waits (a step whose routing needs "
                                 "more runs again with more; te_mixtral/distributed/dispatch.py). Tier custom_grouped only")
    # Not the workload: each expert meets the same rows wherever it is held (distributed/placement.py).
    # A resume keeps its checkpoint's placement, which a file given must still make (training/expert_placement.py).
    ep_placement: str | None = setting(None, workload=False, resumable=True, path=True, needs=EP_PLACEMENT,
                                       help="with ep_size > 1: an earlier run's results.json, of the same model and "
                                       "data: each layer's experts are placed on the ranks by the load it recorded, "
                                       "heaviest beside lightest, so each layer's busiest rank has fewer rows to wait "
                                       "for (docs/parallelism.md, 'The busiest rank'); null: rank r holds experts "
                                       "r*E/ep_size onwards, in order")
    backend: Literal["auto", "torch", "te"] = setting(
        "auto", needs=own_model("picks the layers of te_mixtral's own model"),
        help="layer backend: te (Transformer Engine modules), torch, or auto (te on CUDA where it is installed)")
    # Not the workload: the same model and numerics, only how many kernels compute them (their
    # roundings differ), so a resumed run may change it too.
    te_fusions: bool = setting(True, workload=False, resumable=True,
                               needs=Needs(("backend", "device", "tier"), lambda backend, device, tier:
                                           (backend == "te" or (backend == "auto" and device != "cpu"))
                                           and tier not in BASELINES,
                                           "switches the te backend's fusions: it needs backend te (or auto on a "
                                           f"CUDA device) in one of te_mixtral's tiers ({' and '.join(BASELINES)} "
                                           "run transformers' model)"),
                               help="on the te backend: q, k and v by one GEMM, and TE's fused cross-entropy "
                               "(te_mixtral/model/layers.py); false: one module at a time, for A/B timing")
    device: Literal["auto", "cpu", "cuda"] = setting("auto", help="auto (cuda when available), cpu or cuda")
    output_dir: str | None = setting(None, workload=False, resumable=True, path=True,
                                     help="folder for results.json and config.yaml (null: a new runs/<date>-<tier>)")
    loss_check: str | None = setting(None, workload=False, resumable=True, path=True,
                                     help="a reference run's results JSON to check every step's loss against")
    dist_timeout_s: int = setting(300, workload=False, resumable=True,
                                  help="seconds a collective may wait before the job fails")
    report_to: str = setting("none", workload=False, resumable=True,
                             help="experiment trackers that get each step's scalars, as HF Trainer's report_to: "
                             "none, or any of tensorboard (into output_dir), wandb, mlflow, comma-separated "
                             "(each needs its package: pip install 'te_mixtral[wandb]'; "
                             "te_mixtral/measure/trackers.py)")
    plots: bool = setting(True, workload=False, resumable=True,
                          help="draw loss.png and step_time.png beside results.json at the end (needs matplotlib)")
    profile_phases: bool = setting(False, workload=False, needs=own_model("times the phases of te_mixtral's own model"),
                                   help="after training, time each phase of a step on its own "
                                   "(te_mixtral/measure/phases.py)")
    model_path: str | None = setting(None, path=True,
                                     help="a Hugging Face Mixtral checkpoint to fine-tune (local folder or hub id): "
                                     "its config.json replaces the model section (whose keys are refused beside it), "
                                     "and its tokenizer.json is used when data.tokenizer is unset")
    save_hf: str | None = setting(None, workload=False, resumable=True, path=True,
                                  help="export the fine-tuned model to this folder as an HF checkpoint")
    save_adapter: str | None = setting(None, workload=False, resumable=True, path=True,
                                       needs=replace(LORA_ON, text="exports LoRA adapters: set lora.rank (e.g. 16)"),
                                       help="with lora: export the adapters to this folder in PEFT's format "
                                       "(adapter_config.json + adapter_model.safetensors, the run's tokenizer beside them; peft loads them onto "
                                       "transformers' Mixtral); save_hf exports the model with them merged")
    checkpoint_dir: str | None = setting(None, workload=False, resumable=True, path=True,
                                         help="folder of training checkpoints, for resume on any layout")
    checkpoint_keep: int = setting(2, workload=False, resumable=True, needs=CHECKPOINTS,
                                   help="newest checkpoints kept; older ones are deleted")
    resume: bool = setting(False, resumable=True, needs=CHECKPOINTS,
                           help="continue from the latest checkpoint in checkpoint_dir")
    overwrite: bool = setting(False, workload=False, resumable=True,
                              help="let this run replace the files it writes in output_dir (results.json, config.yaml, "
                              "...; never its own --config), the checkpoints in checkpoint_dir (without resume), and "
                              "at save_hf and save_adapter another run's export, or export-named files no export wrote "
                              "(other files are kept)")
    generate: str | None = setting(None, workload=False, resumable=True,
                                   help="after training, print a greedy continuation of this prompt")
    generate_tokens: int = setting(32, workload=False, resumable=True, help="tokens the continuation adds",
                                   needs=Needs(("generate",), lambda prompt: prompt is not None,
                                               "is the length of generate's continuation: set generate (the prompt)"))
    gpu: str | None = setting(None, workload=False, resumable=True,
                              help="memory a rank may use, checked before anything is built: a GPU name (h100, h200, "
                              "b200, a100-80gb, l40s, rtx4090) or a size (80GiB, 141GB); null: the device's own "
                              "(te_mixtral/planning/memory.py)")

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


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "lora": LoRAConfig, "fp8": FP8Options}
assert tuple(SECTIONS) == SECTION_NAMES

@functools.cache  # asked for each key read; typing.get_type_hints evaluates every annotation anew
def _field_types(cls) -> dict[str, object]:
    """Each key's type as a value is read: a `Literal` key's is its values' type (str); which
    of them it takes is `config_checks.validate`'s to check, once the whole config is read.
    One dict per class, shared: read it, never change it."""
    hints = typing.get_type_hints(cls)
    return {f.name: _value_type(hints[f.name]) for f in dataclasses.fields(cls) if f.name not in SECTIONS}


def _value_type(hint):
    return type(typing.get_args(hint)[0]) if typing.get_origin(hint) is Literal else hint


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
        raise UserError(f"unknown config key '{key}'{did_you_mean(key)}")
    setattr(target, name, _coerce(key, value, types_[name]))


def settings() -> dict[str, dataclasses.Field]:
    """Every config key in full (`train.lr`, `tier`), in the order `to_dict` writes them,
    with its field (`field.default`, and `field.metadata` as `setting` made it)."""
    keys = {}
    for f in dataclasses.fields(RunConfig):
        if f.name in SECTIONS:
            keys.update({f"{f.name}.{g.name}": g for g in dataclasses.fields(SECTIONS[f.name])})
        else:
            keys[f.name] = f
    return keys


def workload_keys() -> frozenset[str]:
    """The keys that change what a timed step computes (see `setting`)."""
    return frozenset(key for key, f in settings().items() if f.metadata["workload"])


def resumable_keys(flat: dict | None = None) -> frozenset[str]:
    """The keys that may change on `--resume` without a note (see `setting`): those that always
    may, and with `flat` (the resumed run's config, flattened: full key -> value) those that
    may in it (`resumable` a `Needs` that holds there)."""
    def resumable(f: dataclasses.Field) -> bool:
        role = f.metadata["resumable"]
        return role.hold_in(flat.__getitem__) if isinstance(role, Needs) and flat is not None else role is True
    return frozenset(key for key, f in settings().items() if resumable(f))


def changes_nothing(key: str, flat: dict) -> bool:
    """Whether `key` changes nothing in the config `flat` (full key -> value: a saved config,
    flattened; a key it lacks at its default), because what it needs (`setting(needs=...)`)
    does not hold there: a model section's key beside model_path, LoRA's alpha without a rank."""
    fields = settings()
    needs = fields[key].metadata["needs"]
    return needs is not None and not needs.hold_in(lambda k: flat.get(k, fields[k].default))


def headline_keys() -> tuple[str, ...]:
    """The keys a reproduce command always names, in config order (see `setting`)."""
    return tuple(key for key, f in settings().items() if f.metadata["headline"])


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
    return load_yaml(text, f"--{key}")


# Far above any real config (about a hundred values), far below what takes long to read.
MAX_CONFIG_BYTES = 1 << 20
# The configs that ship beside the package (a checkout's, or an editable install's).
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _config_meant(path: str) -> str:
    """' (did you mean configs/tiny.yaml?)' for the config file whose name is closest to a
    missing `path`'s: one beside where it points, or one that ships; '' where none is close."""
    files = [file for folder in (Path(path).expanduser().parent, SHIPPED_CONFIGS) if folder.is_dir()
             for file in sorted(folder.glob("*.y*ml"))]
    by_stem = {}
    for file in files:  # beside the path first: a shipped file of the same name comes second
        by_stem.setdefault(file.stem, file)
    # Names compared without their suffix, which every candidate shares: '.yaml' alone made
    # 'missing.yaml' close to 'tiny.yaml'.
    close = closest(Path(path).stem, by_stem)
    if close is None:
        return ""
    shown = Path(os.path.relpath(by_stem[close])) if by_stem[close].is_relative_to(Path.cwd()) else by_stem[close]
    return f" (did you mean {shown}?)"


def is_switch(bare: str) -> bool:
    """Whether a command-line key is a true/false switch, so `--resume` alone means true."""
    if bare.replace("-", "_") in RETYPED_KEYS:
        return True
    try:
        return _key_types(_full_key(bare.replace("-", "_"))) == (bool,)
    except UserError:
        return False


def _full_key(bare: str) -> str:
    """Resolve a bare override name (`lr`) to its full key (`train.lr`); a key's old name
    (`saved_config.MOVED_KEYS`) to today's, so that older command lines still run."""
    bare = MOVED_KEYS.get(bare, bare)
    if "." in bare or bare in _field_types(RunConfig):
        return bare
    owners = [s for s, cls in SECTIONS.items() if bare in _field_types(cls)]
    if len(owners) == 1:
        return f"{owners[0]}.{bare}"
    if owners:
        raise UserError(f"'{bare}' is ambiguous: write one of {', '.join(f'{s}.{bare}' for s in owners)}")
    raise UserError(f"unknown config key '{bare}'{did_you_mean(bare)}")


def did_you_mean(key: str) -> str:
    """' (did you mean --train.steps?)' for the key closest to a mistyped `key` (`stpes`,
    `lora_rank`), as the command line writes it; '' when none is close."""
    full = list(settings())
    bare = [k.rpartition(".")[2] for k in full]
    names = full + [name for name in bare if bare.count(name) == 1] + ["model"]  # `--model`: model_path
    close = closest(key.replace("-", "_"), names, cutoff=0.75)
    return f" (did you mean --{close}?)" if close else ""


@dataclass(frozen=True)
class Follows:
    """A key whose default follows another key's value (`source`) until the config file or
    the command line sets it, so that `--lr 1e-4` or `--steps 3` alone just work."""

    source: str
    rule: str  # as `--help` shows the default (one word: the listing is split on spaces)
    value: typing.Callable[[object], object]  # of the source's value


FOLLOWS = {
    # 12 significant digits: 3e-3 / 10 is 0.00030000000000000003, and a saved config should
    # read 0.0003, as a config file would write it (results pages compare runs by value).
    "train.min_lr": Follows("train.lr", "lr/10", lambda lr: float(f"{lr / 10:.12g}")),
    # At least one timed step: the timing statistics need one.
    "train.timing_warmup_steps": Follows("train.steps", "min(3,steps-1)", lambda steps: min(3, steps - 1)),
}


def _adopt_launcher(cfg: RunConfig, given: set[str], launch: dict[str, tuple[object, str]]) -> None:
    """Take the settings a launcher asked for (key -> (value, the launcher's flag that asked));
    a key the config or the command line also sets, to another value, is refused."""
    for key, (value, origin) in launch.items():
        current = value_of(cfg, key)
        if key in given and current not in (value, "auto"):
            raise UserError(f"{origin} asks for {key} {value}, but the config or command line sets {key} {current}: "
                            "drop one of the two")
        _apply(cfg, key, value)
        given.add(key)


def _expand_home(cfg: RunConfig) -> None:
    """A leading `~` in every path key (`setting(path=True)`) as the user's home: the shell
    expands it on the command line, not in a config file, where transformers would read `~/m`
    as a hub id and the run would write into a folder named `~`. Here, once, so that
    everything after reads the paths as they are."""
    for key, f in settings().items():
        value = value_of(cfg, key)
        if f.metadata["path"] and isinstance(value, str) and value.startswith("~"):
            _apply(cfg, key, os.path.expanduser(value))


def load_config(path: str | None = None, overrides: dict[str, str] | None = None, world_size: int = 1,
                launch: dict[str, tuple[object, str]] | None = None) -> RunConfig:
    """Defaults, then the YAML file, then the overrides (raw strings parsed as YAML), then what
    the launcher asked for (`launch`: te_mixtral/accelerate_launch.py), validated. A key in
    `FOLLOWS` that none of them set takes its value from the key it follows; a path key's `~`
    is the user's home (`_expand_home`); lora.init's adapter gives the LoRA settings none of
    them set (`lora_config.adopt_adapter`)."""
    cfg = RunConfig()
    given = set()  # the keys the file, the command line or the launcher set
    saved = edited = False  # whether the file is a config a run saved (check_needs), or one edited since
    if path is not None:
        require_regular_file(Path(path), "config")
        try:
            if Path(path).stat().st_size > MAX_CONFIG_BYTES:
                raise UserError(f"config {path} is {Path(path).stat().st_size} bytes, not a config (those are a few "
                                f"kB; at most {MAX_CONFIG_BYTES})")
            text = Path(path).read_text()
        except OSError as e:
            meant = _config_meant(path) if not Path(path).expanduser().exists() else ""
            raise UserError(f"cannot read config {path}: {e.strerror}{meant}") from None
        except UnicodeDecodeError:
            raise UserError(f"config {path} is not a text file: a config is YAML text (UTF-8)") from None
        raw = load_yaml(text, f"config {path}") or {}
        if not isinstance(raw, dict):
            raise UserError(f"config {path} must be a mapping of keys")
        for key, value in raw.items():  # no key but a section's holds a mapping: a section's name mistyped
            if isinstance(value, dict) and key not in SECTION_NAMES:
                close = closest(key, SECTION_NAMES)
                hint = f"did you mean {close}? " if close else ""
                raise UserError(f"unknown config section '{key}' in {path} ({hint}sections: {', '.join(SECTION_NAMES)})")
        for key, value in flatten(upgrade_saved(raw, path)).items():
            _apply(cfg, key, value)
            given.add(key)
        saved = is_saved(Path(path), text, raw)
        edited = not saved and is_marked(text)
    file_cfg = copy.deepcopy(cfg)  # what the file alone sets (check_needs: the command line overrides it)
    typed = set()  # the keys the command line sets
    for bare, text in (overrides or {}).items():
        bare = bare.replace("-", "_")
        if bare in RETYPED_KEYS:  # an older key: its value as today's key takes it
            key, value = upgrade_key(bare, load_yaml(text, f"--{bare}"))
        else:
            key = _full_key(bare)
            value = _parse_override(key, text)
        _apply(cfg, key, value)
        typed.add(key)
    given |= typed
    _adopt_launcher(cfg, given, launch or {})
    for key, follows in FOLLOWS.items():
        if key not in given:
            _apply(cfg, key, follows.value(value_of(cfg, follows.source)))
    _expand_home(cfg)
    check_paths(cfg)  # before lora.init's folder is read: an empty path would read the current one
    adopt_adapter(cfg, given)  # lora.init's settings, where none are given
    validate(cfg, world_size)
    try:
        check_needs(cfg, given, file_cfg, frozenset(typed), saved)
    except UserError as e:
        if edited:  # a key the user never set may be refused: say why the run's own config is
            raise UserError(f"{e} (config {path} was edited since its run saved it, so it is checked as one "
                            f"written by hand)") from None
        raise
    return cfg


def load_run_config(path: str | None = None, overrides: dict[str, str] | None = None, world_size: int = 1,
                    launch: dict[str, tuple[object, str]] | None = None) -> RunConfig:
    """The config a run takes: `load_config`'s, then the tier's name, its options and what it
    needs of the launch (`world_size` processes) checked by the registry
    (`experts.registry.check_tier`). The command line and the tests read a run's config here."""
    cfg = load_config(path, overrides, world_size, launch)
    # Only now torch (the tiers import it): the config's own errors come first, and fast.
    from te_mixtral.experts.registry import check_tier

    check_tier(cfg, world_size)
    return cfg


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: RunConfig, path: Path) -> None:
    """Write the run's whole config to `path` (its config.yaml), marked as saved (`saved_config.is_saved`)."""
    write_text_atomic(path, saved_yaml(to_dict(cfg)))
