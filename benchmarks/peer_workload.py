"""The workload the peer benchmarks train on, and how they report it.

te_example.py (TE's own example), peft_peer.py (transformers + PEFT), torchtitan_peer.py
(torchtitan's MoE) and megatron_peer.py (Megatron-Core's) train a peer at our workload: one
packed row per GPU per step, either the rows our own run of the config trains on (`our_rows`:
same tokens, same document edges, each data-parallel rank its own) or random tokens in
documents of one length (`random_rows`; `rank_rows` picks by `--doc-len`), in the THD layout
TE's `DataCollatorWithFlattening` yields (`thd_row`); `document_positions` gives the
per-document positions transformers and torchtitan take instead of the edges. `rows_per_gpu` is
a GPU's share of the global batch; `check_steps` refuses the step counts and document length none
can run; `summarize_steps` turns the timed steps into our runs' figures
(te_mixtral/measure/metrics.py); `report` prints a peer run's one-line summary and writes its
--json.

The model peers (torchtitan's, Megatron-Core's) share their command line and their run's frame:
`add_model_peer_flags` and `add_run_flags` (the flags), `workload_config` (our config with
them), `peer_main` (refusals in one line, then the run and its report) and `timed_steps` (each
step timed as our runs time one, and the result every peer writes).

torch is imported inside the functions: the peers refuse bad arguments before it loads.
"""

import sys
from pathlib import Path

from benchmarks.common import add_json_flag, write_json
from te_mixtral.config import load_config
from te_mixtral.errors import UserError


def add_model_peer_flags(parser) -> None:
    """`--config` and `--layers`: the workload of the peers that build a model from our config."""
    parser.add_argument("--config", default="configs/mixtral-8x7b-8layer.yaml")
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the config's)")


def add_run_flags(parser) -> None:
    """`--steps`, `--warmup`, `--doc-len` and `--json` as every peer takes them."""
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--doc-len", type=int, default=None,
                        help="random tokens in documents of this length (default: our run's rows)")
    add_json_flag(parser)


def check_steps(args) -> None:
    """`--steps`, `--warmup` and `--doc-len` as every peer takes them."""
    if not 0 <= args.warmup < args.steps:
        raise UserError(f"--warmup {args.warmup} must leave some of the --steps {args.steps} to time")
    if args.doc_len is not None and args.doc_len <= 0:
        raise UserError(f"--doc-len must be positive, got {args.doc_len}")


def check_model_peer(args) -> None:
    """`check_steps`, and `--layers` as the peers that build a model from our config take it
    (`--json` is checked as it is read: benchmarks/common.py's `json_path`)."""
    check_steps(args)
    if args.layers is not None and args.layers <= 0:
        raise UserError(f"--layers must be positive, got {args.layers}")


def workload_config(args):
    """Our config of the workload: the file's, with `--layers` (and `--batch-size`, where a
    peer takes it)."""
    overrides = {"num_hidden_layers": args.layers, "batch_size": getattr(args, "batch_size", None)}
    return load_config(args.config, {key: str(value) for key, value in overrides.items() if value is not None})


def peer_main(script: str, args, check, run, describe, workload=workload_config) -> int:
    """A model peer's main after parsing: `check(args)` and our config (`workload(args)`)
    refuse bad input in one line (exit 2) before `run(args, cfg)` imports anything heavy;
    rank 0's result is reported (`describe` names the run from its workload)."""
    try:
        check(args)
        cfg = workload(args)
        result = run(args, cfg)
    except UserError as error:
        print(f"{script}: error: {error}", file=sys.stderr)
        return 2
    if result is not None:
        report(describe(result["workload"]), result, args.json)
    return 0


def thd_row(input_ids, cu_seqlens, max_length: int) -> dict:
    """One THD row as the example's `DataCollatorWithFlattening` packs it."""
    import torch

    labels = input_ids.clone()  # transformers' loss shifts them itself
    labels[:, cu_seqlens[1:-1].long()] = -100  # no predicting one document's first token from the last
    return {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids),
            "cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_length,
            "max_length_k": max_length}


def document_positions(cu_seqlens):
    """Each token's position in its own document, restarting at 0 at each document edge:
    [1, T] for a row of T tokens. How transformers and torchtitan see packed documents."""
    import torch

    cu_seqlens = cu_seqlens.long()
    starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff())
    return (torch.arange(int(cu_seqlens[-1]), device=starts.device) - starts).unsqueeze(0)


