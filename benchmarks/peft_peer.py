"""transformers + PEFT LoRA on Mixtral, trained at our workload: the peer our LoRA runs are measured against.

What a transformers user runs to fine-tune Mixtral with LoRA, at the shapes of one of our
configs, on one GPU, so that it and our `--lora.rank` run can be timed in the same session
on the same GPU and tokens:

- model: transformers' `MixtralForCausalLM` from our config's model section
  (te_mixtral/model/hf_config.py), built straight on the GPU in bf16 (the whole 8x7B is
  93 GB in bf16: it is never materialised in fp32 or on the host), its own random
  initialisation: no checkpoint, no network. Its default experts implementation
  (`grouped_mm`), attention `flash_attention_2` where flash-attn imports, else `sdpa`, and
  gradient checkpointing on (`use_reentrant=False`), as PEFT's Mixtral recipes run it
  (`--no-gradient-checkpointing` turns it off, to compare with a run without recompute);
- adapters: PEFT's `LoraConfig` from our `lora` section as `--save-adapter` writes it
  (te_mixtral/lora_config.py's `peft_config`: by default `target_modules` q, k,
  v, o_proj, `target_parameters` `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`,
  dropout 0), then `get_peft_model`. Rank and alpha are the config's (rank 16 where the
  config trains every weight: that of `--lora.rank 16 --optimizer adamw` on our side), or
  `--rank` and `--alpha`. PEFT keeps the adapters in fp32
  (its `autocast_adapter_dtype`). An expert target adds `scale * B @ A` to the whole
  stacked weight [E, out, in] on every forward (its `ParamWrapper`): each layer writes a
  merged copy of its expert weights, and its backward computes the gradient of that whole
  merged weight (the weight-gradient GEMM a frozen base otherwise skips) to reach A and B;
- input: one packed row per step (`input_ids`, `labels`, and `position_ids` restarting at 0
  at each document: transformers' packed-sequence convention, with no `attention_mask`).
  By default the rows are our own run's (the same tokens and document edges as
  benchmarks/peer_workload.py's `our_rows`); with `--doc-len`, random tokens in documents of
  that length. Labels of each document's first token are -100. What attention covers:
  flash-attention takes the document edges from the position_ids (varlen, per-document
  causal work only); under sdpa transformers turns them into a block-diagonal causal mask,
  which is exact (each document attends to itself only), but SDPA given a dense mask cannot
  use its flash kernel nor skip masked blocks: it scores all T^2 (query, key) pairs of the
  row, twice the causal work of a row that is one document and more the shorter its
  documents, while the FLOPs counted below are the per-document causal pairs;
- step: under `torch.autocast(bf16)` (what the Trainer's `bf16=True` does: without it
  PEFT's fp32 adapters would run attention's adapter GEMMs in fp32), transformers' causal-LM
  loss from the forward (Mixtral's `output_router_logits` default, False: no load-balancing
  term, where our runs add theirs), `backward`, torch's `AdamW(fused=True)` over the
  trainable parameters at our config's lr, `zero_grad`; no schedule, no clipping.

On several GPUs (launched with `torchrun --nproc_per_node N`) it runs transformers' data
parallelism as its Trainer does: each GPU holds the whole bf16 base and trains on its own
row (our EP run's row of that rank, one sequence per GPU), the adapters' gradients averaged
by torch's `DistributedDataParallel`; figures are per GPU, from rank 0. That is the layout
where the base fits one GPU (an H200: 93 GB). Where it does not (two H100s), transformers'
way is `device_map="auto"`, the layers split over the GPUs with one of them working at a
time; this peer does not run that.

Timing and figures use our own code (te_mixtral/measure/metrics.py), as te_example.py, not
benchmarks/common.py's timer: a whole training step, as our runs time theirs:
median step time after `--warmup` steps, tokens/s, model TFLOP/s per GPU from `train_flops`
with our LoRA config (a frozen weight 4 FLOPs per parameter and token, an adapter 6,
attention per document: the same count as our LoRA runs'), peak memory.

From the repository root, on a CUDA machine with transformers and peft:

    python3 -m benchmarks.peft_peer [--config configs/mixtral-8x7b-8layer.yaml] [--layers N] \\
        [--rank R] [--alpha A] [--steps 30] [--warmup 5] [--doc-len L] [--json out.json]
    torchrun --standalone --nproc_per_node 2 -m benchmarks.peft_peer [...]
"""

import argparse
import contextlib
import importlib.util
import os
import sys

