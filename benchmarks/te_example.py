"""Transformer Engine's own te_mixtral example, trained at our workload: the peer our runs are measured against.

TE ships a Mixtral fine-tuning tutorial (github.com/NVIDIA/TransformerEngine,
docs/examples/te_mixtral/). This script imports its model class from a copy of that folder
and trains it the way the tutorial's `run_finetune_ep.py --improvement 2` does ("TE EP
BF16, GroupedLinear"), at one GPU (expert-parallel size 1), on the shapes of one of our
configs, so that the two can be timed in the same session on the same GPU:

- model: its `TEMixtralForCausalLM` built from its `TEMixtralConfig` (from our model config
  through transformers' `MixtralConfig`, as its `init_te_mixtral_model` builds it from a
  checkpoint's), `expert_ffn_mode="grouped_op"` (TE's `ops.GroupedLinear` + `SwiGLU` in one
  fusible `ops.Sequential`), bf16 parameters, its own random initialisation: no checkpoint,
  no network;
- input: what its `DataCollatorWithFlattening` yields, one packed THD row (`input_ids`,
  `labels`, `cu_seq_lens_q/k`, `max_length_q/k`) of `batch_size * seq_len` tokens, TE's
  fused attention with a `padding_causal` mask. By default the rows are our own run's:
  the tokens and document edges our data pipeline (te_mixtral/data/packing.py) gives each
  step of the config, so both models do the same attention work on the same text; with
  `--doc-len`, random tokens in documents of that length instead (labels of each
  document's first token set to -100, as its collator's `separator_id` does);
- step: as its `finetune_model` runs one, in the accelerate `Accelerator(mixed_precision=
  "bf16")` it wraps the model in (autocast; outputs converted to fp32): transformers'
  causal-LM loss inside the forward, `accelerator.backward`, then every step torch's
  `AdamW(fused=True, foreach=False)` over the bf16 parameters (its `build_adamw` at EP 1:
  moments in bf16 too, no fp32 master; its defaults otherwise), its linear warm-up
  schedule and `zero_grad`; no gradient clipping. Learning rate and warm-up come from our
  config. Its `utils.py` is not imported: it needs `datasets` at import time and a hub
  download to build the model. Its `_attn_implementation = "flash_attention_2"` is left
  out too: only transformers' attention reads it, not TE's, and flash-attn may be absent.

Timing and figures use our own code (te_mixtral/measure/metrics.py), not
benchmarks/common.py's timer: a whole training step is timed as our runs time theirs, so the
figures compare with our runs'. Each step between
synchronised host clocks (`StepTimer`), the first `--warmup` steps left out, median step
time, model TFLOP/s per GPU from `train_flops` (the same formula, attention counted per
document, so the figure compares with our runs'), tokens/s, and peak memory
(`torch.cuda.max_memory_allocated`, over the whole run).

`--splits-json FILE` writes the rows each local expert got in each MoE layer of each step
(`{"steps": [[[rows of expert 0, ...] for each layer] for each step]}`, forward calls
only), which `benchmarks/op_profile.py --cases-from FILE` times ours and TE's grouped GEMM
at, GEMM by GEMM: its router, not ours, decides them.

Copy the example first (no network needed at bench time), then, from the repository root,
on a CUDA machine with Transformer Engine, transformers and accelerate:

    scripts/fetch_te_example.sh PATH/TO/TransformerEngine        # -> .peers/te_mixtral_example
    python3 -m benchmarks.te_example --example-dir .peers/te_mixtral_example \\
        [--config configs/mixtral-8x7b-8layer.yaml] [--steps 30] [--warmup 5] [--json out.json] \\
        [--splits-json splits.json]
"""

import argparse
import importlib.util
import sys
from pathlib import Path

from benchmarks import common
from benchmarks.peer_workload import (
    check_steps,
    our_rows,
    random_rows,
    report,
    summarize_steps,
)
from te_mixtral.config import load_config
from te_mixtral.errors import UserError

# The example's modules that building its model imports, in import order: te_mixtral.py
# imports hf_to_te_weights by that bare name. Its te_mixtral.py is loaded under another name,
# since ours is called te_mixtral too.
EXAMPLE_MODULES = (("hf_to_te_weights", "hf_to_te_weights"), ("te_mixtral", "te_example_mixtral"))


def check_example_dir(example_dir: Path) -> None:
    missing = [f"{name}.py" for name, _ in EXAMPLE_MODULES if not (example_dir / f"{name}.py").is_file()]
    if missing:
        raise UserError(f"--example-dir {example_dir} lacks {', '.join(missing)}: copy TE's example there first "
                        f"(scripts/fetch_te_example.sh TE_REPO {example_dir})")