def our_rows(cfg, steps: int, device, rank: int = 0, world_size: int = 1) -> list[dict]:
    """The rows our run of this config trains on at each step, on `rank` of `world_size`
    data-parallel ranks: same tokens, same documents."""
    from te_mixtral.data.packing import PackedData

    data = PackedData(cfg.data, cfg.train.batch_size, rank, world_size, cfg.train.seed)
    rows = []
    for step in range(steps):
        (batch,) = data.micro_batches(step)
        rows.append(thd_row(batch.input_ids.reshape(1, -1).to(device),
                            batch.packed.cu_seqlens.to(device), batch.packed.max_seqlen))
    return rows


def rows_per_gpu(cfg, world_size: int) -> int:
    """The packed rows each GPU trains per step: `train.batch_size` is the global batch, as in
    our runs, split over the GPUs."""
    if cfg.train.batch_size % world_size:
        raise UserError(f"train.batch_size {cfg.train.batch_size} does not split over {world_size} GPUs")
    return cfg.train.batch_size // world_size


def random_rows(cfg, steps: int, doc_len: int, generator, device, world_size: int = 1) -> list[dict]:
    """One GPU's rows of random tokens in documents of `doc_len` tokens."""
    import torch

    samples, seq_len = rows_per_gpu(cfg, world_size), cfg.data.seq_len
    tokens = samples * seq_len
    starts = [s * seq_len + d for s in range(samples) for d in range(0, seq_len, doc_len)]
    cu_seqlens = torch.tensor(starts + [tokens], dtype=torch.int32, device=device)
    return [thd_row(torch.randint(cfg.model.vocab_size, (1, tokens), generator=generator, device=device),
                    cu_seqlens, min(doc_len, seq_len)) for _ in range(steps)]


def rank_rows(cfg, args, device, rank: int = 0, world_size: int = 1) -> list[dict]:
    """This rank's rows for `--steps`: our run's (`our_rows`), or with `--doc-len` random
    documents, seeded by the config's seed and the rank."""
    import torch

    if args.doc_len is None:
        return our_rows(cfg, args.steps, device, rank, world_size)
    generator = torch.Generator(device).manual_seed(cfg.train.seed + rank)
    return random_rows(cfg, args.steps, args.doc_len, generator, device, world_size)


def timed_steps(step, batches: list, args, cfg, header: dict, flops: list[float], device, world_size: int,
                workload: dict) -> dict:
    """`step(batch)` (one training step; its loss, on the device) for each batch, each timed
    as our runs time a step, and the peer's result: `header`, the workload (the fields every
    peer has, then the peer's own `workload`), the summary, each step's time, loss and
    global FLOPs (`flops`, summed over the ranks)."""
    from te_mixtral.measure.metrics import StepTimer

    # warm-up and timed steps are the same step
    timer, losses = StepTimer(device), []
    for batch in batches:
        with timer.step():
            loss = step(batch)
        losses.append(loss.item())
    m, tokens = cfg.model, rows_per_gpu(cfg, world_size) * cfg.data.seq_len
    return {
        "header": header,
        "workload": {"config": args.config, "num_hidden_layers": m.num_hidden_layers, "tokens_per_step_per_gpu": tokens,
                     "rows": "ours" if args.doc_len is None else f"random, {args.doc_len}-token documents",
                     "steps": args.steps, "timing_warmup_steps": args.warmup, "lr": cfg.train.lr,
                     "world_size": world_size, **workload},
        "summary": summarize_steps(timer.times, args.warmup, tokens * world_size, flops, device, world_size),
        "step_ms": [t * 1e3 for t in timer.times],
        "loss": losses,
        "flops_per_step": flops,
    }


def summarize_steps(step_s: list[float], warmup: int, tokens_per_step: int, flops: list[float], device,
                    world_size: int = 1) -> dict:
    """Median step time, tokens/s, model TFLOP/s and MFU per GPU and this GPU's peak memory
    (`warmup` steps left out), as our runs' summaries give them; `tokens_per_step` and
    `flops` are summed over the `world_size` GPUs."""
    from te_mixtral.measure.metrics import (
        device_name,
        peak_flops,
        peak_memory_bytes,
        summarize,
    )

    return summarize(step_s, warmup, tokens_per_step, world_size, flops, peak_flops(device_name(device)),
                     peak_memory_bytes(device))


def report(peer: str, result: dict, json_path: Path | None) -> None:
    """A peer run's one-line summary (`peer` names what ran), and its JSON where asked for."""
    s = result["summary"]
    mfu = f"{100 * s['mfu']:.0f}%" if s["mfu"] is not None else "n/a"
    print(f"{peer} on {result['header']['device']}: median {s['median_step_ms']:.1f} ms/step, "
          f"{s['tflops_per_gpu']:.0f} TFLOP/s/GPU (MFU {mfu}), {s['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
          f"peak {s['peak_memory_gib']:.1f} GiB, loss {result['loss'][0]:.3f} -> {result['loss'][-1]:.3f}")
    write_json(json_path, result)
