"""BF16 expert FFN, fwd+bwd: custom_grouped and the other expert tiers against the best of TE and grouped_mm over a grid.

The grid: local experts (1, 2, 4, 8) x tokens per expert (16 to 16384) x splits (uniform;
skewed, one expert taking 70 % of the rows; one expert empty), at Mixtral-8x7B or 8x22B
shapes. The peers: TE's grouped GEMM as the `grouped_linear` tier runs it
(`te_grouped_swiglu`, skipped with a line saying why where TE cannot run) and
`torch.nn.functional.grouped_mm` with plain autograd.

Beside them, each other expert tier as a training step calls it (`--tiers`, by default all:
`loop`, `grouped_linear` paying its own device-to-host sync for the split sizes, and
`device_mxfp8` with its run config's defaults, so BF16 `custom_grouped` kernels under its
break-even and FP8 above it), with its own ratio to the best peer and to the floor. A tier
that cannot run here is left out with one line saying why. Above its break-even
`device_mxfp8` runs FP8: its floor ratio there is against the BF16 bytes, and its FP8
weights, made at the first call, serve every later one (the weights do not change), as
they serve a step's later micro-batches; `benchmarks/fp8_break_even.py` times the step of
one micro-batch. The floor bound is asked only at 512 rows per expert or fewer, where it
runs BF16.

Two times per op and point (custom_grouped_ops.py has both timers):
- step: wall time a call of calls back to back, the host launching as fast as it can, as a
  training step that runs the op sees it (host time included; `step_ms`). A point's ratio
  is the best peer's step time over ours: above 1 we are faster.
- GPU: time a call with the host's launches queued ahead (`gpu_ms`), the kernels alone.
TE gets its split sizes as a host list for free; the tier pays a device-to-host sync for them.
A tier that waits for its split sizes on the host (`loop`, `grouped_linear`) cannot queue
ahead, so its GPU time holds those waits.

Each point also gets its floors, from the copy bandwidth and matmul rate measured at the
start of the run (benchmarks/common.py): the bandwidth floor is the bytes one fwd+bwd moves
(`custom_grouped_ops.op_bytes`: each weight read by the forward and by the data gradient,
each weight gradient written, and the activations) over the copy bandwidth; the compute
floor its FLOPs over the matmul rate. `x floor` is our step time over the bandwidth floor;
past a few hundred rows per expert the compute floor is the higher, and `x roofline` is our
step time over the higher of the two. Each point prints how far any op's output and three
gradients lie from grouped_mm's (the largest relative Frobenius difference), so a column
that computed something else shows, and an op that fails is named with its error while the
rest run on.

`--tiles NAME` adds ours with one tile table at every point (`previous`: the tables before
the few-rows ones, chosen by size as then; shown only where they differ from today's),
to try a table against the one `regime` picks. The kernels every point needs are compiled
first, in parallel (`custom_grouped_ops.precompile`).

    python3 -m benchmarks.custom_grouped_grid --family 8x7b|8x22b [--experts 1,2,4,8]
        [--tokens 16,32,...] [--splits uniform,skewed,empty] [--tiles NAME ...]
        [--tiers loop,grouped_linear,device_mxfp8|none] [--json FILE]
"""

import argparse
import json
import sys
from dataclasses import replace

import torch

from benchmarks import common
from benchmarks.common import FAMILIES, split_by_fractions
from benchmarks.custom_grouped_ops import (
    OPS,
    TABLE_NAMES,
    fwd_bwd,
    gpu_ms,
    make_inputs,
    op_bytes,
    op_flops,
    precompile,
    step_ms,
    table_at,
    with_table,
)
from te_mixtral.config import ModelConfig, RunConfig
from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.custom_grouped import grouped_mm_swiglu
from te_mixtral.experts.grouped_linear import GroupedLinearTier, te_grouped_swiglu
from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, grouped_swiglu, regime, uses_descriptors
from te_mixtral.experts.registry import EXPERT_TIERS, make_tier

