"""What LoRA's frozen FP8 base costs in accuracy against a BF16 base: one fixed batch.

Two models from one seed, built as a run builds them (`training.loop.build_model`, Mixtral-8x7B's
shapes at a few layers, LoRA r=16 on every target): `custom_grouped` over the base in BF16,
and `device_mxfp8` over the same base quantised to FP8 as it loads (Hopper's row-wise E4M3,
experts/quant/frozen_fp8.py). The adapters are the same, B drawn at random (zero, as training
starts, would leave A without a gradient). On one packed batch it prints, as relative
Frobenius errors of the FP8 model against the BF16 one: the logits, the loss, and the
gradients of the adapters (benchmarks/lora_base_compare.py). The loss curves of whole runs are
compared by `scripts/gpu_runs.py lora`.

    python3 -m benchmarks.lora_fp8_base [--layers 4] [--tokens 8192]

Needs a Hopper GPU.
"""

import argparse
import sys

from benchmarks import common
from benchmarks.lora_base_compare import CONFIG, batch_ids, error_rows, refusal, run
from te_mixtral.measure.report import format_table

BF16, FP8 = {"tier": "custom_grouped"}, {"tier": "device_mxfp8"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    if problem := refusal(CONFIG, [BF16, FP8], [args.layers], args.tokens, "cuda"):
        print(f"lora_fp8_base: error: {problem}", file=sys.stderr)
        return 2
    device = common.cuda_or_refuse("lora_fp8_base")
    if device is None:
        return 2
    print(common.header_line(common.run_header(device)))
    ids = batch_ids(32000, args.tokens, device)
    bf16 = run(BF16, args.layers, ids)
    fp8 = run(FP8, args.layers, ids)
    print(f"FP8 base against BF16 base, Mixtral-8x7B shapes, {args.layers} layers, {args.tokens} tokens, LoRA r=16; "
          "relative Frobenius errors")
    print(format_table(error_rows(fp8, bf16), header=("quantity", "fp8 vs bf16")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
