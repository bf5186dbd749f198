"""What LoRA's frozen FP8 base costs in accuracy against a BF16 base: one fixed batch.

Two models from one seed, built as a run builds them (`training.loop.build_model`, Mixtral-8x7B's
shapes at a few layers, LoRA r=16 on every target): `custom_grouped` over the base in BF16,
and `device_mxfp8` over the same base quantised to FP8 as it loads (Hopper's row-wise E4M3,
experts/quant/frozen_fp8.py). The adapters are the same, B drawn at random (zero, as training
starts, would leave A without a gradient). On one packed batch it prints, as relative
Frobenius errors of the FP8 model against the BF16 one: the logits, the loss, and the
gradients of the adapters. The loss curves of whole runs are compared by `scripts/gpu_runs.py lora`.

    python3 -m benchmarks.lora_fp8_base [--layers 4] [--tokens 8192]

Needs a Hopper GPU.
"""

import argparse
import sys

import torch

from benchmarks import common
from te_mixtral.config import load_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.measure.report import format_table
from te_mixtral.model.layers import PackedSequences
from te_mixtral.model.mixtral import causal_lm_loss
from te_mixtral.training.loop import build_model

SINGLE = Layout(0, 1, 1, None, None)


def run(tier: str, layers: int, tokens: int, ids: torch.Tensor):
    cfg = load_config("configs/mixtral-8x7b-lora.yaml", {"tier": tier, "model.num_hidden_layers": str(layers),
                                                         "seq_len": str(tokens), "device": "cuda"})
    # This run's own peak: what an earlier run left (its logits and gradients, kept for the
    # comparison) is not counted.
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model, _ = build_model(cfg, SINGLE, torch.device("cuda"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.normal_(0.0, 0.02, generator=torch.Generator("cuda").manual_seed(len(name)))
    packed = PackedSequences(torch.arange(tokens, device="cuda")[None], torch.tensor([0, tokens], dtype=torch.int32,
                                                                                     device="cuda"), tokens)
    with torch.autocast("cuda", torch.bfloat16):
        logits = model(ids, packed)
    loss = causal_lm_loss(logits, ids.roll(-1, 1), torch.tensor(float(tokens), device="cuda"))
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    del model
    torch.cuda.empty_cache()
    return logits.float(), loss.item(), grads, peak


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    device = common.cuda_or_refuse("lora_fp8_base")
    if device is None:
        return 2
    print(common.header_line(common.run_header(device)))
    ids = torch.randint(0, 32000, (1, args.tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    bf16 = run("custom_grouped", args.layers, args.tokens, ids)
    fp8 = run("device_mxfp8", args.layers, args.tokens, ids)
    rows = [("logits", f"{rel(fp8[0], bf16[0]):.3e}"), ("loss", f"{bf16[1]:.5f} -> {fp8[1]:.5f}")]
    for kind in ("self_attn", "experts"):
        names = [n for n in bf16[2] if kind in n]
        num = sum((fp8[2][n] - bf16[2][n]).square().sum() for n in names).sqrt()
        den = sum(bf16[2][n].square().sum() for n in names).sqrt()
        rows.append((f"adapter gradients ({kind}, {len(names)} tensors)", f"{(num / den).item():.3e}"))
    rows.append(("peak GiB (bf16 base -> fp8 base)", f"{bf16[3]:.2f} -> {fp8[3]:.2f}"))
    print(f"FP8 base against BF16 base, Mixtral-8x7B shapes, {args.layers} layers, {args.tokens} tokens, LoRA r=16; "
          "relative Frobenius errors")
    print(format_table(rows, header=("quantity", "fp8 vs bf16")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