TOKENS = "16,32,64,128,256,1024,4096,16384"
SPLITS = ("uniform", "skewed", "empty")
PEERS = ("grouped_mm", "TE")
# The expert tiers timed beside ours (custom_grouped's op is "ours").
TIERS = tuple(name for name in EXPERT_TIERS if name != "custom_grouped")
TARGET = 0.97  # "never behind": at least this fraction of the best peer's speed
FLOOR_TARGET = 1.3  # at most this many times the bandwidth floor ...
FLOOR_ROWS = 512  # ... up to this many rows per expert
TIMED_GPU_S = 0.25  # GPU seconds per timed point, so large points take a few calls
MAX_CALLS = 50
SPIN_CYCLES = int(4e8)  # about 0.2 s: longer than the host needs to queue MAX_CALLS calls at few rows
STEP_S = 0.1  # wall seconds of back-to-back calls per step time
COPY_BYTES = 2**30
MATMUL_N = 8192


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


def run_config(tier: str, family: str) -> RunConfig:
    """A run config's defaults for `tier` at `family`'s widths: the tier's options as a run
    that sets none of them gets them."""
    dims = FAMILIES[family]
    return RunConfig(tier=tier, model=replace(ModelConfig(), hidden_size=dims.hidden, intermediate_size=dims.ffn))


def tier_ops(names: list[str], family: str) -> dict:
    """{"<name> tier": the tier's call} for each tier of `names` that can run here, built as
    a run builds it (`run_config`); a tier that cannot run here is left out with one line
    saying why."""
    ops = {}
    for name in names:
        tier = make_tier(name, run_config(name, family))
        try:
            tier.check_available(torch.device("cuda"))
        except TierUnavailable as error:
            print(f"tier {name} skipped: {error}")
            continue
        ops[f"{name} tier"] = tier
    return ops


def tier_ratios(ms: dict, best_peer_ms: float, floor_ms: float) -> dict:
    """{tier: {"ratio": best peer's step time / the tier's, "floor_ratio": the tier's step
    time / the bandwidth floor}} for each tier timed at a point."""
    return {name.removesuffix(" tier"): {"ratio": best_peer_ms / value, "floor_ratio": value / floor_ms}
            for name, value in ms.items() if name.endswith(" tier")}


def time_op(fn) -> tuple[float, float]:
    """(step ms, GPU ms) a call of `fn`."""
    for _ in range(3):  # compile, warm up
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once_ms = begin.elapsed_time(end)
    gpu = gpu_ms(fn, max(3, min(MAX_CALLS, int(1e3 * TIMED_GPU_S / once_ms))), SPIN_CYCLES)
    return step_ms(fn, max(5, min(200, int(1e3 * STEP_S / max(gpu, 0.05))))), gpu


def point_ops(ops: dict, tiles: list[str], sizes: list[int]) -> dict:
    """The ops timed at a point: ours, the peers, and ours with each `--tiles` table, where
    that is not the table ours runs there anyway."""
    rows, experts = sum(sizes), len(sizes)
    ours = CONFIGS[regime(rows, experts)]
    return {**ops, **{f"ours, {name}": with_table(name) for name in tiles
                      if table_at(name, rows, experts) != ours}}


def point(ops: dict, te, sizes: list[int], dims) -> dict:
    """Step and GPU ms of each op at one point, and each op's largest relative difference
    from grouped_mm's in y and the three gradients (a check that every op computed the same
    thing; grouped_mm runs first)."""
    x, counts, w1, w2, dy = make_inputs(None, len(sizes), *dims, requires_grad=True, sizes=sizes)
    ops = {"grouped_mm": ops["grouped_mm"], **ops}
    if te is not None:
        ops["TE"] = lambda x, counts, w1, w2: te(x, sizes, w1, w2)
    step, gpu, diffs, errors, reference = {}, {}, {}, {}, None
    for name, op in ops.items():
        try:
            y = op(x, counts, w1, w2)
            got = (y.detach(), *torch.autograd.grad(y, (x, w1, w2), dy))
            reference = reference or got
            diffs[name] = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, reference))
            del y, got
            step[name], gpu[name] = time_op(fwd_bwd(op, x, counts, w1, w2, dy))
        except Exception as error:  # one op that cannot run here must not cost the others
            errors[name] = common.first_line(error)
    return {"ms": step, "gpu_ms": gpu, "rel_diff": diffs, "errors": errors}


