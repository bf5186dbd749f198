"""torchtitan's MoE at Mixtral-8x7B's shapes, trained at our workload: the peer our EP runs are measured against.

torchtitan (github.com/pytorch/torchtitan) is PyTorch's own training platform. It ships no
Mixtral, but its MoE decoder is built from shared parts (`torchtitan.models.common`), so this
script assembles one with Mixtral's shapes from them, and trains it with torchtitan's own
expert parallelism and grouped-GEMM experts, on the same rows, tokens and GPUs as our runs.

How it is configured (torchtitan 0.3.0's classes; its Qwen3-MoE registry,
`torchtitan/models/qwen3/__init__.py`, builds its models the same way):

- model: `Qwen3Model.Config` (a plain `Decoder`: embedding, blocks, RMSNorm, LM head) whose
  blocks are `Qwen3TransformerBlock.Config` (pre-norm attention, then the MoE), with every
  shape from our config's model section (te_mixtral/config.py; `--layers` sets the depth):
  attention from `make_gqa_config` (32 query heads, 8 KV heads, head_dim 128, fused QKV,
  `CosSinRoPE` at our rope_theta, and no QK norm, which is Qwen3's and not Mixtral's);
  the MoE from `make_moe_config` with `make_router_config` (`score_func="softmax"`,
  `route_norm=True`: Mixtral's softmax over the 8 experts, top-2 renormalised) and
  `make_routed_experts_config` (`GroupedExperts`: stacked w1/w2/w3 [E, F, D] weights,
  SwiGLU through `torch._grouped_mm`; `comm_backend="standard"`: `AllToAllTokenDispatcher`,
  torch all-to-all under EP, a local sort at one rank). No shared expert. Its
  auxiliary-loss-free balancing bias is off (`load_balance_coeff=None`): it needs torchtitan's
  optimizer container and hook, and Mixtral balances with an auxiliary loss, which
  torchtitan's MoE does not have. Weights are randomly initialised by its `init_weights`
  (normal, std 0.02): no checkpoint, no network.
- attention: `--attention flex` (default, torchtitan's LM default: FlexAttention with a
  block-causal mask per document, built by the model's `get_attention_masks` from the
  per-document positions) or `varlen` (`VarlenAttention`, the flash varlen kernel).
- parallelism: as its `Trainer` sets it up. `init_distributed`, `ParallelDims` from a
  `ParallelismConfig(expert_parallel_degree=--ep, data_parallel_shard_degree=-1,
  spmd_backend="partial_dtensor")`, `update_from_config` (the EP sharding plan), the model
  built on the meta device, `parallelize_qwen3` (EP over the experts, FSDP2 over the rest
  with its `MixedPrecisionPolicy`: bf16 compute, fp32 reduce), `to_empty` and
  `init_weights`. `--dtype` is its `training.dtype`: `float32` (its default: fp32
  parameters, gradients and AdamW states, bf16 copies all-gathered for compute) or
  `bfloat16` (its full-bf16 training: all of them in bf16, no fp32 copy). The fp32 states
  take 16 bytes a parameter: 16 layers of 8x7B (23.5 B parameters) need about 190 GB a GPU
  over two GPUs before any activation, more than an H200 holds, so that load needs at least
  `--dtype bfloat16` (8 bytes a parameter, about 94 GB a GPU before activations). No
  activation checkpointing, no compile (torchtitan's defaults for this path; its recipes
  usually turn both on). The SPMD backend
  is `partial_dtensor` (DTensor on the model-parallel axes only), not 0.3.0's default
  `spmd_types`: built this way, `spmd_types` stops in FSDP ("all parameters must be
  DTensors on the full SPMD mesh"), so it needs more of the Trainer than this script
  reproduces.
- input: one packed row per GPU per step, as benchmarks/peer_workload.py gives our peers
  (by default our own run's rows for this rank, same tokens and document edges; with
  `--doc-len`, random tokens in documents of that length), passed as torchtitan's
  dataloaders pass it: `tokens`, per-document `positions`, labels shifted one left, -100
  where the target would be the next document's first token and at the row's end.
- step: forward, cross entropy in fp32 over the logits, averaged over the predicted tokens
  (torchtitan's `CrossEntropyLoss` sums and its trainer divides by the token count; its
  `ChunkedLossWrapper`, which applies the LM head chunk by chunk to save memory, is not
  used), backward, `torch.optim.AdamW(fused=True)` over its parameters at our lr (betas
  0.9, 0.95 and weight decay 0.1, its `default_adamw`), `zero_grad`; no clipping, no
  schedule.

What torchtitan does that we do not: its FSDP2 keeps fp32 parameters and all-gathers bf16
copies for compute (16 bytes a parameter), where our `master_adamw` core keeps bf16
parameters and the fp32 master as a 16-bit remainder in the optimizer (10 to 14 bytes);
FlexAttention (compiled, block-sparse over the document mask) where we call TE's
`DotProductAttention` over the packed documents; an auxiliary-loss-free balancing bias (off
here) and DeepEP / HybridEP dispatchers (`comm_backend`), MXFP8 / NVFP4 converters,
pipeline, context and tensor parallelism. What we do that it does not: Mixtral itself (HF checkpoints in and
out), the auxiliary load-balancing and z losses, expert tiers chosen by name with the `loop`
reference, our Triton grouped GEMMs and FP8 experts, LoRA, and the memory estimate that picks
recompute.

Figures are ours (te_mixtral/measure/metrics.py), as the other peers': each step between
synchronised host clocks, `--warmup` steps left out, median step time, tokens/s and model
TFLOP/s per GPU from `train_flops` summed over the ranks' rows (attention per document),
rank 0's peak memory.

Versions. torchtitan 0.3.0 (`pip install -e .[torchtitan-peer]`) is the release this
script is written against; its own release notes (docs/release.md) pair it with torch 2.14,
and it imports, builds this model and runs its forward (EP 1 and 2 over gloo) against torch
2.13 on a CPU. Its releases follow PyTorch's minor releases; the one for torch 2.11 is,
by date, 0.2.2 (built in February 2026, before torch 2.11), whose API is another one
(`torchtitan/models/moe`, TOML job configs): this script does not run on it. 0.3.0 on torch
2.11 is unchecked, and likely to stop at the flex mask: its `Decoder` passes
`separate_full_blocks` to torch's `create_block_mask`, which stable torch 2.12 does not
take yet (pytorch/torchtitan#3811); `--attention varlen` does not build that mask.

On a CPU, torchtitan's language-model attention backends cannot train (FlexAttention has no
CPU backward, varlen needs CUDA): the script refuses a machine without CUDA, and its tests
build the model, run its forward and its MoE's backward on a CPU.

From the repository root, on CUDA machines with torchtitan installed; on one GPU, or on
several under torchrun (every rank holds E / --ep experts):

    python3 -m benchmarks.torchtitan_peer --layers 2 [--attention varlen] [--dtype bfloat16]
    torchrun --nproc-per-node 2 -m benchmarks.torchtitan_peer --layers 16 [--ep 2] \\
        [--config configs/mixtral-8x7b-8layer.yaml] [--steps 30] [--warmup 5] [--json out.json]
"""

