"""Megatron-Core's GPT model with Mixtral-8x7B's MoE, trained at our workload: a peer our EP runs are measured against.

Megatron-Core (github.com/NVIDIA/Megatron-LM, the `megatron-core` package) is NVIDIA's
library for training transformers at scale, and the one whose Mixtral-8x7B figures NVIDIA
publishes. This script builds its `GPTModel` at Mixtral's shapes with the Transformer Engine
MoE layer spec and trains it with its own expert parallelism, distributed optimizer and
schedules, on the same rows, tokens and GPUs as our runs.

How it is configured (megatron-core 0.19.2's classes, set as Megatron-LM's `pretrain_gpt.py`
and its Mixtral recipe set them; `megatron/core/transformer/transformer_config.py`,
`models/gpt`, `optimizer`, `distributed`, `pipeline_parallel/schedules.py`):

- parallelism: `parallel_state.initialize_model_parallel` with tensor and pipeline degree 1
  and `expert_model_parallel_size=--ep` (default: every rank torchrun started; the rest of
  the ranks are data parallel), no gloo groups (only its checkpointing uses them);
  `model_parallel_cuda_manual_seed` with our config's seed.
- model: `GPTModel` with `get_gpt_layer_with_transformer_engine_spec(num_experts,
  moe_grouped_gemm=True)` (TE's fused RMSNorm + QKV linear, its `DotProductAttention`,
  TE `GroupedLinear` experts), RoPE at our rope_theta (fused), untied embedding and output
  layer, and a `TransformerConfig` from our config's model section (`transformer_config_kwargs`;
  `--layers` sets the depth): RMSNorm at our eps, SwiGLU (fused), no bias, 32 query heads in
  8 query groups of head_dim 128, dropout 0; the MoE: our experts and top-k, Megatron's
  default router (top-k of the logits, softmax over those k: Mixtral's), its auxiliary
  load-balancing loss (`--aux-loss-coeff`, default 0.02, Mixtral's) and our z-loss weight,
  no token dropping, the `alltoall` token dispatcher with permute fusion (TE's fused
  permute and unpermute). Weights in bf16 (`params_dtype`), randomly initialised by Megatron
  (normal, our initializer_range, output projections scaled down with depth): no checkpoint,
  no network. Its fused cross entropy (`native`; its `te` one is refused by Megatron-LM).
  `gradient_accumulation_fusion` (TE writes weight gradients into the fp32 buffer directly)
  only where apex's `fused_weight_gradient_mlp_cuda` imports: its output layer needs it.
- data parallelism and optimizer: its `DistributedDataParallel` (`overlap_grad_reduce`:
  buckets reduce-scattered during the backward; `use_distributed_optimizer`: optimizer
  states sharded over the data-parallel ranks of each parameter) and
  `get_megatron_optimizer` with our config's lr, betas, weight decay and gradient clip
  (Adam in AdamW mode, TE's FusedAdam). Gradients accumulate and reduce in fp32
  (`grad_reduce_in_fp32`, Megatron-LM's default for bf16) and the optimizer keeps an fp32
  master copy, fp32 exp_avg and exp_avg_sq: 18 bytes a parameter in all (2 bf16 + 4 grad +
  12), sharded states aside. Experts have EP-many data-parallel replicas fewer, so at EP =
  world size their states are not sharded at all. To fit more:
  `--precision-aware-optimizer` (TE's FusedAdam keeps the fp32 master as a 16-bit remainder
  beside the bf16 parameter, and exp_avg and exp_avg_sq in bf16: 2 + 6 bytes) with `--grads
  bf16` (bf16 gradient buffer and reduction: 2 bytes): 10 bytes a parameter, as our
  master_adamw; or `--optimizer-cpu-offload FRACTION` (its `HybridDeviceOptimizer`: that
  fraction of the optimizer states and their update on the host, fp32, with the copies
  overlapped; Megatron runs it on its precision-aware path). The whole model at EP=4 holds
  12.9 B parameters a GPU (11.3 B of them its 2 experts a layer): 10 bytes each is 121 GB
  before activations, which full recompute keeps small; offloaded, the host holds about 16
  bytes for each (fp32 copy, gradient and moments), 206 GB a GPU at a fraction of 1, more
  than four of them share on a host of 512 GiB, and a fraction the host can hold leaves more
  fp32 moments on the GPU than fit there.
- recompute (Megatron's options): `--recompute selective` with `--recompute-modules`
  (Megatron's default `core_attn`; `moe_act`, `layernorm`, `moe` and the rest it takes),
  `--recompute full` (whole layers; `--recompute-num-layers N`: the first N of them,
  Megatron's `block` method, default all).
- MoE communication overlap: `--moe-overlap` (`overlap_moe_expert_parallel_comm`: the
  all-to-all of one micro-batch's forward hidden under another's backward, Megatron's
  combined 1F1B schedule, DeepSeek-V3's) needs EP > 1 and at least two micro-batches:
  `--micro-batches K` cuts each GPU's row into K equal pieces (documents that cross a cut
  become two; the FLOP count counts the pieces' attention). `--delay-wgrad-compute` adds its
  delayed weight gradients to it. Megatron refuses it with full recompute or `moe` recompute.
- input: one packed row per GPU per step, as benchmarks/peer_workload.py gives our peers
  (by default our own run's rows for this rank, same tokens and document edges; with
  `--doc-len`, random tokens in documents of that length), in Megatron's packed-sequence
  layout (`PackedSeqParams`, `thd`: attention and RoPE inside each document, by the
  documents' edges), labels shifted one left, the loss mask 0 at each document's last token.
- step: as Megatron-LM's `train_step`: `zero_grad_buffer`, `get_forward_backward_func()`
  over the micro-batches (the per-token losses averaged over the masked-in tokens, then
  over the micro-batches), the grad reduction finished by its `finalize_model_grads`,
  `optimizer.step()` (clipping included); no learning-rate schedule.

What Megatron-Core does that we do not: its distributed optimizer shards states over the
data-parallel ranks, and its gradient buffers reduce in buckets during the backward; the
MoE communication overlap above; pipeline, tensor, context and expert-tensor parallelism,
FP8 recipes, CUDA graphs, optimizer CPU offload and token dropping with capacity factors.
What we do that it does not: Mixtral itself (HF checkpoints in and out), expert tiers chosen
by name with the `loop` reference, our Triton grouped GEMMs and FP8 experts, LoRA, and the
memory estimate that picks recompute. Its all-to-all dispatcher, like ours, reads the
split sizes on the host.

Figures are ours (te_mixtral/measure/metrics.py), as the other peers': each step between
synchronised host clocks, `--warmup` steps left out, median step time, tokens/s and model
TFLOP/s per GPU from `train_flops` summed over the ranks' rows: 6 x active parameters x
tokens (12.75 B active of 8x7B's 46.7 B: the dense part and 2 of 8 experts) plus causal
attention per document, forward and backward (679 TFLOP for one causal 8192-token sequence
through all 32 layers); recomputation not counted. Rank 0's peak memory.

Versions. megatron-core 0.19.2 (`pip install -e .[megatron-peer]`), which needs Python >=
3.12 and, for the TE spec, Transformer Engine (2.20 on the GPU image, with torch 2.11); it
installs only torch, numpy and packaging beside it. On a CPU its config, layer specs and a
model with Megatron's local (non-TE) spec build; the TE model needs CUDA: the script
refuses a machine without it.

From the repository root, on CUDA machines with megatron-core installed; on one GPU, or on
several under torchrun (every rank holds E / --ep experts):

    python3 -m benchmarks.megatron_peer --layers 4
    torchrun --nproc-per-node 2 -m benchmarks.megatron_peer --layers 8 [--ep 2] \\
        [--moe-overlap --micro-batches 2] [--config configs/mixtral-8x7b-8layer.yaml] \\
        [--steps 15] [--warmup 5] [--json out.json]
    torchrun --nproc-per-node 4 -m benchmarks.megatron_peer --config configs/mixtral-8x7b.yaml \\
        --batch-size 4 --precision-aware-optimizer --grads bf16 --recompute full
    (scripts/depth_gpu.sh OUT megatron-4l-ep1 megatron-8l-ep2 megatron-32l-ep4: each beside ours)
"""

