"""torchtitan's MoE at Mixtral-8x7B's shapes, trained at our workload: the peer our EP runs are measured against.

torchtitan (github.com/pytorch/torchtitan) is PyTorch's own training platform. It ships no
Mixtral, but its Qwen3 decoder takes an MoE in every block (`moe_enabled`), and with Qwen3's
QK norm off that block is Mixtral's: this script builds one at Mixtral's shapes and trains it
with torchtitan's own expert parallelism and grouped-GEMM experts, on the same rows, tokens
and GPUs as our runs.

How it is configured (torchtitan 0.2.2's classes, as its `Trainer` builds its Qwen3 MoE
flavours; `torchtitan/models/qwen3`, `torchtitan/models/moe`, `torchtitan/train.py`):

- model: `Qwen3Model` from `Qwen3ModelArgs` (embedding, blocks, RMSNorm, an untied LM head)
  whose blocks are pre-norm attention, then the MoE, with every shape from our config's model
  section (te_mixtral/config.py; `--layers` sets the depth): attention with separate q, k, v
  and o projections (32 query heads, 8 KV heads, head_dim 128), RoPE at our rope_theta, and
  no QK norm (`qk_norm=False`: Qwen3's, not Mixtral's); the MoE from `MoEArgs`
  (`score_func="softmax"`, `route_norm=True`, `top_k=2`: Mixtral's softmax over the 8
  experts, top-2 renormalised; `score_before_experts=False`: the weights scale the experts'
  outputs, as Mixtral's do, not their inputs; `num_shared_experts=0`), `GroupedExperts`
  (stacked w1/w2/w3 [E, F, D] weights, SwiGLU through `torch._grouped_mm`, in bf16 whatever
  `--dtype`) and, under EP, its `ExpertParallel` all-to-all (`expert_parallel_comm_backend`
  "standard", its default). Its auxiliary-loss-free balancing bias is off
  (`load_balance_coeff=None`): it needs torchtitan's optimizer container and hook, and
  Mixtral balances with an auxiliary loss, which torchtitan's MoE does not have. Weights
  are randomly initialised by its `init_weights` (truncated normal, std 0.02, output
  projections scaled down with depth): no checkpoint, no network.
- attention: `--attention flex` (default: FlexAttention, compiled, with its block-causal
  mask, `attn_mask_type="block_causal"`) or `varlen` (`VarlenAttentionWrapper`: torch's
  `varlen_attn`, the flash varlen kernel). Its `get_attention_masks` finds the documents of
  a row by its tokenizer's EOS token; our rows carry their edges instead, so it is handed a
  row that is 1 at each document's last token and a "tokenizer" whose EOS is 1
  (`DOCUMENT_END`): the masks its trainer builds for documents that end in EOS, built each
  step as its trainer does. RoPE takes each token's position in its own document (the
  model's `positions` input), as our runs and the other peers count them.
- parallelism: as its `Trainer` sets it up, from a `JobConfig` of its defaults with
  `expert_parallel_degree=--ep` (`data_parallel_shard_degree=-1`: every rank),
  `training.dtype=--dtype` and `training.seq_len` the row's length: `init_distributed`,
  `ParallelDims` and `build_mesh`, `set_determinism` (our config's seed, the same on every
  rank), the model args' `update_from_config`, the model built on the meta device,
  `parallelize_qwen3` (EP over the experts, FSDP2 over the rest with its
  `MixedPrecisionPolicy`: bf16 compute, fp32 reduce), `to_empty` and `init_weights`. On one
  GPU there is no FSDP (a degree of 1) and its trainer's autocast to bf16
  (`maybe_enable_amp`) wraps the forward and the loss instead. `--dtype` is its
  `training.dtype`: `float32` (its default: fp32 parameters, gradients and AdamW states,
  bf16 copies all-gathered for compute) or `bfloat16` (its full-bf16 training: all of them
  in bf16, no fp32 copy). The fp32 states take 16 bytes a parameter: 16 layers of 8x7B
  (23.5 B parameters) need about 190 GB a GPU over two GPUs before any activation, more
  than an H200 holds, so that load needs at least `--dtype bfloat16` (8 bytes a parameter,
  about 94 GB a GPU before activations). No activation checkpointing (0.2.2's default is
  selective, every second layer: off here, as in this peer's runs so far) and no compile
  (its default; its recipes usually turn both on).
- input: one packed row per GPU per step, as benchmarks/peer_workload.py gives our peers
  (by default our own run's rows for this rank, same tokens and document edges; with
  `--doc-len`, random tokens in documents of that length), passed as torchtitan's trainer
  passes a batch to its model: `tokens`, per-document `positions`, labels shifted one left,
  -100 where the target would be the next document's first token and at the row's end.
- step: forward, cross entropy in fp32 over the logits, averaged over the predicted tokens
  (torchtitan's loss sums and its trainer divides by the token count), backward,
  `torch.optim.AdamW(fused=True)` over its parameters at our lr (betas 0.9, 0.95, eps
  1e-8 and weight decay 0.1: its `JobConfig`'s AdamW), `zero_grad`; no clipping, no
  schedule.

What torchtitan does that we do not: its FSDP2 keeps fp32 parameters and all-gathers bf16
copies for compute (16 bytes a parameter), where our `master_adamw` core keeps bf16
parameters and the fp32 master as a 16-bit remainder in the optimizer (10 to 14 bytes);
FlexAttention (compiled, block-sparse over the document mask) where we call TE's
`DotProductAttention` over the packed documents; an auxiliary-loss-free balancing bias (off
here), a DeepEP dispatcher, float8 / MXFP8 converters, pipeline, context and tensor
parallelism. What we do that it does not: Mixtral itself (HF checkpoints in and out), the
auxiliary load-balancing and z losses, expert tiers chosen by name with the `loop`
reference, our Triton grouped GEMMs and FP8 experts, LoRA, and the memory estimate that picks
recompute.

Figures are ours (te_mixtral/measure/metrics.py), as the other peers': each step between
synchronised host clocks, `--warmup` steps left out, median step time, tokens/s and model
TFLOP/s per GPU from `train_flops` summed over the ranks' rows (attention per document),
rank 0's peak memory.

Versions. torchtitan 0.2.2 (`pip install -e .[torchtitan-peer]`), because the GPU image
has torch 2.11: its releases follow PyTorch's minor releases, and 0.2.2 is the one for
torch 2.11. 0.3.0 needs torch >= 2.12 (its FSDP imports `DataParallelMeshDims`, which 2.11's
`torch.distributed.fsdp` does not have) and has another API (`torchtitan.models.common`).
Besides torch, importing 0.2.2 takes tyro, torchdata, tensorboard (through
`torch.utils.tensorboard`), datasets and tokenizers. Checked on torch 2.13 on a CPU: it
builds this model, runs its forward and its MoE's backward, and its trainer's
parallelisation at EP 1 and 2 over gloo gives the same loss (the tests; three CUDA-only
steps of its MoE swapped for their CPU equivalents there). On torch 2.13 `varlen_attn`
refuses grouped-query attention unless passed `enable_gqa`, which 0.2.2 does not pass, so
`--attention varlen` runs on torch 2.11 only (there it trains, under torchrun on two
H200s: `scripts/depth_gpu.sh OUT titan`); `--attention flex` on CUDA is unchecked.

On a CPU, torchtitan's language-model attention backends cannot train (FlexAttention has no
CPU backward, varlen needs CUDA): the script refuses a machine without CUDA.

From the repository root, on CUDA machines with torchtitan installed; on one GPU, or on
several under torchrun (every rank holds E / --ep experts):

    python3 -m benchmarks.torchtitan_peer --layers 2 [--attention varlen] [--dtype bfloat16]
    torchrun --nproc-per-node 2 -m benchmarks.torchtitan_peer --layers 16 [--ep 2] \\
        [--config configs/mixtral-8x7b-8layer.yaml] [--steps 30] [--warmup 5] [--json out.json]
"""

