"""What LoRA's frozen NF4 base costs in accuracy against a BF16 base, beside bitsandbytes' NF4.

Three models from one seed on one fixed batch (benchmarks/lora_base_compare.py: Mixtral-8x7B's
shapes at 1 and 4 layers, LoRA r=16 on every target, tier custom_grouped):

- `bf16`: the base in BF16, the reference;
- `ours`: `--lora.base nf4`, the experts quantised to NF4 as they load and dequantised inside
  the grouped GEMMs (experts/quant/frozen_nf4.py);
- `bitsandbytes`: the BF16 model with every expert weight replaced by its bitsandbytes NF4
  round trip (`quantize_4bit` / `dequantize_4bit`, block 64, no double quantisation): QLoRA's
  reference error on the same weights. Mixtral's rows are multiples of 64 wide, so its blocks
  are ours; the two should agree closely.

It prints, against `bf16`, the relative Frobenius error of the logits and of the adapters'
gradients (attention's, the experts'), the losses and the peak memory of each run.

    python3 -m benchmarks.nf4_accuracy [--layers 1 4] [--tokens 8192]
    python3 -m benchmarks.nf4_accuracy --config configs/tiny.yaml --tokens 256   # CPU, ours only

bitsandbytes' functions need CUDA: without a GPU (or without bitsandbytes) its column is
skipped with one line.
"""

import argparse
import importlib.util
import sys

import torch

from benchmarks import common
from benchmarks.lora_base_compare import CONFIG, batch_ids, error_rows, refusal, run
from te_mixtral.config import load_config
from te_mixtral.measure.report import format_table

BF16 = {"tier": "custom_grouped", "lora.rank": "16"}  # rank 16 on a config without LoRA (tiny.yaml) too
NF4 = {**BF16, "lora.base": "nf4"}


def bitsandbytes_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "bitsandbytes' quantize_4bit needs a CUDA GPU"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    return None


@torch.no_grad()
def bitsandbytes_round_trip(model) -> None:
    """Every expert weight of `model` (a BF16 base) replaced by its bitsandbytes NF4 round trip."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    for layer in model.model.layers:
        for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            for expert in weight:  # [N, I], contiguous: rows of a multiple of 64 block as ours do
                packed, state = quantize_4bit(expert, blocksize=64, quant_type="nf4", compress_statistics=False)
                expert.copy_(dequantize_4bit(packed, state, blocksize=64, quant_type="nf4"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--config", default=CONFIG, help="the model and LoRA settings (default: %(default)s)")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if problem := refusal(args.config, [BF16, NF4], args.layers, args.tokens, device.type):
        print(f"nf4_accuracy: error: {problem}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        print(common.header_line(common.run_header(device)))
    ids = batch_ids(load_config(args.config, {}).model.vocab_size, args.tokens, device)
    skip = bitsandbytes_unavailable(device)
    for layers in args.layers:
        bf16 = run(BF16, layers, ids, args.config)
        columns = {"ours": run(NF4, layers, ids, args.config)}
        if skip is None:
            columns["bitsandbytes"] = run(BF16, layers, ids, args.config,
                                          prepare=bitsandbytes_round_trip)
        rows = {name: error_rows(other, bf16) for name, other in columns.items()}
        table = [(quantity, *(rows[name][i][1] for name in columns)) for i, (quantity, _) in enumerate(rows["ours"])]
        print(f"NF4 bases against the BF16 base, {args.config}, {layers} layers, {args.tokens} tokens on "
              f"{device.type}; relative Frobenius errors")
        print(format_table(table, header=("quantity", *(f"{name} NF4 vs bf16" for name in columns))))
    if skip is not None:
        print(f"skipped bitsandbytes: {skip}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