import argparse
import os
import sys
from functools import partial

from benchmarks import common
from benchmarks.peer_workload import (
    add_model_peer_flags,
    add_run_flags,
    check_model_peer,
    document_positions,
    peer_main,
    rank_rows,
    rows_per_gpu,
    timed_steps,
)
from te_mixtral.errors import UserError
from te_mixtral.measure.report import package_version

MEGATRON = "0.19.2"  # the release this script is written against (pyproject.toml's megatron-peer extra)
MIXTRAL_AUX_LOSS = 0.02
RECOMPUTE = ("none", "selective", "full")
# recompute_modules Megatron 0.19.2 takes for a layer of this model (its MLA, GDN and shared-expert ones aside)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "moe")


def transformer_config_kwargs(m, args) -> dict:
    """The `TransformerConfig` fields of our `ModelConfig` `m` and this run's options (module
    docstring); the rest are Megatron's defaults."""
    import torch

    recompute = {}
    if args.recompute == "selective":
        recompute = {"recompute_granularity": "selective", "recompute_modules": args.recompute_modules}
    elif args.recompute == "full":
        recompute = {"recompute_granularity": "full", "recompute_method": "block",
                     "recompute_num_layers": args.recompute_num_layers or m.num_hidden_layers}
    return {
        "num_layers": m.num_hidden_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.intermediate_size,
        "num_attention_heads": m.num_attention_heads, "num_query_groups": m.num_key_value_heads,
        "kv_channels": m.head_dim, "normalization": "RMSNorm", "layernorm_epsilon": m.rms_norm_eps,
        "gated_linear_unit": True, "activation_func": torch.nn.functional.silu, "add_bias_linear": False,
        "add_qkv_bias": False, "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": m.initializer_range,
        "bf16": True, "params_dtype": torch.bfloat16,
        "bias_activation_fusion": True, "bias_dropout_fusion": True, "apply_rope_fusion": True,
        "cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native",
        "num_moe_experts": m.num_experts, "moe_ffn_hidden_size": m.intermediate_size,
        "moe_router_topk": m.num_experts_per_tok, "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": args.aux_loss_coeff, "moe_z_loss_coeff": m.router_z_loss_coef or None,
        "moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", "moe_permute_fusion": True,
        "expert_model_parallel_size": args.ep,
        "overlap_moe_expert_parallel_comm": args.moe_overlap, "delay_wgrad_compute": args.delay_wgrad_compute,
        **recompute,
    }