import argparse
import os
import sys
from types import SimpleNamespace

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

ATTENTION = ("flex", "varlen")
# torchtitan's masks end a document at its tokenizer's EOS token; our rows carry their edges
# instead, so its mask builders read a row that is 1 at each document's last token, and this
# stands for the tokenizer (only `eos_id` is read).
DOCUMENT_END = SimpleNamespace(eos_id=1)


def mixtral_args(m, attention: str):
    """torchtitan's `Qwen3ModelArgs` at the shapes of our `ModelConfig` `m` (module docstring)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    return Qwen3ModelArgs(
        dim=m.hidden_size, n_layers=m.num_hidden_layers, n_heads=m.num_attention_heads,
        n_kv_heads=m.num_key_value_heads, head_dim=m.head_dim, vocab_size=m.vocab_size, norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta, max_seq_len=m.max_position_embeddings, qk_norm=False, enable_weight_tying=False,
        attn_type=attention, attn_mask_type="block_causal",
        moe_enabled=True, moe_inter_dim=m.intermediate_size,
        moe_args=MoEArgs(num_experts=m.num_experts, num_shared_experts=0, top_k=m.num_experts_per_tok,
                         score_func="softmax", route_norm=True, score_before_experts=False,
                         load_balance_coeff=None, use_grouped_mm=True))


def titan_inputs(row: dict) -> dict:
    """A THD row (peer_workload.py's `thd_row`) as torchtitan's trainer gives a batch to its
    model: tokens, positions restarting at each document, labels already shifted, and
    `document_ends` (1 at each document's last token) for its attention masks."""
    import torch

    # thd_row's labels are the tokens (transformers shifts them in its loss), with -100 at
    # each document's first token; torchtitan's loss takes them shifted: token i predicts i+1.
    labels = torch.cat([row["labels"][:, 1:], torch.full_like(row["labels"][:, :1], -100)], dim=1)
    document_ends = torch.zeros_like(row["input_ids"])
    document_ends[:, row["cu_seq_lens_q"][1:].long() - 1] = DOCUMENT_END.eos_id
    return {"tokens": row["input_ids"], "positions": document_positions(row["cu_seq_lens_q"]), "labels": labels,
            "document_ends": document_ends}


def loss_of(model, batch: dict, amp):
    """Forward and torchtitan's cross entropy (fp32, mean over the predicted tokens), under
    `amp`: the autocast its trainer puts around both where FSDP does not cast (one GPU), else
    a context that does nothing (`build_parallel` gives it)."""
    import torch

    with amp:
        masks = model.get_attention_masks(batch["document_ends"], DOCUMENT_END)
        logits = model(batch["tokens"], masks, batch["positions"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                                 ignore_index=-100)


def train_step(model, optimizer, batch: dict, amp):
    """One step; the loss, still on the device."""
    loss = loss_of(model, batch, amp)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def job_config(ep: int, dtype: str, tokens: int, seed: int):
    """The parts of torchtitan's `JobConfig` this run sets; the rest are its defaults."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.parallelism.expert_parallel_degree = ep  # data_parallel_shard_degree stays -1: every rank
    job.training.dtype = dtype
    job.training.seq_len = tokens  # one packed row per GPU: its rope table's length
    job.activation_checkpoint.mode = "none"  # its default is selective: off, as this peer has run so far
    job.debug.seed = seed
    return job


def build_parallel(m, attention: str, job, device):
    """The model on `device` as torchtitan's Trainer builds it under torchrun (module
    docstring) and the autocast its step runs under. torchtitan's
    `init_distributed` starts NCCL, or keeps the process group already started."""
    import torch
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
    from torchtitan.tools.utils import set_default_dtype

    world_size = dist_utils.init_distributed(job.comm)
    ep = job.parallelism.expert_parallel_degree
    if world_size % ep or m.num_experts % ep:
        raise UserError(f"--ep {ep} must divide the {world_size} ranks and the {m.num_experts} experts")
    p = job.parallelism
    parallel_dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                                 cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
                                 pp=p.pipeline_parallel_degree, ep=ep, etp=p.expert_tensor_parallel_degree,
                                 world_size=world_size)
    parallel_dims.build_mesh()
    dist_utils.set_determinism(parallel_dims, device, job.debug, distinct_seed_mesh_dims=["pp"])

    args = mixtral_args(m, attention)
    args.update_from_config(job)
    with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]):
        model = Qwen3Model(args)
    model = parallelize_qwen3(model, parallel_dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    amp = dist_utils.maybe_enable_amp(parallel_dims, job.training.mixed_precision_param, device.type)
    return model, amp


def run(args, cfg) -> dict:
    import torch

    from te_mixtral.distributed.layout import shutdown
    from te_mixtral.measure.metrics import train_flops

    m, world = cfg.model, int(os.environ.get("WORLD_SIZE", "1"))
    tokens = rows_per_gpu(cfg, world) * cfg.data.seq_len  # one GPU's
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
    job = job_config(ep, args.dtype, tokens, cfg.train.seed)  # seeds every rank alike, as its trainer does
    model, amp = build_parallel(m, args.attention, job, device)
    rank = torch.distributed.get_rank()
    header = common.run_header(device, torchtitan=package_version("torchtitan"), world_size=world,
                               expert_parallel=ep)
    if rank == 0:
        print(common.header_line(header), flush=True)
    o = job.optimizer  # its default AdamW: betas 0.9, 0.95, weight decay 0.1, fused
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=True)

    rows = rank_rows(cfg, args, device, rank, world)
    # Global FLOPs: every rank's rows (their documents differ), summed once before the timing.
    flops = torch.tensor([train_flops(m, r["cu_seq_lens_q"].cpu(), tokens) for r in rows], dtype=torch.float64,
                         device=device)
    torch.distributed.all_reduce(flops)
    result = timed_steps(
        lambda batch: train_step(model, optimizer, batch, amp), [titan_inputs(r) for r in rows], args, cfg, header,
        flops.tolist(), device, world,
        {"attention": args.attention, "expert_parallel": ep,
         "experts": "GroupedExperts (torch._grouped_mm), ExpertParallel all-to-all", "dtype": args.dtype,
         "optimizer": f"torch.optim.AdamW(fused=True), FSDP2 {args.dtype} parameters, bf16 compute"})
    shutdown(wait_for_peers=True)  # no rank tears its connections down under a peer still at work
    return result if rank == 0 else None


def check_args(args) -> None:
    check_model_peer(args)
    if args.ep is not None and args.ep <= 0:
        raise UserError(f"--ep must be positive, got {args.ep}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_peer_flags(parser)
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: every rank)")
    parser.add_argument("--attention", choices=ATTENTION, default="flex",
                        help="torchtitan's attention backend (default: flex, FlexAttention with its document mask)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="torchtitan's training.dtype: of parameters, gradients and AdamW states (default: "
                             "float32, its default; compute is bf16 either way)")
    add_run_flags(parser)
    return peer_main("torchtitan_peer", parser.parse_args(argv), check_args, run,
                     lambda w: f"torchtitan MoE ({w['num_hidden_layers']} layers, EP {w['expert_parallel']} of "
                               f"{w['world_size']} GPUs, {w['tokens_per_step_per_gpu']} tokens/step/GPU, "
                               f"{w['attention']})")


if __name__ == "__main__":
    sys.exit(main())
