"""The FP8 casts of the `fp8-hopper` mode alone (te_mixtral/experts/quant/fp8_cast.py), at
Mixtral-8x7B sizes, for each tile shape of the column-wise and weight casts.

Shape suffixes: see te_mixtral/__init__.py (Q rows, F expert FFN width, D hidden, L experts).

Each line is a kernel's time (benchmarks/common.py's timer: median after warm-up, CUDA
events) and, where given, the
bytes it moves over that time: a cast that reads bf16 twice and writes FP8 once moves 5 bytes
per element, the weight cast (two reads, two FP8 copies) 6. The fastest tile is what
`fp8_cast.COLUMN_TILE` and `WEIGHT_TILE` hold.

    python3 -m benchmarks.fp8_casts

Needs a CUDA GPU.
"""

import argparse
import sys

import torch

from benchmarks import common
from benchmarks.common import FAMILIES, median_ms
from te_mixtral.experts.quant import fp8_cast

Q, L = 16384, 8  # 4 experts of 4096 rows; the weights of 8 local experts
F, D = FAMILIES["8x7b"].ffn, FAMILIES["8x7b"].hidden
TILES = [(64, 64, 4), (128, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8), (32, 128, 4), (256, 64, 8)]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    device = common.cuda_or_refuse("fp8_casts")
    if device is None:
        return 2

    print(common.header_line(common.run_header(device)))
    gate_up_Q2F = torch.randn(Q, 2 * F, device=device, dtype=torch.bfloat16)
    x_QD = torch.randn(Q, D, device=device, dtype=torch.bfloat16)
    ends = torch.arange(1, 5, device=device, dtype=torch.int32) * (Q // 4)
    w_L2FD = torch.randn(L, 2 * F, D, device=device, dtype=torch.bfloat16)
    row_scale_Q = torch.rand(Q, device=device) + 0.5
    for tile in TILES:
        fp8_cast.COLUMN_TILE = tile
        ms = median_ms(lambda: fp8_cast.quantize_columns(gate_up_Q2F, ends), device)
        ms_x = median_ms(lambda: fp8_cast.quantize_columns(x_QD, ends), device)
        ms_x_scaled = median_ms(lambda: fp8_cast.quantize_columns(x_QD, ends, row_scale_Q=row_scale_Q), device)
        print(f"columns {tile}: [Q, 2F] {ms:.3f} ms ({Q * 2 * F * 5 / ms / 1e6:.0f} GB/s)  "
              f"[Q, D] {ms_x:.3f} ms, its rows scaled {ms_x_scaled:.3f} ms", flush=True)
    for tile in TILES:
        fp8_cast.WEIGHT_TILE = tile
        ms = median_ms(lambda: fp8_cast.quantize_weight(w_L2FD), device)
        print(f"weight {tile}: [L, 2F, D] {ms:.3f} ms ({w_L2FD.numel() * 6 / ms / 1e6:.0f} GB/s)", flush=True)
    print(f"rows, SwiGLU of [Q, 2F] {median_ms(lambda: fp8_cast.quantize_rows(gate_up_Q2F, swiglu=True), device):.3f} ms")
    print(f"rows, [Q, D] {median_ms(lambda: fp8_cast.quantize_rows(x_QD), device):.3f} ms")
    dh_QF = torch.randn(Q, F, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: fp8_cast.swiglu_backward_rows(dh_QF, gate_up_Q2F), device)
    print(f"SwiGLU backward's row cast {ms:.3f} ms ({Q * F * 8 / ms / 1e6:.0f} GB/s)")
    q_Q2F = fp8_cast.quantize_rows(gate_up_Q2F)[0]
    ms = median_ms(lambda: fp8_cast.transpose(q_Q2F), device)
    print(f"transpose of an FP8 [Q, 2F] {ms:.3f} ms ({Q * 2 * F * 2 / ms / 1e6:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