def optimizer_config_kwargs(train, args) -> dict:
    """The `OptimizerConfig` fields of our `TrainConfig` `train` and this run's optimizer options."""
    import torch

    offload = args.optimizer_cpu_offload is not None
    states = torch.bfloat16 if args.precision_aware_optimizer else torch.float32
    return {
        "optimizer": "adam", "lr": train.lr, "weight_decay": train.weight_decay, "adam_beta1": train.beta1,
        "adam_beta2": train.beta2, "adam_eps": 1e-8, "clip_grad": train.grad_clip, "bf16": True,
        "params_dtype": torch.bfloat16, "use_distributed_optimizer": True,
        # Megatron runs its CPU offload on the precision-aware path (fp32 states there).
        "use_precision_aware_optimizer": args.precision_aware_optimizer or offload,
        "main_grads_dtype": torch.bfloat16 if args.grads == "bf16" else torch.float32,
        "exp_avg_dtype": states, "exp_avg_sq_dtype": states,
        "optimizer_cpu_offload": offload, "optimizer_offload_fraction": args.optimizer_cpu_offload or 0.0,
        "overlap_cpu_optimizer_d2h_h2d": offload,
    }


def ddp_config_kwargs(args) -> dict:
    """The `DistributedDataParallelConfig` fields of this run."""
    return {"grad_reduce_in_fp32": args.grads == "fp32", "overlap_grad_reduce": True,
            "use_distributed_optimizer": True, "delay_wgrad_compute": args.delay_wgrad_compute}