from benchmarks import common
from benchmarks.peer_workload import (
    add_model_peer_flags,
    add_run_flags,
    check_model_peer,
    document_positions,
    our_rows,
    random_rows,
    report,
    rows_per_gpu,
    summarize_steps,
)
from te_mixtral.config import load_config
from te_mixtral.errors import UserError

DEFAULT_RANK = 16  # where the config trains every weight: the rank our LoRA results pages use


def attention_implementation() -> str:
    """flash-attention where it imports (per-document varlen kernels), else SDPA."""
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"


def build_mixtral(cfg, device, dtype, attention: str = "sdpa", gradient_checkpointing: bool = True):
    """transformers' `MixtralForCausalLM` at `cfg.model`'s shapes, randomly initialised in
    `dtype` directly on `device` (module docstring)."""
    import torch
    from transformers import MixtralForCausalLM

    from te_mixtral.model.hf_config import hf_config

    with torch.device(device):  # built where it runs: no host copy, no fp32 copy
        model = MixtralForCausalLM._from_config(hf_config(cfg.model), dtype=dtype, attn_implementation=attention)
    model.config.use_cache = False
    if gradient_checkpointing:
        # The name PEFT's recipes call; newer transformers warn that it became
        # `activation_checkpointing_enable`, which older ones lack.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def add_peft_adapters(model, cfg):
    """`model` under PEFT's LoRA for `cfg.lora`, as `--save-adapter` describes it (module docstring)."""
    from peft import LoraConfig, get_peft_model

    from te_mixtral.lora_config import peft_config

    # adapter_config.json's fields, less the two that describe the file rather than the adapters.
    settings = {k: v for k, v in peft_config(cfg).items() if k not in ("peft_type", "base_model_name_or_path")}
    return get_peft_model(model, LoraConfig(**{**settings, "inference_mode": False}))


def build_peft_model(cfg, device, dtype, attention: str = "sdpa", gradient_checkpointing: bool = True):
    """`build_mixtral`'s model with PEFT's LoRA for `cfg.lora`."""
    return add_peft_adapters(build_mixtral(cfg, device, dtype, attention, gradient_checkpointing), cfg)


def packed_row(thd: dict) -> dict:
    """A THD row (peer_workload.py's `thd_row`) in transformers' packed-sequence convention:
    position_ids restarting at each document, and no attention_mask (with one, transformers
    would not look for the documents in the position_ids)."""
    return {"input_ids": thd["input_ids"], "labels": thd["labels"],
            "position_ids": document_positions(thd["cu_seq_lens_q"])}


def train_step(model, optimizer, batch: dict, autocast_dtype=None):
    """One step as a transformers + PEFT user's loop runs it; the loss, still on the device."""
    import torch

    device_type = batch["input_ids"].device.type
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def workload_config(args, world: int = 1):
    """Our config of the workload: the file's, with `--layers`, `--rank` and `--alpha`; on
    `world` GPUs, one sequence each (`train.batch_size` = world, as our EP runs)."""
    given = {"num_hidden_layers": args.layers, "lora.rank": args.rank, "lora.alpha": args.alpha,
             "train.batch_size": world if world > 1 else None}
    overrides = {key: str(value) for key, value in given.items() if value is not None}
    if args.rank is None and not load_config(args.config).lora.enabled:
        # A config that trains every weight: the workload of our LoRA run of it, which trains
        # fp32 adapters with plain AdamW (LoRA refuses master_adamw's bf16 parameters).
        overrides.update({"lora.rank": str(DEFAULT_RANK), "train.optimizer": "adamw"})
    return load_config(args.config, overrides)


def cuda_device(peer: str = "the transformers + PEFT peer"):
    """The GPU the peer runs on (torchrun's LOCAL_RANK'th under a launch); a one-line refusal
    on a machine without one."""
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{peer} needs a CUDA GPU, and none is visible")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cuda", torch.cuda.current_device())