import argparse
import os
import sys
from functools import partial

from benchmarks import common
from benchmarks.peer_workload import (
    check_model_peer,
    document_positions,
    our_rows,
    random_rows,
    report,
    summarize_steps,
)
from te_mixtral.config import load_config
from te_mixtral.errors import UserError
from te_mixtral.measure.report import package_version

ATTENTION = ("flex", "varlen")
WEIGHT_DECAY, BETAS = 0.1, (0.9, 0.95)  # torchtitan's default_adamw


def mixtral_config(m, attention: str):
    """torchtitan's `Qwen3Model.Config` at the shapes of our `ModelConfig` `m` (module docstring)."""
    from torch import nn
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import (
        get_attention_config,
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    normal = partial(nn.init.normal_, std=m.initializer_range)
    linear = {"weight": normal, "bias": nn.init.zeros_}
    experts = {"w1_EFD": normal, "w2_EDF": normal, "w3_EFD": normal}
    D, E, K = m.hidden_size, m.num_experts, m.num_experts_per_tok

    def norm(width):
        return RMSNorm.Config(normalized_shape=width, eps=m.rms_norm_eps, param_init={"weight": nn.init.ones_})

    def block():
        return Qwen3TransformerBlock.Config(
            attention_norm=norm(D),
            ffn_norm=norm(D),
            attention=make_gqa_config(
                dim=D, n_heads=m.num_attention_heads, n_kv_heads=m.num_key_value_heads, head_dim=m.head_dim,
                wqkv_param_init=linear, wo_param_init=linear, inner_attention=get_attention_config(attention),
                fuse_qkv=True,
                rope=CosSinRoPE.Config(dim=m.head_dim, max_seq_len=m.max_position_embeddings, theta=m.rope_theta)),
            moe=make_moe_config(
                num_experts=E, load_balance_coeff=None,
                router=make_router_config(dim=D, num_experts=E, gate_param_init=linear, top_k=K,
                                          score_func="softmax", route_norm=True),
                routed_experts=make_routed_experts_config(dim=D, hidden_dim=m.intermediate_size, num_experts=E,
                                                          top_k=K, param_init=experts, comm_backend="standard")))

    return Qwen3Model.Config(
        vocab_size=m.vocab_size, dim=D, norm=norm(D),
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=D, param_init={"weight": normal}),
        lm_head=Linear.Config(in_features=D, out_features=m.vocab_size, param_init=linear),
        layers=[block() for _ in range(m.num_hidden_layers)])