def megatron_inputs(row: dict) -> dict:
    """A THD row (peer_workload.py's `thd_row`) as Megatron's GPT model takes a packed batch:
    tokens, labels shifted one left (token i predicts i + 1), a loss mask that is 0 where
    there is nothing to predict (each document's last token, the row's last), and the
    documents' edges."""
    import torch

    # thd_row's labels are the tokens (transformers shifts them in its loss), -100 at each
    # document's first token: shifted, that is each document's last token.
    labels = torch.cat([row["labels"][:, 1:], torch.full_like(row["labels"][:, :1], -100)], dim=1)
    loss_mask = labels != -100
    return {"tokens": row["input_ids"], "labels": labels.masked_fill(~loss_mask, 0), "loss_mask": loss_mask.float(),
            "cu_seqlens": row["cu_seq_lens_q"].to(torch.int32)}


def micro_batches(batch: dict, count: int) -> list[dict]:
    """`batch` (`megatron_inputs`) cut into `count` equal pieces of tokens (`count` divides
    them: `run` checks); a document that crosses a cut becomes one document in each piece, as
    attention sees it there."""
    import torch

    tokens = batch["tokens"].shape[1]
    size, cu = tokens // count, batch["cu_seqlens"]
    pieces = []
    for start in range(0, tokens, size):
        inner = cu[(cu > start) & (cu < start + size)] - start
        edges = torch.cat([inner.new_zeros(1), inner, inner.new_full((1,), size)])
        pieces.append({key: batch[key][:, start:start + size] for key in ("tokens", "labels", "loss_mask")}
                      | {"cu_seqlens": edges})
    return pieces


def packed_params(cu_seqlens, max_seqlen: int):
    """Megatron's description of one packed row of documents (`thd`: no padding)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def loss_of(loss_mask, per_token_loss):
    """Megatron's loss-function triple: the masked sum, the tokens it sums over, and what
    it reports (the mean, a tensor of its own: Megatron divides the sum in place)."""
    import torch

    mask = loss_mask.reshape(-1)
    total = (per_token_loss.float().reshape(-1) * mask).sum()
    count = mask.sum().to(torch.int)
    return total, count, {"loss": (total / count.clamp(min=1)).detach()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's `forward_step_func`: one micro-batch through the model (or, under
    `--moe-overlap`, its schedule plan, which the combined 1F1B schedule runs)."""
    batch = next(data_iterator)
    inputs = {"input_ids": batch["tokens"], "position_ids": batch["positions"], "attention_mask": None,
              "labels": batch["labels"], "packed_seq_params": packed_params(batch["cu_seqlens"], batch["max_seqlen"])}
    output = model.build_schedule_plan(**inputs) if return_schedule_plan else model(**inputs)
    return output, partial(loss_of, batch["loss_mask"])


def device_batches(rows: list[dict], count: int) -> list[list[dict]]:
    """Each step's micro-batches, ready for `forward_step`: the pieces' positions and
    longest documents found before the timing (their lengths are read on the host once,
    here)."""
    steps = []
    for row in rows:
        pieces = micro_batches(megatron_inputs(row), count)
        for piece in pieces:
            cu = piece["cu_seqlens"]
            piece["positions"] = document_positions(cu)
            piece["max_seqlen"] = int(cu.diff().max())
        steps.append(pieces)
    return steps


def build(m, args, cfg, device):
    """Megatron's model (in its DDP wrapper) and optimizer on `device`, with the
    `TransformerConfig` they were built from."""
    import importlib.util

    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.ep, create_gloo_process_groups=False)
    torch.manual_seed(cfg.train.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    # Its output layer fuses the weight-gradient accumulation only through apex's extension.
    fused_wgrad = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    try:
        config = TransformerConfig(**transformer_config_kwargs(m, args), gradient_accumulation_fusion=fused_wgrad)
        optimizer_config = OptimizerConfig(**optimizer_config_kwargs(cfg.train, args))
        ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(args))
    except (AssertionError, ValueError, RuntimeError) as error:  # its own checks of the combination
        raise UserError(f"megatron-core refuses this configuration: {error}") from error

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=m.num_experts, moe_grouped_gemm=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=m.vocab_size,
                     max_sequence_length=m.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=m.rope_theta, share_embeddings_and_output_weights=m.tie_word_embeddings,
                     parallel_output=True).to(device)
    for param in model.parameters():  # as Megatron-LM's get_model: its optimizer reads these attributes
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = model.no_sync  # no reduction before a step's last micro-batch
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(optimizer_config, [model], use_gloo_process_groups=False)
    return model, optimizer, config


