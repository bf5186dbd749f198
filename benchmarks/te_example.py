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

Timing and figures use our own code (te_mixtral/measure/metrics.py): each step between
synchronised host clocks (`StepTimer`), the first `--warmup` steps left out, median step
time, model TFLOP/s per GPU from `train_flops` (the same formula, attention counted per
document, so the figure compares with our runs'), tokens/s, and peak memory
(`torch.cuda.max_memory_allocated`, over the whole run).

Copy the example first (no network needed at bench time), then, from the repository root,
on a CUDA machine with Transformer Engine, transformers and accelerate:

    scripts/fetch_te_example.sh PATH/TO/TransformerEngine        # -> .peers/te_mixtral_example
    python3 -m benchmarks.te_example --example-dir .peers/te_mixtral_example \\
        [--config configs/mixtral-8x7b-8layer.yaml] [--steps 30] [--warmup 5] [--json out.json]
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

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


def thd_row(input_ids, cu_seqlens, max_length: int) -> dict:
    """One THD row as the example's `DataCollatorWithFlattening` packs it."""
    import torch

    labels = input_ids.clone()  # transformers' loss shifts them itself
    labels[:, cu_seqlens[1:-1].long()] = -100  # no predicting one document's first token from the last
    return {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids),
            "cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_length,
            "max_length_k": max_length}


def our_rows(cfg, steps: int, device) -> list[dict]:
    """The rows our run of this config trains on at each step: same tokens, same documents."""
    from te_mixtral.data.packing import PackedData

    data = PackedData(cfg.data, cfg.train.batch_size, 0, 1, cfg.train.seed)
    rows = []
    for step in range(steps):
        (batch,) = data.micro_batches(step)
        rows.append(thd_row(batch.input_ids.reshape(1, -1).to(device),
                            batch.packed.cu_seqlens.to(device), batch.packed.max_seqlen))
    return rows


def random_rows(cfg, steps: int, doc_len: int, generator, device) -> list[dict]:
    """Rows of random tokens in documents of `doc_len` tokens."""
    import torch

    samples, seq_len = cfg.train.batch_size, cfg.data.seq_len
    tokens = samples * seq_len
    starts = [s * seq_len + d for s in range(samples) for d in range(0, seq_len, doc_len)]
    cu_seqlens = torch.tensor(starts + [tokens], dtype=torch.int32, device=device)
    return [thd_row(torch.randint(cfg.model.vocab_size, (1, tokens), generator=generator, device=device),
                    cu_seqlens, min(doc_len, seq_len)) for _ in range(steps)]


def run(args, cfg) -> dict:
    # Heavy imports only once the arguments are known to be good: a mistake is refused at once.
    import torch
    from accelerate import Accelerator
    from transformers import get_linear_schedule_with_warmup

    from te_mixtral.measure.metrics import (
        StepTimer,
        device_name,
        peak_flops,
        peak_memory_bytes,
        summarize,
        train_flops,
    )
    from te_mixtral.measure.report import software_versions
    from te_mixtral.te_support import require_te

    m, seq_len, samples = cfg.model, cfg.data.seq_len, cfg.train.batch_size
    if not torch.cuda.is_available():
        raise UserError("the TE example needs a CUDA GPU, and none is visible")
    require_te()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(cfg.train.seed)

    # --- the model, optimizer and schedule, as the example's run_finetune_ep.py builds them at EP 1
    model = build_model(load_example(args.example_dir), m, device)
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

    summary = summarize(timer.times, args.warmup, samples * seq_len, 1, flops, peak_flops(device_name(device)),
                        peak_memory_bytes(device))
    commit_file = args.example_dir / "COMMIT"
    return {
        "header": {"device": device_name(device), "versions": software_versions(),
                   "te_example_commit": commit_file.read_text().strip() if commit_file.is_file() else None,
                   "example_dir": str(args.example_dir)},
        "workload": {"config": args.config, "num_hidden_layers": m.num_hidden_layers, "tokens_per_step":
                     samples * seq_len, "rows": "ours" if args.doc_len is None else f"random, {args.doc_len}-token documents", "steps": args.steps, "timing_warmup_steps": args.warmup,
                     "lr": cfg.train.lr, "optimizer": "torch.optim.AdamW(fused=True, foreach=False), bf16 parameters",
                     "expert_ffn_mode": "grouped_op"},
        "summary": summary,
        "step_ms": [t * 1e3 for t in timer.times],
        "loss": losses,
        "flops_per_step": flops,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example-dir", type=Path, required=True, help="a copy of TE's docs/examples/te_mixtral")
    parser.add_argument("--config", default="configs/mixtral-8x7b-8layer.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--doc-len", type=int, default=None, help="random tokens in documents of this length (default: our run's rows)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        if not 0 <= args.warmup < args.steps:
            raise UserError(f"--warmup {args.warmup} must leave some of the --steps {args.steps} to time")
        if args.doc_len is not None and args.doc_len <= 0:
            raise UserError(f"--doc-len must be positive, got {args.doc_len}")
        check_example_dir(args.example_dir)
        result = run(args, load_config(args.config))
    except UserError as error:
        print(f"te_example: error: {error}", file=sys.stderr)
        return 2
    w = result["workload"]
    report(f"TE example ({w['num_hidden_layers']} layers, {w['tokens_per_step']} tokens/step)", result, args.json)
    return 0


def report(peer: str, result: dict, json_path: Path | None) -> None:
    """A peer run's one-line summary (`peer` names what ran), and its JSON where asked for."""
    s = result["summary"]
    mfu = f"{100 * s['mfu']:.0f}%" if s["mfu"] is not None else "n/a"
    print(f"{peer} on {result['header']['device']}: median {s['median_step_ms']:.1f} ms/step, "
          f"{s['tflops_per_gpu']:.0f} TFLOP/s/GPU (MFU {mfu}), {s['tokens_per_s']:.0f} tokens/s, "
          f"peak {s['peak_memory_gib']:.1f} GiB, loss {result['loss'][0]:.3f} -> {result['loss'][-1]:.3f}")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
