"""Host time against GPU time of the custom_grouped op and of grouped_mm, fwd+bwd, at few rows.

With few rows per expert a single op's GPU work is shorter than the host's work of launching
it, and a timing loop of single ops (`do_bench`, as custom_grouped_bench.py uses) then
measures the host. This script tells the two apart at Mixtral-8x7B shapes:

- host: wall time a call of 200 in a row, the host launching as fast as it can;
- GPU: time a call of 50 that the host queued behind a long spin kernel first, so the GPU
  never waits for a launch (custom_grouped_ops.gpu_ms);
- op: the median of `do_bench` over single calls, as custom_grouped_bench.py times the op.

`--loads` adds ours with TMA descriptors forced on and off; `--tiles medium` adds ours with
that regime's tile table at every case (the default picks one by rows per expert; repeat
it for more tables; `previous` is the tables before the few-rows ones, chosen as then);
`--cprofile` adds a cProfile of 100 calls of ours at the first case: where the host time goes.

    python3 -m benchmarks.custom_grouped_host_time [--cases 1x64,2x16,4x64,179+77] [--loads]
        [--tiles previous --tiles medium ...] [--cprofile]
"""

import argparse
import cProfile
import functools
import io
import pstats
import sys
import time

import torch

from benchmarks import common
from benchmarks.common import FAMILIES
from benchmarks.custom_grouped_ops import (
    TABLE_NAMES,
    bench,
    fwd_bwd,
    gpu_ms,
    make_inputs,
    parse_cases,
    with_table,
)
from te_mixtral.experts.custom_grouped import grouped_mm_swiglu
from te_mixtral.experts.kernels import grouped_swiglu as gs

D, F = FAMILIES["8x7b"].hidden, FAMILIES["8x7b"].ffn
HOST_CALLS = 200


def host_ms(fn) -> float:
    """Wall ms a call of HOST_CALLS in a row. Not benchmarks/common.py's timer: what is
    measured is the host's launching, which timing each call apart would hide."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * host / HOST_CALLS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1x64,2x16,4x64",
                        help="LxR (local experts x rows per expert) or R0+R1+... (rows of each expert)")
    parser.add_argument("--cprofile", action="store_true", help="profile the host side of ours at the first case")
    parser.add_argument("--loads", action="store_true", help="also ours with TMA descriptors forced on and off")
    parser.add_argument("--tiles", action="append", default=[],
                        help="also ours with this regime's tile table at every case (repeatable)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.tiles if name not in TABLE_NAMES]
    if unknown:
        print(f"custom_grouped_host_time: error: no tile table {unknown[0]!r}; the tables are "
              f"{', '.join(TABLE_NAMES)}", file=sys.stderr)
        return 2
    try:
        cases = parse_cases(args.cases)
    except ValueError:
        print(f"custom_grouped_host_time: error: --cases takes LxR or R0+R1+... joined by commas; got "
              f"{args.cases}", file=sys.stderr)
        return 2
    device = common.cuda_or_refuse("custom_grouped_host_time")
    if device is None:
        return 2
    print(common.header_line(common.run_header(device)))
    print("custom_grouped vs grouped_mm, fwd+bwd at 8x7B shapes: ms a call")
    for index, (case, sizes) in enumerate(cases.items()):
        x, counts, w1, w2, dy = make_inputs(None, len(sizes), D, F, requires_grad=True, sizes=sizes)
        ops = {"ours": gs.grouped_swiglu, "grouped_mm": grouped_mm_swiglu}
        if args.loads:
            ops["ours, TMA"] = functools.partial(gs.grouped_swiglu, use_tma=True)
            ops["ours, pointers"] = functools.partial(gs.grouped_swiglu, use_tma=False)
        for name in args.tiles:
            ops[f"ours, {name} tiles"] = with_table(name)
        for name, op in ops.items():
            fn = fwd_bwd(op, x, counts, w1, w2, dy)
            for _ in range(20):  # compile, warm up
                fn()
            print(f"  {case:>6} {name:<24} host {host_ms(fn):.3f}  GPU {gpu_ms(fn):.3f}  op {bench(fn):.3f}",
                  flush=True)
        if args.cprofile and index == 0:
            ours = fwd_bwd(gs.grouped_swiglu, x, counts, w1, w2, dy)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(100):
                ours()
            profiler.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
            print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