def titan_inputs(row: dict) -> dict:
    """A THD row (peer_workload.py's `thd_row`) as torchtitan's dataloaders give a batch:
    tokens, positions restarting at each document, and labels already shifted."""
    import torch

    # thd_row's labels are the tokens (transformers shifts them in its loss), with -100 at
    # each document's first token; torchtitan's loss takes them shifted: token i predicts i+1.
    labels = torch.cat([row["labels"][:, 1:], torch.full_like(row["labels"][:, :1], -100)], dim=1)
    return {"tokens": row["input_ids"], "positions": document_positions(row["cu_seq_lens_q"]), "labels": labels}


def loss_of(model, batch: dict):
    """Forward and torchtitan's cross entropy (fp32, mean over the predicted tokens)."""
    import torch

    masks = model.get_attention_masks(batch["positions"])
    logits = model(batch["tokens"], batch["positions"], masks)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                             ignore_index=-100)


def train_step(model, optimizer, batch: dict):
    """One step; the loss, still on the device."""
    loss = loss_of(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def build_parallel(m, attention: str, ep: int, dtype: str, device):
    """The model on `device` as torchtitan's Trainer builds it under torchrun (module
    docstring), and the world size. torchtitan's `init_distributed` starts NCCL, or keeps
    the process group already started."""
    import torch
    from torchtitan.config import (
        CommConfig,
        CompileConfig,
        ParallelismConfig,
        TrainingConfig,
    )
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3
    from torchtitan.tools.utils import set_default_dtype

    world_size = dist_utils.init_distributed(CommConfig())
    if world_size % ep or m.num_experts % ep:
        raise UserError(f"--ep {ep} must divide the {world_size} ranks and the {m.num_experts} experts")
    parallelism = ParallelismConfig(expert_parallel_degree=ep, data_parallel_shard_degree=-1,
                                    spmd_backend="partial_dtensor")  # see the module docstring
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims.build_mesh()

    config = mixtral_config(m, attention)
    config.update_from_config(config=argparse.Namespace(parallelism=parallelism))
    training = TrainingConfig(dtype=dtype)
    with torch.device("meta"), set_default_dtype(getattr(torch, dtype)):
        model = config.build()
    model = parallelize_qwen3(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder="")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, world_size


def run(args, cfg) -> dict:
    import torch

    from te_mixtral.measure.metrics import StepTimer, train_flops

    m, tokens = cfg.model, cfg.train.batch_size * cfg.data.seq_len
    if not torch.cuda.is_available():
        raise UserError("the torchtitan peer needs CUDA GPUs (its attention cannot train on a CPU), and none is visible")
    if package_version("torchtitan") is None:
        raise UserError("torchtitan is not installed: pip install -e .[torchtitan-peer] (--help says which torch it needs)")
    ep = args.ep or int(os.environ.get("WORLD_SIZE", "1"))  # default: every rank torchrun started
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if "LOCAL_RANK" not in os.environ:
        # One GPU without torchrun: a process group of one, which torchtitan's init_distributed keeps.
        torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1,
                                             device_id=device)
    torch.manual_seed(cfg.train.seed)  # the same on every rank, as torchtitan's set_determinism seeds them
    model, world_size = build_parallel(m, args.attention, ep, args.dtype, device)
    rank = torch.distributed.get_rank()
    header = common.run_header(device, torchtitan=package_version("torchtitan"), world_size=world_size,
                               expert_parallel=ep)
    if rank == 0:
        print(common.header_line(header), flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                  fused=True)

    if args.doc_len is None:
        rows = our_rows(cfg, args.steps, device, rank, world_size)
    else:
        generator = torch.Generator(device).manual_seed(cfg.train.seed + rank)
        rows = random_rows(cfg, args.steps, args.doc_len, generator, device)
    # Global FLOPs: every rank's rows (their documents differ), summed once before the timing.
    flops = torch.tensor([train_flops(m, r["cu_seq_lens_q"].cpu(), tokens) for r in rows], dtype=torch.float64,
                         device=device)
    torch.distributed.all_reduce(flops)
    batches = [titan_inputs(r) for r in rows]

    # --- training: warm-up and timed steps are the same step
    timer, losses = StepTimer(device), []
    for batch in batches:
        with timer.step():
            loss = train_step(model, optimizer, batch)
        losses.append(loss.item())

    summary = summarize_steps(timer.times, args.warmup, tokens * world_size, flops.tolist(), device, world_size)
    result = {
        "header": header,
        "workload": {"config": args.config, "num_hidden_layers": m.num_hidden_layers, "tokens_per_step_per_gpu": tokens,
                     "rows": "ours" if args.doc_len is None else f"random, {args.doc_len}-token documents",
                     "steps": args.steps, "timing_warmup_steps": args.warmup, "lr": cfg.train.lr,
                     "attention": args.attention, "world_size": world_size, "expert_parallel": ep,
                     "experts": "GroupedExperts (torch._grouped_mm), AllToAllTokenDispatcher",
                     "dtype": args.dtype,
                     "optimizer": f"torch.optim.AdamW(fused=True), FSDP2 {args.dtype} parameters, bf16 compute"},
        "summary": summary,
        "step_ms": [t * 1e3 for t in timer.times],
        "loss": losses,
        "flops_per_step": flops.tolist(),
    }
    torch.distributed.destroy_process_group()
    return result if rank == 0 else None