def launched_world() -> int:
    """How many processes torchrun started (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run(args, cfg, device) -> dict:
    """Build, train `args.steps` steps and measure; the results as --json writes them.
    `device` is the GPU (a CPU runs it too, slowly, for the tests)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from te_mixtral.measure.metrics import StepTimer, train_flops

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    m, seq_len, samples = cfg.model, cfg.data.seq_len, rows_per_gpu(cfg, world)
    header = common.run_header(device)
    if rank == 0:
        print(common.header_line(header), flush=True)
    torch.manual_seed(cfg.train.seed)

    # --- the model and optimizer, as a transformers + PEFT user builds them
    attention = attention_implementation()
    model = build_peft_model(cfg, device, torch.bfloat16, attention, args.gradient_checkpointing)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, fused=True)
    if world > 1:  # as the Trainer wraps it: every rank the whole model, gradients averaged
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    if args.doc_len is None:
        rows = our_rows(cfg, args.steps, device, rank, world)
    else:
        generator = torch.Generator(device).manual_seed(cfg.train.seed + rank)
        rows = random_rows(cfg, args.steps, args.doc_len, generator, device, world)
    flops = [train_flops(m, r["cu_seq_lens_q"].cpu(), samples * seq_len, cfg.lora) for r in rows]
    batches = [packed_row(r) for r in rows]

    # --- training: warm-up and timed steps are the same step
    timer, losses = StepTimer(device), []
    for batch in batches:
        with timer.step():
            loss = train_step(model, optimizer, batch, torch.bfloat16)
        losses.append(loss.item())

    summary = summarize_steps(timer.times, args.warmup, samples * seq_len, flops, device)
    experts_implementation = (model.module if world > 1 else model).config._experts_implementation
    return {
        "header": header,
        "workload": {"config": args.config, "num_hidden_layers": m.num_hidden_layers,
                     "tokens_per_step": samples * seq_len,
                     "rows": "ours" if args.doc_len is None else f"random, {args.doc_len}-token documents",
                     "steps": args.steps, "timing_warmup_steps": args.warmup, "lr": cfg.train.lr,
                     "lora": {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": cfg.lora.target_list()},
                     "trainable_parameters": sum(p.numel() for p in trainable),
                     "attention": attention, "experts": experts_implementation,
                     "layout": f"DistributedDataParallel over {world} GPUs" if world > 1 else "one GPU",
                     "gradient_checkpointing": args.gradient_checkpointing,
                     "optimizer": "torch.optim.AdamW(fused=True), PEFT's fp32 adapters, bf16 frozen base, "
                                  "autocast bf16"},
        "summary": summary,
        "step_ms": [t * 1e3 for t in timer.times],
        "loss": losses,
        "flops_per_step": flops,
    }


def check_args(args) -> None:
    check_model_peer(args)
    if args.rank is not None and args.rank <= 0:
        raise UserError(f"--rank must be positive (this peer trains LoRA adapters), got {args.rank}")
    if args.alpha is not None and args.alpha <= 0:
        raise UserError(f"--alpha must be positive, got {args.alpha}")


def add_lora_flags(parser, recipes: str) -> None:
    """`--rank`, `--alpha` and `--gradient-checkpointing` (on by default, as `recipes` run it):
    the LoRA peers' own flags."""
    parser.add_argument("--rank", type=int, default=None,
                        help=f"LoRA rank r (default: the config's lora.rank, {DEFAULT_RANK} where that is 0)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="LoRA alpha, the scale's numerator (default: the config's lora.alpha)")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help=f"recompute each layer in the backward, as {recipes} do (default: on)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_peer_flags(parser)
    add_lora_flags(parser, "PEFT's recipes")
    add_run_flags(parser)
    args = parser.parse_args(argv)
    try:
        check_args(args)
        cfg = workload_config(args, launched_world())
        # Heavy imports only once the arguments are known to be good: a mistake is refused at once.
        device = cuda_device()
        with process_group(launched_world()) as rank:
            result = run(args, cfg, device)
    except UserError as error:
        print(f"peft_peer: error: {error}", file=sys.stderr)
        return 2
    if rank == 0:
        w = result["workload"]
        report(f"transformers + PEFT LoRA r{w['lora']['rank']} ({w['num_hidden_layers']} layers, "
               f"{w['tokens_per_step']} tokens/step per GPU, {w['attention']}, {w['experts']}, {w['layout']})", result,
               args.json)
    return 0


@contextlib.contextmanager
def process_group(world: int):
    """torchrun's processes joined for DistributedDataParallel (NCCL on GPUs, gloo on the CPU
    for the tests), left at the end; this process's rank (0 alone)."""
    import torch
    import torch.distributed as dist

    from te_mixtral.distributed.layout import shutdown

    if world == 1:
        yield 0
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    finished = False
    try:
        yield dist.get_rank()
        finished = True
    finally:
        shutdown(wait_for_peers=finished)  # after a good run, no rank tears gloo down under a peer


if __name__ == "__main__":
    sys.exit(main())