def train_step(model, optimizer, step_batches: list[dict], tokens: int):
    """One step as Megatron-LM's `train_step`; the loss (mean over the micro-batches), still
    on the device."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    count = len(step_batches)
    reported = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(step_batches), model=[model], num_microbatches=count,
        seq_length=tokens // count, micro_batch_size=1, decoder_seq_length=tokens // count, forward_only=False)
    optimizer.step()
    return torch.stack([r["loss"] for r in reported]).mean()


def run(args, cfg) -> dict:
    m, world = cfg.model, int(os.environ.get("WORLD_SIZE", "1"))
    tokens = rows_per_gpu(cfg, world) * cfg.data.seq_len  # one GPU's
    args.ep = args.ep or world  # default: every rank torchrun started
    if world % args.ep or m.num_experts % args.ep:
        raise UserError(f"--ep {args.ep} must divide the {world} ranks and the {m.num_experts} experts")
    if args.recompute_num_layers is not None and args.recompute_num_layers > m.num_hidden_layers:
        raise UserError(f"--recompute-num-layers {args.recompute_num_layers} is more than the "
                        f"{m.num_hidden_layers} layers")
    if tokens % args.micro_batches:
        raise UserError(f"--micro-batches {args.micro_batches} does not divide the {tokens} tokens of a GPU's step")
    if args.moe_overlap and args.ep == 1:
        raise UserError("--moe-overlap hides the expert-parallel all-to-all: it needs --ep above 1")
    import torch  # after the checks above: a bad argument is refused in one line without waiting for torch

    from te_mixtral.distributed.layout import shutdown
    from te_mixtral.measure.metrics import train_flops

    if not torch.cuda.is_available():
        raise UserError("the Megatron-Core peer needs CUDA GPUs (its Transformer Engine layers), and none is visible")
    if package_version("megatron-core") != MEGATRON:
        raise UserError(f"megatron-core {MEGATRON} is not installed (found {package_version('megatron-core')}): "
                        "pip install -e .[megatron-peer], on Python >= 3.12")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if "LOCAL_RANK" in os.environ:
        torch.distributed.init_process_group("nccl", device_id=device)
    else:  # one GPU without torchrun: a process group of one
        torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1,
                                             device_id=device)
    model, optimizer, config = build(m, args, cfg, device)
    rank = torch.distributed.get_rank()
    header = common.run_header(device, megatron_core=package_version("megatron-core"), world_size=world,
                               expert_parallel=args.ep)
    if rank == 0:
        print(f"{common.header_line(header)}  megatron-core {header['megatron_core']}", flush=True)

    batches = device_batches(rank_rows(cfg, args, device, rank, world), args.micro_batches)
    # Global FLOPs: every rank's pieces (their documents differ), summed once before the timing.
    flops = torch.tensor([sum(train_flops(m, p["cu_seqlens"].cpu(), p["tokens"].shape[1]) for p in step)
                          for step in batches], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(flops)
    result = timed_steps(
        lambda step_batches: train_step(model, optimizer, step_batches, tokens), batches, args, cfg, header,
        flops.tolist(), device, world,
        {"expert_parallel": args.ep, "micro_batches": args.micro_batches, "aux_loss_coeff": args.aux_loss_coeff,
         "experts": "TE GroupedLinear (moe_grouped_gemm), alltoall dispatcher, moe_permute_fusion",
         "moe_overlap": args.moe_overlap, "delay_wgrad_compute": args.delay_wgrad_compute,
         "recompute": args.recompute,
         "recompute_modules": config.recompute_modules if args.recompute == "selective" else None,
         "recompute_num_layers": config.recompute_num_layers,
         "gradient_accumulation_fusion": config.gradient_accumulation_fusion,
         "optimizer": {"distributed": True, "overlap_grad_reduce": True, "grads": args.grads,
                       "precision_aware": args.precision_aware_optimizer,
                       "cpu_offload_fraction": args.optimizer_cpu_offload}})
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    shutdown(wait_for_peers=True)  # no rank tears its connections down under a peer still at work
    return result if rank == 0 else None


def check_args(args) -> None:
    """What can be refused before anything heavy loads; Megatron's own checks of the
    combination run when its configs are built."""
    check_model_peer(args)
    for name in ("batch_size", "ep", "micro_batches", "recompute_num_layers"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.recompute_modules is not None and args.recompute != "selective":
        raise UserError("--recompute-modules needs --recompute selective")
    if args.recompute_num_layers is not None and args.recompute != "full":
        raise UserError("--recompute-num-layers needs --recompute full "
                        "(Megatron's selective recompute is of every layer)")
    if args.moe_overlap and args.micro_batches < 2:
        raise UserError("--moe-overlap overlaps one micro-batch's all-to-all with another's compute: "
                        "it needs --micro-batches 2 or more")
    if args.delay_wgrad_compute and not args.moe_overlap:
        raise UserError("--delay-wgrad-compute needs --moe-overlap")
    if args.optimizer_cpu_offload is not None:
        if not 0 < args.optimizer_cpu_offload <= 1:
            raise UserError(f"--optimizer-cpu-offload takes a fraction in (0, 1], got {args.optimizer_cpu_offload}")
        if args.precision_aware_optimizer:
            raise UserError("--optimizer-cpu-offload keeps fp32 optimizer states: "
                            "leave out --precision-aware-optimizer")
    if args.grads == "bf16" and not args.precision_aware_optimizer and args.optimizer_cpu_offload is None:
        raise UserError("--grads bf16 needs --precision-aware-optimizer or --optimizer-cpu-offload "
                        "(Megatron's optimizer takes bf16 gradients only on its precision-aware path)")


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_peer_flags(parser)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="packed rows per step over all GPUs, our train.batch_size (default: the config's)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: every rank)")
    parser.add_argument("--aux-loss-coeff", type=float, default=MIXTRAL_AUX_LOSS,
                        help=f"weight of Megatron's load-balancing loss (default {MIXTRAL_AUX_LOSS}, Mixtral's)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="micro-batches each GPU's row is cut into (default 1: the row whole)")
    parser.add_argument("--moe-overlap", action="store_true",
                        help="overlap_moe_expert_parallel_comm: needs EP > 1 and --micro-batches 2 or more")
    parser.add_argument("--delay-wgrad-compute", action="store_true", help="with --moe-overlap: delay_wgrad_compute")
    parser.add_argument("--recompute", choices=RECOMPUTE, default="none", help="Megatron's recompute_granularity")
    parser.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, default=None,
                        help="with --recompute selective (default: Megatron's, core_attn)")
    parser.add_argument("--recompute-num-layers", type=int, default=None,
                        help="with --recompute full: recompute the first N layers only (default: all)")
    parser.add_argument("--precision-aware-optimizer", action="store_true",
                        help="TE FusedAdam with the fp32 master as a 16-bit remainder and bf16 exp_avg, exp_avg_sq")
    parser.add_argument("--optimizer-cpu-offload", type=float, default=None, metavar="FRACTION",
                        help="this fraction of the optimizer states and update on the host (HybridDeviceOptimizer)")
    parser.add_argument("--grads", choices=("fp32", "bf16"), default="fp32",
                        help="gradient buffer and reduction dtype (default fp32, Megatron-LM's for bf16 training)")
    add_run_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return peer_main("megatron_peer", parse_args(argv), check_args, run,
                     lambda w: f"Megatron-Core ({w['num_hidden_layers']} layers, EP {w['expert_parallel']} of "
                               f"{w['world_size']} GPUs, {w['tokens_per_step_per_gpu']} tokens/step/GPU)")


if __name__ == "__main__":
    sys.exit(main())
