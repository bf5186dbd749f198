"""BF16 expert FFN, fwd+bwd: custom_grouped against the best of TE and grouped_mm over a grid.

The grid: local experts (1, 2, 4, 8) x tokens per expert (16 to 16384) x splits (uniform;
skewed, one expert taking 70 % of the rows; one expert empty), at Mixtral-8x7B or 8x22B
shapes. The peers: TE's grouped GEMM as the `grouped_linear` tier runs it
(`te_grouped_swiglu`, skipped with a line saying why where TE cannot run) and
`torch.nn.functional.grouped_mm` with plain autograd.

Each time is GPU time per call with the host's launches queued ahead of the GPU
(`custom_grouped_ops.gpu_ms`), so at few rows it compares kernels, not Python. TE gets
its split sizes as a host list for free; the tier pays a device-to-host sync for them.
A point's ratio is the best peer's time over ours: above 1 we are faster. Each point also
prints how far any op's forward output lies from grouped_mm's (relative Frobenius), so a
column that computed something else shows. `--tiles NAME` adds ours with one tile table at
every point, to try a table against the one `regime` picks.

    python3 -m benchmarks.custom_grouped_grid --family 8x7b|8x22b [--experts 1,2,4,8]
        [--tokens 16,32,...] [--splits uniform,skewed,empty] [--tiles NAME ...] [--json FILE]
"""

import argparse
import sys

import torch

from benchmarks import common
from benchmarks.common import FAMILIES, split_by_fractions
from benchmarks.custom_grouped_ops import fwd_bwd, gpu_ms, make_inputs, with_table
from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.custom_grouped import grouped_mm_swiglu
from te_mixtral.experts.grouped_linear import GroupedLinearTier, te_grouped_swiglu
from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, grouped_swiglu

TOKENS = "16,32,64,128,256,1024,4096,16384"
SPLITS = ("uniform", "skewed", "empty")
TARGET = 0.97  # "never behind": at least this fraction of the best peer's speed
TIMED_GPU_S = 0.25  # GPU seconds per timed point, so large points take a few calls
MAX_CALLS = 50
SPIN_CYCLES = int(4e8)  # about 0.2 s: longer than the host needs to queue MAX_CALLS calls at few rows


def split_sizes(kind: str, experts: int, per_expert: int) -> list[int] | None:
    """Rows per expert of `kind` (None where it needs more experts than there are)."""
    if kind == "uniform":
        return [per_expert] * experts
    if experts < 2:
        return None
    rest = [1 / (experts - 1)] * (experts - 1)
    shares = [0.7] + [0.3 * r for r in rest] if kind == "skewed" else rest + [0.0]
    return split_by_fractions(experts * per_expert, tuple(shares))


def te_peer():
    """`te_grouped_swiglu` (host split sizes first), or None and the reason TE cannot run:
    the `grouped_linear` tier's own check."""
    try:
        GroupedLinearTier().check_available(torch.device("cuda"))
    except TierUnavailable as error:
        return None, str(error)
    return te_grouped_swiglu, None


def time_op(fn) -> float:
    for _ in range(3):  # compile, warm up
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(3, min(MAX_CALLS, int(1e3 * TIMED_GPU_S / begin.elapsed_time(end))))
    return gpu_ms(fn, calls, SPIN_CYCLES)