def check_args(args) -> None:
    check_model_peer(args)
    if args.ep is not None and args.ep <= 0:
        raise UserError(f"--ep must be positive, got {args.ep}")


def workload_config(args):
    """Our config of the workload: the file's, with `--layers`."""
    return load_config(args.config, {} if args.layers is None else {"num_hidden_layers": str(args.layers)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/mixtral-8x7b-8layer.yaml")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the config's)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: every rank)")
    parser.add_argument("--attention", choices=ATTENTION, default="flex",
                        help="torchtitan's attention backend (default: flex, its default)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="torchtitan's training.dtype: of parameters, gradients and AdamW states (default: "
                             "float32, its default; compute is bf16 either way)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--doc-len", type=int, default=None,
                        help="random tokens in documents of this length (default: our run's rows)")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    try:
        check_args(args)
        cfg = workload_config(args)
        # Heavy imports only once the arguments are known to be good: a mistake is refused at once.
        result = run(args, cfg)
    except UserError as error:
        print(f"torchtitan_peer: error: {error}", file=sys.stderr)
        return 2
    if result is not None:
        w = result["workload"]
        report(f"torchtitan MoE ({w['num_hidden_layers']} layers, EP {w['expert_parallel']} of {w['world_size']} "
               f"GPUs, {w['tokens_per_step_per_gpu']} tokens/step/GPU, {w['attention']})", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