def kernel_jobs(tiles: list[str], points: list[list[int]]) -> list[tuple]:
    """(GEMM, config, rows per expert, experts) for `precompile`: one for each kernel that ours
    and the `--tiles` tables run at `points`, a kernel being a GEMM's config compiled for an
    expert count (BLOCK_L, and L == 1 alone) and a load path (TMA or pointers)."""
    jobs = {}
    for sizes in points:
        rows, experts = sum(sizes), len(sizes)
        for table in (CONFIGS[regime(rows, experts)], *(table_at(name, rows, experts) for name in tiles)):
            for op in OPS:
                kernel = json.dumps((op, table[op], experts, uses_descriptors(rows, experts)), sort_keys=True)
                jobs.setdefault(kernel, (op, table[op], max(1, rows // experts), experts))
    return list(jobs.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="8x7b")
    parser.add_argument("--experts", default="1,2,4,8")
    parser.add_argument("--tokens", default=TOKENS, help="tokens per expert (the mean, for uneven splits)")
    parser.add_argument("--splits", default=",".join(SPLITS))
    parser.add_argument("--tiles", action="append", default=[],
                        help="also ours with this tile table at every point (repeatable; not a peer)")
    parser.add_argument("--tiers", default=",".join(TIERS),
                        help="the other expert tiers timed beside ours, as a training step calls them (none: no tier)")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    kinds = args.splits.split(",")
    counts = {flag: value.split(",") for flag, value in (("--experts", args.experts), ("--tokens", args.tokens))}
    unknown = [name for name in args.tiles if name not in TABLE_NAMES]
    tiers = [] if args.tiers == "none" else args.tiers.split(",")
    error = None
    if any(name not in TIERS for name in tiers):
        error = f"--tiers takes none or any of {', '.join(TIERS)} joined by commas; got {args.tiers}"
    elif any(kind not in SPLITS for kind in kinds):
        error = f"--splits takes {', '.join(SPLITS)}; got {args.splits}"
    elif any(not n.isdigit() or int(n) < 1 for values in counts.values() for n in values):
        error = f"--experts and --tokens take positive integers joined by commas; got {args.experts} and {args.tokens}"
    elif unknown:
        error = f"no tile table {unknown[0]!r}; the tables are {', '.join(TABLE_NAMES)}"
    if error:
        print(f"custom_grouped_grid: error: {error}", file=sys.stderr)
        return 2
    device = common.cuda_or_refuse("custom_grouped_grid")
    if device is None:
        return 2
    expert_counts, token_counts = ([int(n) for n in values] for values in counts.values())
    D, F = FAMILIES[args.family].hidden, FAMILIES[args.family].ffn
    points = [(kind, tokens, sizes) for kind in kinds for tokens in token_counts for experts in expert_counts
              if (sizes := split_sizes(kind, experts, tokens)) is not None]
    te, why_not = te_peer()
    if te is None:
        print(f"TE skipped: {why_not}")
    header = common.run_header(device)
    print(common.header_line(header))
    precompile(kernel_jobs(args.tiles, [sizes for _, _, sizes in points]))
    bandwidth = common.copy_bandwidth_gbs(COPY_BYTES, device)
    peak = common.matmul_peak_tflops(MATMUL_N, device)
    header |= {"copy_bandwidth_gbs": bandwidth, "matmul_tflops": peak}
    print(f"measured: device copy {bandwidth:.0f} GB/s (read + write, {COPY_BYTES >> 20} MiB), "
          f"bf16 matmul {MATMUL_N}^3 {peak:.0f} TFLOP/s")
    print(f"custom_grouped against the best of {'grouped_mm' if te is None else 'TE and grouped_mm'}, fwd+bwd, "
          f"Mixtral-{args.family} (D {D}, F {F}), ms a call: step (host included) / GPU (host queued ahead)")
    ops = {"ours": grouped_swiglu, "grouped_mm": grouped_mm_swiglu, **tier_ops(tiers, args.family)}
    results = []
    for kind, tokens, sizes in points:
        found = point(point_ops(ops, args.tiles, sizes), te, sizes, (D, F))
        floor_ms = op_bytes(sizes, D, F) / (bandwidth * 1e6)
        compute_ms = op_flops(sizes, D, F) / (peak * 1e9)
        entry = {"split": kind, "tokens": tokens, "experts": len(sizes), "sizes": sizes,
                 "bytes": op_bytes(sizes, D, F), "flops": op_flops(sizes, D, F),
                 "floor_ms": floor_ms, "compute_floor_ms": compute_ms, **found}
        peers = {k: v for k, v in found["ms"].items() if k in PEERS}
        ours, ours_gpu = found["ms"].get("ours"), found["gpu_ms"].get("ours")
        if peers and ours:
            best = min(peers, key=peers.get)
            entry |= {"best_peer": best, "ratio": peers[best] / ours,
                      "gpu_ratio": found["gpu_ms"][best] / ours_gpu,
                      "floor_ratio": ours / floor_ms, "roofline_ratio": ours / max(floor_ms, compute_ms),
                      "tiers": tier_ratios(found["ms"], peers[best], floor_ms)}
        results.append(entry)
        print("  " + point_line(entry), flush=True)
        torch.cuda.empty_cache()
    print_summary(results, args.family, expert_counts, kinds, token_counts, tiers)
    common.write_json(args.json, {"header": header, "family": args.family, "points": results})
    return 0


def point_line(r: dict) -> str:
    times = "  ".join(f"{k} {v:.3f}/{r['gpu_ms'][k]:.3f}" for k, v in r["ms"].items())
    failed = "".join(f"  {k} FAILED: {why}" for k, why in r["errors"].items())
    head = f"{r['split']:>7} {r['tokens']:>5} x {r['experts']}  {times}"
    if "ratio" not in r:
        return head + failed
    behind = "  BEHIND" if r["ratio"] < TARGET else ""
    diff = f"  diff {max(r['rel_diff'].values()):.1e}" if r["rel_diff"] else ""
    return (f"{head}  ratio {r['ratio']:.2f} ({r['best_peer']}){behind}  GPU ratio {r['gpu_ratio']:.2f}  "
            f"floor {r['floor_ms']:.3f} x{r['floor_ratio']:.2f}  compute {r['compute_floor_ms']:.3f} "
            f"x{r['roofline_ratio']:.2f}{diff}{failed}")


def print_summary(results: list[dict], family: str, expert_counts: list[int], kinds: list[str],
                  token_counts: list[int], tiers: list[str] = ()) -> None:
    timed = [r for r in results if "ratio" in r]
    columns = [("ours", lambda r, key: r.get(key))]
    columns += [(f"{name} tier", lambda r, key, name=name: r["tiers"].get(name, {}).get(key)) for name in tiers]
    for label, value in columns:
        for key, what in (("ratio", "best peer's step time / its"), ("floor_ratio", "its step time / bandwidth floor")):
            print(f"\n{label}: {key} ({what}), Mixtral-{family}; columns: local experts")
            print(f"| split | tokens/expert | {' | '.join(map(str, expert_counts))} |")
            print(f"| --- | ---: |{' ---: |' * len(expert_counts)}")
            for kind in kinds:
                for tokens in token_counts:
                    cells = {r["experts"]: f"{value(r, key):.2f}" for r in timed
                             if (r["split"], r["tokens"]) == (kind, tokens) and value(r, key) is not None}
                    if cells:
                        print(f"| {kind} | {tokens} | {' | '.join(cells.get(n, '—') for n in expert_counts)} |")
    failed = [r for r in results if r["errors"]]
    if failed:
        print(f"\n{len(failed)} points with an op that failed: "
              + "; ".join(f"{r['split']} {r['tokens']} x {r['experts']}: {', '.join(r['errors'])}" for r in failed))
    if not timed:
        return
    print()
    for label, value in columns:
        ratios = [(r, value(r, "ratio"), value(r, "floor_ratio")) for r in timed if value(r, "ratio") is not None]
        if not ratios:
            continue
        behind = [r for r, ratio, _ in ratios if ratio < TARGET]
        worst, lowest, _ = min(ratios, key=lambda found: found[1])
        print(f"{label}: {len(behind)} of {len(ratios)} points below {TARGET} of the best peer, host time included; "
              f"the lowest {lowest:.2f} at {worst['split']} {worst['tokens']} x {worst['experts']} "
              f"(against {worst['best_peer']})")
        few = [(r, floor) for r, _, floor in ratios if r["tokens"] <= FLOOR_ROWS]
        over = [(r, floor) for r, floor in few if floor > FLOOR_TARGET]
        if few:
            print(f"{label}: {len(over)} of {len(few)} points of at most {FLOOR_ROWS} rows per expert above "
                  f"{FLOOR_TARGET}x the bandwidth floor" + (": " + ", ".join(
                      f"{r['split']} {r['tokens']} x {r['experts']} x{floor:.2f}" for r, floor in over) if over else ""))


if __name__ == "__main__":
    sys.exit(main())