def point(ops: dict, te, tokens: int, sizes: list[int], dims) -> dict:
    """GPU ms of each op at one point, and the largest relative difference of an op's
    forward output from grouped_mm's (a check that every op computed the same thing)."""
    x, counts, w1, w2, dy = make_inputs(tokens, len(sizes), *dims, requires_grad=True, sizes=sizes)
    ops = dict(ops)
    if te is not None:
        ops["TE"] = lambda x, counts, w1, w2: te(x, sizes, w1, w2)
    times, outputs = {}, {}
    for name, op in ops.items():
        with torch.no_grad():
            outputs[name] = op(x, counts, w1, w2).float()
        times[name] = time_op(fwd_bwd(op, x, counts, w1, w2, dy))
    reference = outputs["grouped_mm"]
    error = max(float((out - reference).norm() / reference.norm()) for out in outputs.values())
    return {"ms": times, "forward_rel_diff": error}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="8x7b")
    parser.add_argument("--experts", default="1,2,4,8")
    parser.add_argument("--tokens", default=TOKENS, help="tokens per expert (the mean, for uneven splits)")
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--tiles", action="append", default=[],
                        help="also ours with this tile table at every point (repeatable; not a peer)")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    kinds = args.splits.split(",")
    counts = {flag: value.split(",") for flag, value in (("--experts", args.experts), ("--tokens", args.tokens))}
    unknown = [name for name in args.tiles if name not in CONFIGS]
    error = None
    if any(kind not in SPLITS for kind in kinds):
        error = f"--splits takes {', '.join(SPLITS)}; got {args.splits}"
    elif any(not n.isdigit() or int(n) < 1 for values in counts.values() for n in values):
        error = f"--experts and --tokens take positive integers joined by commas; got {args.experts} and {args.tokens}"
    elif unknown:
        error = f"no tile table {unknown[0]!r}; the tables are {', '.join(CONFIGS)}"
    if error:
        print(f"custom_grouped_grid: error: {error}", file=sys.stderr)
        return 2
    device = common.cuda_or_refuse("custom_grouped_grid")
    if device is None:
        return 2
    expert_counts, token_counts = ([int(n) for n in values] for values in counts.values())
    dims = FAMILIES[args.family].hidden, FAMILIES[args.family].ffn
    ops = {"ours": grouped_swiglu, "grouped_mm": grouped_mm_swiglu}
    for name in args.tiles:
        ops[f"ours, {name}"] = with_table(name)
    te, why_not = te_peer()
    if te is None:
        print(f"TE skipped: {why_not}")
    header = common.run_header(device)
    print(common.header_line(header))
    print(f"custom_grouped against the best of {'grouped_mm' if te is None else 'TE and grouped_mm'}, fwd+bwd, "
          f"Mixtral-{args.family} (D {dims[0]}, F {dims[1]}), GPU ms a call with the host queued ahead")
    results = []
    for kind in kinds:
        for tokens in token_counts:
            for experts in expert_counts:
                sizes = split_sizes(kind, experts, tokens)
                if sizes is None:
                    continue
                found = point(ops, te, tokens, sizes, dims)
                peers = {k: v for k, v in found["ms"].items() if not k.startswith("ours")}
                best = min(peers, key=peers.get)
                ratio = peers[best] / found["ms"]["ours"]
                results.append({"split": kind, "tokens": tokens, "experts": experts, "sizes": sizes,
                                "best_peer": best, "ratio": ratio, **found})
                times = "  ".join(f"{k} {v:.3f}" for k, v in found["ms"].items())
                print(f"  {kind:>7} {tokens:>5} x {experts}  {times}  ratio {ratio:.2f} ({best})"
                      f"{'  BEHIND' if ratio < TARGET else ''}  fwd diff {found['forward_rel_diff']:.1e}",
                      flush=True)
        torch.cuda.empty_cache()
    print(f"\nratio (best peer's time / ours), Mixtral-{args.family}; columns: local experts")
    print(f"| split | tokens/expert | {' | '.join(map(str, expert_counts))} |")
    print(f"| --- | ---: |{' ---: |' * len(expert_counts)}")
    for kind in kinds:
        for tokens in token_counts:
            cells = {r["experts"]: f"{r['ratio']:.2f}" for r in results if (r["split"], r["tokens"]) == (kind, tokens)}
            if cells:
                print(f"| {kind} | {tokens} | {' | '.join(cells.get(n, '—') for n in expert_counts)} |")
    behind = [r for r in results if r["ratio"] < TARGET]
    worst = min(results, key=lambda r: r["ratio"])
    print(f"\n{len(behind)} of {len(results)} points below {TARGET}; the lowest {worst['ratio']:.2f} at "
          f"{worst['split']} {worst['tokens']} x {worst['experts']} (against {worst['best_peer']})")
    common.write_json(args.json, {"header": header, "family": args.family, "points": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