def load_example(example_dir: Path):
    """The example's te_mixtral.py as a module, without putting its folder on sys.path."""
    for name, module_name in EXAMPLE_MODULES:
        spec = importlib.util.spec_from_file_location(module_name, example_dir / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # before running it: its dataclasses look themselves up there
        spec.loader.exec_module(module)
    return module


def build_model(example, m, device):
    """Its `TEMixtralForCausalLM` at our model's shapes, randomly initialised, in bf16."""
    import torch

    from te_mixtral.model.hf_config import hf_config

    te_config = example.TEMixtralForCausalLM.config_class(**{**hf_config(m).to_dict(), "dtype": torch.bfloat16})
    te_config.expert_parallel_size = 1
    te_config.expert_ffn_mode = "grouped_op"
    te_config.moe_aux_loss_coeff = m.aux_loss_coef  # its name for the load-balancing weight
    model = example.TEMixtralForCausalLM(te_config).to(device=device, dtype=torch.bfloat16)
    model.config.use_cache = False
    return model


def record_splits(model) -> list[list[int]]:
    """Each forward call's rows per local expert, in call order, appended as the model runs:
    the example's MoE blocks hand `_expert_ffn` their split sizes as a host list."""
    calls = []
    for block in model.modules():
        if hasattr(block, "_expert_ffn"):
            def recorded(tokens, m_splits, expert_ffn=block._expert_ffn):
                calls.append([int(n) for n in m_splits])
                return expert_ffn(tokens, m_splits)
            block._expert_ffn = recorded
    return calls


def run(args, cfg) -> dict:
    # Heavy imports only once the arguments are known to be good: a mistake is refused at once.
    import torch
    from accelerate import Accelerator
    from transformers import get_linear_schedule_with_warmup

    from te_mixtral.measure.metrics import StepTimer, train_flops
    from te_mixtral.te_support import require_te

    m, seq_len, samples = cfg.model, cfg.data.seq_len, cfg.train.batch_size
    if not torch.cuda.is_available():
        raise UserError("the TE example needs a CUDA GPU, and none is visible")
    require_te()
    device = torch.device("cuda", torch.cuda.current_device())
    commit_file = args.example_dir / "COMMIT"
    header = common.run_header(device, example_dir=str(args.example_dir),
                               te_example_commit=commit_file.read_text().strip() if commit_file.is_file() else None)
    print(common.header_line(header), flush=True)
    torch.manual_seed(cfg.train.seed)

    # --- the model, optimizer and schedule, as the example's run_finetune_ep.py builds them at EP 1
    model = build_model(load_example(args.example_dir), m, device)
    splits = record_splits(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, fused=True, foreach=False)
    schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=cfg.train.warmup_steps,
                                               num_training_steps=args.steps)
    accelerator = Accelerator(mixed_precision="bf16")
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    model.train()

    if args.doc_len is None:
        batches = our_rows(cfg, args.steps, device)
    else:
        batches = random_rows(cfg, args.steps, args.doc_len, torch.Generator(device).manual_seed(cfg.train.seed),
                              device)
    flops = [train_flops(m, b["cu_seq_lens_q"].cpu(), samples * seq_len) for b in batches]

    # --- training: warm-up and timed steps are the same step
    timer, losses = StepTimer(device), []
    for batch in batches:
        with timer.step(), accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        losses.append(loss.item())

    summary = summarize_steps(timer.times, args.warmup, samples * seq_len, flops, device)
    return {
        "header": header,
        "workload": {"config": args.config, "num_hidden_layers": m.num_hidden_layers, "tokens_per_step":
                     samples * seq_len, "rows": "ours" if args.doc_len is None else f"random, {args.doc_len}-token documents", "steps": args.steps, "timing_warmup_steps": args.warmup,
                     "lr": cfg.train.lr, "optimizer": "torch.optim.AdamW(fused=True, foreach=False), bf16 parameters",
                     "expert_ffn_mode": "grouped_op"},
        "summary": summary,
        "step_ms": [t * 1e3 for t in timer.times],
        "loss": losses,
        "flops_per_step": flops,
        "expert_splits": [splits[i:i + m.num_hidden_layers] for i in range(0, len(splits), m.num_hidden_layers)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example-dir", type=Path, required=True, help="a copy of TE's docs/examples/te_mixtral")
    parser.add_argument("--config", default="configs/mixtral-8x7b-8layer.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--doc-len", type=int, default=None, help="random tokens in documents of this length (default: our run's rows)")
    parser.add_argument("--splits-json", type=common.json_path, default=None,
                        help="write the rows of each local expert in each MoE layer of each step here")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    try:
        check_steps(args)
        check_example_dir(args.example_dir)
        result = run(args, load_config(args.config))
    except UserError as error:
        print(f"te_example: error: {error}", file=sys.stderr)
        return 2
    common.write_json(args.splits_json, {"steps": result.pop("expert_splits")})
    w = result["workload"]
    report(f"TE example ({w['num_hidden_layers']} layers, {w['tokens_per_step']} tokens/step)", result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
