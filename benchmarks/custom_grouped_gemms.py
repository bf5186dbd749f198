"""Each of custom_grouped's six GEMMs alone at training shapes, tile by tile: which tile-table
entry is fastest, checked against torch, beside cuBLAS and grouped_mm on the same shapes.

    python3 -m benchmarks.custom_grouped_gemms [--cases 8x2048,4x4096,179+77] [--gemms down_wgrad,...]
        [--rounds 3] [--margin 0.02] [--budget-s 300] [--json OUT]

A case `LxR` is L local experts of R rows each at Mixtral-8x7B width (8x2048 is one GPU
holding all 8 experts of a layer with one 8192-token sequence, top-2: the GEMMs of the
8-layer step beside TE's example; 4x4096 a rank at EP=2 with two sequences; 1x64 a rank at
EP=8 with few tokens); `R0+R1+...` gives each expert's rows, for uneven splits (179+77: 256
rows over two experts, 70/30). The six GEMMs are grouped_swiglu.py's: the forward's gate/up
with SwiGLU in its epilogue and its down projection, the data gradients of down (SwiGLU's
gradient in its epilogue) and of gate/up, and the two weight gradients; `--gemms` runs some
of them only. For each it runs

- every candidate tile of the case's tile table (`custom_grouped_ops.candidates`, with the
  table's own pick, marked `(table)`): first once on fresh operands, its results checked
  against torch's, computed expert by expert in float64 (`reference`): a tile whose relative
  error passes TOLERANCE is named with it and not timed, as is one that fails to compile or
  launch; then timed;
- the peers on the same operands, each the plain GEMM without our fused SwiGLU epilogues:
  cuBLAS, `torch.mm` once per expert (what TE's example runs), and
  `torch.nn.functional.grouped_mm` (`torch._grouped_mm`: one grouped GEMM, its offsets on
  the device).

Timing: `custom_grouped_ops.bench` (Triton's do_bench: a GEMM alone from a cold L2). The
same config timed in two calls has differed by up to 10 %, so a GEMM's tiles and peers are
timed in turn, `--rounds` times, and each keeps its median: a drift of the clocks within the
call falls on all of them alike.

It prints, per case and GEMM, a table headed by the GEMM's bytes floor (the bytes it moves,
`custom_grouped_ops.gemm_bytes`, at the copy bandwidth measured at the start of the run):
ms, TFLOP/s, `x table` (the table pick's time over this one's: above 1 faster) and the
check's error; per case the GEMMs' sum, the table's picks against the fastest tiles and the
peers, beside the bf16 matmul rate measured in the same run; and last the tile-table entries
the run would pick, per table its cases ran: each GEMM's `tile_config(...)`, a tile other
than the table's only where it is faster by `--margin` or more summed over that table's
cases, to paste into grouped_swiglu.CONFIGS. `--budget-s` leaves the tiles not yet started
after that many seconds unrun (the table says so) but the table's picks and the peers, so
that a call with a time limit still prints its sums and picks. The kernels are compiled
first, in parallel (`custom_grouped_ops.precompile`), as each case launches them.
"""

import argparse
import inspect
import itertools
import json
import math
import statistics
import sys
import time

import torch

from benchmarks import common
from benchmarks import custom_grouped_ops as cb
from benchmarks.common import FAMILIES
from benchmarks.custom_grouped_grid import COPY_BYTES
from te_mixtral.experts.base import swiglu
from te_mixtral.experts.grouped_mm import grouped_matmul, grouped_wgrad, offsets
from te_mixtral.experts.kernels import grouped_swiglu as gs
from te_mixtral.experts.kernels.schedule import tile_config
from te_mixtral.experts.kernels.tma_host import tma_ok

D, F = FAMILIES["8x7b"].hidden, FAMILIES["8x7b"].ffn
# The largest relative Frobenius error a tile's results may have. bf16: rounding each result
# to bf16 alone leaves up to 2e-3 (2**-9, half its last place); a wrong index or a missed tile
# or block of rows lands far above. fp32 (the interpreter's tests): tf32x3 dots land near 1e-7.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
WHAT = {"gate_up": "the forward's gate/up, SwiGLU in the epilogue", "down": "the forward's down",
        "down_dgrad": "down's data gradient, SwiGLU's gradient in the epilogue",
        "down_wgrad": "down's weight gradient", "gate_up_dgrad": "gate/up's data gradient",
        "gate_up_wgrad": "gate/up's weight gradient"}
# Each GEMM as the plain one the peers run: (A, B, form) of `gemm_operands`' tensors; NT is
# A's rows of e @ B[e].T, NN A's rows of e @ B[e], TN (a weight gradient) A's rows of e,
# transposed, @ B's rows of e.
PLAIN = {"gate_up": ("x", "w1", "NT"), "down": ("act", "w2", "NT"), "down_dgrad": ("dy", "w2", "NN"),
         "down_wgrad": ("dy", "act", "TN"), "gate_up_dgrad": ("h", "w1", "NN"), "gate_up_wgrad": ("h", "x", "TN")}
PEERS = ("cuBLAS mm", "grouped_mm")
TABLE = " (table)"
# tile_config's keyword arguments and the configuration keys they set.
_KEYWORDS = {"progs": "PROGS_PER_SM", "group": "GROUP_M", "parts": "EPI_PARTS", "flatten": "FLATTEN",
             "tail_split": "TAIL_SPLIT"}


# --- tiles ------------------------------------------------------------------------------


def tile_name(c: dict) -> str:
    """A tile in one short line, every field that tells two configs apart in it."""
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_I']} w{c['num_warps']} s{c['num_stages']} g{c['GROUP_M']}"
            f"{' p' + str(c['PROGS_PER_SM']) if c['PROGS_PER_SM'] > 1 else ''}{' flat' if c['FLATTEN'] else ''} e{c['EPI_PARTS']}"
            f"{' k' + str(c['TAIL_SPLIT']) if c['TAIL_SPLIT'] > 1 else ''}")


def tile_source(c: dict) -> str:
    """The `tile_config(...)` call that makes c, its defaults left out: what a tile table holds."""
    defaults = inspect.signature(tile_config).parameters
    args = [str(c[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_I", "num_warps", "num_stages")]
    args += [f"{keyword}={c[key]!r}" for keyword, key in _KEYWORDS.items() if c[key] != defaults[keyword].default]
    return f"tile_config({', '.join(args)})"


def case_tiles(op: str, sizes: list[int]) -> tuple[dict[str, dict], str]:
    """The tiles to try for GEMM `op` at a case, {name: config}, the table's pick first; and its name."""
    regime = gs.regime(sum(sizes), len(sizes))
    pick = gs.CONFIGS[regime][op]
    tiles = {tile_name(pick): pick}
    for c in cb.candidates(regime, op):
        tiles.setdefault(tile_name(c), c)
    return tiles, tile_name(pick)


# --- the check --------------------------------------------------------------------------


def reference(op: str, t: dict) -> tuple[torch.Tensor, ...]:
    """GEMM `op`'s results (custom_grouped_ops.GEMM_OUTPUTS) on operands `t`, computed by torch
    expert by expert in float64; SwiGLU's gradient by autograd through `swiglu`, the loop
    tier's activation, not by the kernel's formula."""
    ends = list(itertools.accumulate(t["counts"].tolist()))
    wide = [torch.zeros(t[name].shape, dtype=torch.float64, device=t[name].device) for name in cb.GEMM_OUTPUTS[op]]
    for e, rows in enumerate(slice(start, end) for start, end in zip([0, *ends[:-1]], ends)):
        if rows.start == rows.stop:  # an expert without rows: zero weight gradient, no rows
            continue
        if op == "gate_up":
            h = t["x"][rows].double() @ t["w1"][e].double().T
            wide[0][rows], wide[1][rows] = h, swiglu(h)
        elif op == "down":
            wide[0][rows] = t["act"][rows].double() @ t["w2"][e].double().T
        elif op == "down_dgrad":
            h = t["h"][rows].double().requires_grad_()
            with torch.enable_grad():
                act = swiglu(h)
                wide[0][rows] = torch.autograd.grad(act, h, t["dy"][rows].double() @ t["w2"][e].double())[0]
            wide[1][rows] = act.detach()
        elif op == "down_wgrad":
            wide[0][e] = t["dy"][rows].double().T @ t["act"][rows].double()
        elif op == "gate_up_dgrad":
            wide[0][rows] = t["h"][rows].double() @ t["w1"][e].double()
        else:  # gate_up_wgrad
            wide[0][e] = t["h"][rows].double().T @ t["x"][rows].double()
    return tuple(wide)


def relative_error(got, want) -> float:
    """The largest ||got - want|| / ||want|| over the results, in float64, a block of rows at a
    time (no float64 copy of a whole result). NaN where a result holds NaN."""
    errors = []
    for g, w in zip(got, want, strict=True):
        diff = sum(((a.double() - b).norm() ** 2).item()
                   for a, b in zip(g.reshape(-1, g.shape[-1]).split(4096), w.reshape(-1, w.shape[-1]).split(4096)))
        errors.append(math.sqrt(diff) / max(w.norm().item(), 1e-300))
    return math.nan if any(map(math.isnan, errors)) else max(errors)


def checked(op: str, t: dict, launch, want) -> float:
    """Run a tile's `launch` once and return its results' `relative_error`. Its results are
    poisoned with NaN first, so a tile that leaves some unwritten fails, even where the tile
    before it wrote them right; the SwiGLU backward gets its copy of h back (it works in place)."""
    for name in cb.GEMM_OUTPUTS[op]:
        t[name].fill_(math.nan)
    if op == "down_dgrad":
        t["dh"].copy_(t["h"])
    launch()
    return relative_error([t[name] for name in cb.GEMM_OUTPUTS[op]], want)


def peer_calls(op: str, t: dict, sizes: list[int]) -> dict:
    """GEMM `op` without our epilogues, by cuBLAS once per expert with rows and by grouped_mm."""
    a, b, form = t[PLAIN[op][0]], t[PLAIN[op][1]], PLAIN[op][2]
    ends = list(itertools.accumulate(sizes))
    experts = [(e, slice(end - n, end)) for e, (n, end) in enumerate(zip(sizes, ends)) if n]
    offs = offsets(t["counts"])
    if form == "TN":
        return {"cuBLAS mm": lambda: [torch.mm(a[rows].T, b[rows]) for _, rows in experts],
                "grouped_mm": lambda: grouped_wgrad(a, b, offs)}
    w = b if form == "NT" else b.transpose(1, 2)  # rows @ w[e].T either way
    return {"cuBLAS mm": lambda: [torch.mm(a[rows], w[e].T) for e, rows in experts],
            "grouped_mm": lambda: grouped_matmul(a, w, offs)}


# --- the sweep --------------------------------------------------------------------------


def sweep_case(sizes, tiles, picks, *, timer, dims=(D, F), dtype=torch.bfloat16, device=cb.DEVICE, rounds=3,
               deadline=math.inf, bandwidth_gbs=None, say=print) -> dict:
    """One case: {op: {"flops", "bytes", "floor_ms", "pick", "tiles": {name: row}, "peers":
    {name: row}}} for each GEMM `tiles` holds, in OPS' order. Each of `tiles[op]` ({name:
    config}; `picks[op]` the table's) is checked (`checked`), then the tiles that passed and
    the peers are timed by `timer` (a zero-argument call -> ms) in turn, `rounds` times. A row
    holds the config, the error, the median ms, TFLOP/s and `x_table` (the pick's ms over its
    own), or `failed`: why it was not timed. `floor_ms`: the GEMM's bytes at `bandwidth_gbs`
    (None without one)."""
    t = cb.gemm_operands(sizes, *dims, dtype, device)
    use_tma = gs.uses_descriptors(sum(sizes), len(sizes)) and tma_ok(*(t[k] for k in ("x", "w1", "w2", "h", "act")))
    result = {}
    for op in (op for op in cb.OPS if op in tiles):
        want = reference(op, t)
        rows, launches = {}, {}
        for name, c in tiles[op].items():
            rows[name] = {"config": c}
            if time.monotonic() > deadline and name != picks[op]:  # the pick runs still: the sums need it
                rows[name]["failed"] = "not run: past --budget-s"
                continue
            launch = cb.gemm_call(op, t, c, use_tma)
            try:
                error = checked(op, t, launch, want)
            except Exception as e:  # a tile the compiler or the SM cannot hold
                rows[name]["failed"] = common.first_line(e)
                continue
            rows[name]["error"] = None if math.isnan(error) else error  # JSON has no NaN
            if not error <= TOLERANCE[dtype]:
                rows[name]["failed"] = f"wrong result: relative error {error:.1e} > {TOLERANCE[dtype]:.0e}"
                continue
            launches[name] = launch
        del want
        peers = peer_calls(op, t, sizes)
        times = {name: [] for name in (*launches, *peers)}
        for _ in range(rounds):
            for name, launch in (launches | peers).items():
                times[name].append(timer(launch))
        flops, moved = cb.gemm_flops(op, sizes, *dims), cb.gemm_bytes(op, sizes, *dims)
        entry = {"flops": flops, "bytes": moved, "floor_ms": moved / (bandwidth_gbs * 1e6) if bandwidth_gbs else None,
                 "pick": picks[op], "tiles": rows, "peers": {name: {} for name in peers}}
        for name, ms in times.items():
            row = entry["tiles" if name in rows else "peers"][name]
            row["ms"] = statistics.median(ms)
            row["tflops"] = flops / row["ms"] / 1e9
        pick_ms = rows.get(picks[op], {}).get("ms")
        for row in (*rows.values(), *entry["peers"].values()):
            if "ms" in row and pick_ms is not None:
                row["x_table"] = pick_ms / row["ms"]
        for line in op_table(sizes, op, entry):
            say(line)
        result[op] = entry
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return result


def case_sums(ops: dict) -> dict[str, float]:
    """The GEMMs' ms summed: the table's picks, the fastest tile of each, and each peer
    (a column missing where some GEMM has no time in it)."""
    columns = {"table": [entry["tiles"][entry["pick"]].get("ms") for entry in ops.values()],
               "fastest tiles": [min((row["ms"] for row in entry["tiles"].values() if "ms" in row), default=None)
                                 for entry in ops.values()],
               **{peer: [entry["peers"][peer].get("ms") for entry in ops.values()] for peer in PEERS}}
    return {name: sum(ms) for name, ms in columns.items() if None not in ms}


def would_pick(cases: dict, margin: float) -> dict:
    """{table: {op: {"config", "tile", "ms", "table_ms", "changed"}}}: per tile table the cases
    ran, each GEMM's tile with the least ms summed over that table's cases (a tile counts only
    where it was timed in all of them), where it is faster than the table's pick by `margin`
    or more (or the pick has no time); else the pick."""
    picks = {}
    for regime in dict.fromkeys(case["regime"] for case in cases.values()):
        ran = [case["ops"] for case in cases.values() if case["regime"] == regime]
        picks[regime] = {}
        for op in ran[0]:
            totals = {name: sum(r[op]["tiles"][name]["ms"] for r in ran) for name in ran[0][op]["tiles"]
                      if all("ms" in r[op]["tiles"].get(name, {}) for r in ran)}
            table = ran[0][op]["pick"]
            best = min(totals, key=totals.get, default=table)
            chosen = best if table not in totals or totals[best] <= totals[table] * (1 - margin) else table
            picks[regime][op] = {"config": ran[0][op]["tiles"][chosen]["config"], "tile": chosen,
                                 "ms": totals.get(chosen), "table_ms": totals.get(table), "changed": chosen != table}
    return picks


# --- what it prints ---------------------------------------------------------------------


def _ms(value, width=8, digits=3) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}s}"


def op_table(sizes: list[int], op: str, entry: dict) -> list[str]:
    """One GEMM of a case, headed by its bytes floor (where the run measured a bandwidth): its
    tiles, fastest first (then those not timed, and why), and the peers."""
    floor = f": bytes floor {entry['floor_ms']:.3f} ms" if entry["floor_ms"] is not None else ""
    lines = [f"=== {case_name(sizes)} {op}: {WHAT[op]}, {entry['flops'] / 1e12:.2f} TFLOP, "
             f"{entry['bytes'] / 1e6:.1f} MB{floor}",
             f"  {'tile':40s} {'ms':>8s} {'TFLOP/s':>8s} {'x table':>8s} {'error':>8s}"]
    timed = sorted((name for name, row in entry["tiles"].items() if "ms" in row), key=lambda n: entry["tiles"][n]["ms"])
    for name in timed:
        row = entry["tiles"][name]
        label = name + (TABLE if name == entry["pick"] else "")
        lines.append(f"  {label:40s} {_ms(row['ms'])} {_ms(row['tflops'], 8, 0)} {_ms(row.get('x_table'), 8, 2)} "
                     f"{row['error']:8.1e}")
    for name, row in entry["tiles"].items():
        if "failed" in row:
            lines.append(f"  {name + (TABLE if name == entry['pick'] else ''):40s} {row['failed']}")
    for name, row in entry["peers"].items():
        lines.append(f"  {name + ', plain GEMM':40s} {_ms(row.get('ms'))} {_ms(row.get('tflops'), 8, 0)} "
                     f"{_ms(row.get('x_table'), 8, 2)}")
    return lines


def sums_lines(sizes: list[int], ops: dict, peak: float) -> list[str]:
    """A case's GEMMs summed (`case_sums`), with their rate against `peak`, the bf16 matmul
    rate measured in the run."""
    flops = sum(entry["flops"] for entry in ops.values())
    every = len(ops) == len(cb.OPS)
    which = "the six GEMMs" if every else ", ".join(ops)
    head = f"=== {case_name(sizes)}: {which}, {flops / 1e12:.2f} TFLOP"
    return [head + (" (a training step runs them once a layer)" if every else "")] + [
        f"  {name:40s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s {flops / ms / 1e9 / peak:6.1%} of the matmul rate"
        for name, ms in case_sums(ops).items()]


def picks_lines(picks: dict, cases: dict, margin: float) -> list[str]:
    """The tile tables as the run would have them, to paste into grouped_swiglu.CONFIGS."""
    lines = []
    for regime, ops in picks.items():
        names = ", ".join(case for case, run in cases.items() if run["regime"] == regime)
        lines += [f"=== tile table {json.dumps(regime)} as this run picks it (a tile other than the table's where "
                  f"it is at least {margin:.0%} faster summed over {names}):", f"    {json.dumps(regime)}: {{"]
        for op in cb.OPS:
            pick = ops.get(op)
            if pick is None:  # not run (--gemms): the table's, so that the block still pastes whole
                lines.append(f"        {json.dumps(op)}: {tile_source(gs.CONFIGS[regime][op])},  # the table's, not run")
                continue
            if pick["changed"]:
                was = gs.CONFIGS[regime][op]
                note = (f"{_ms(pick['table_ms'], 0)} -> {_ms(pick['ms'], 0)} ms" +
                        (f" ({pick['ms'] / pick['table_ms'] - 1:+.1%})" if pick["table_ms"] else "") +
                        f", was {tile_source(was)}")
            else:
                note = f"the table's, {_ms(pick['ms'], 0)} ms"
            lines.append(f"        {json.dumps(op)}: {tile_source(pick['config'])},  # {note}")
        lines.append("    },")
    return lines


def case_name(sizes: list[int]) -> str:
    return f"{len(sizes)}x{sizes[0]}" if len(set(sizes)) == 1 else "+".join(map(str, sizes))


def payload(header: dict, peak: float, cases: dict, picks: dict, args, bandwidth: float) -> dict:
    """What --json holds: the header, the rates measured, the settings, every row of every
    case, the picks with their `tile_config(...)` source."""
    return {"header": header, "matmul_tflops": peak, "copy_bandwidth_gbs": bandwidth, "gemms": args.gemms.split(","),
            "rounds": args.rounds, "margin": args.margin,
            "tolerance": TOLERANCE[torch.bfloat16], "cases": cases,
            "would_pick": {regime: {op: {**pick, "source": tile_source(pick["config"])} for op, pick in ops.items()}
                           for regime, ops in picks.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="8x2048", help="LxR (local experts x rows per expert) or R0+R1+..., "
                                                          "joined by commas")
    parser.add_argument("--gemms", default=",".join(cb.OPS), help=f"any of {', '.join(cb.OPS)}, joined by commas")
    parser.add_argument("--rounds", type=int, default=3, help="times each tile and peer is timed, in turn")
    parser.add_argument("--margin", type=float, default=0.02, help="how much faster a tile must be to replace the "
                                                                   "table's pick")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no tile after this many seconds")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    gemms = args.gemms.split(",")
    if any(op not in cb.OPS for op in gemms) or len(set(gemms)) < len(gemms):
        print(f"custom_grouped_gemms: error: --gemms takes {', '.join(cb.OPS)} (each once) joined by commas; "
              f"got {args.gemms}", file=sys.stderr)
        return 2
    try:
        cases = cb.parse_cases(args.cases)
    except ValueError:
        cases = None
    if not cases or any(not sizes or min(sizes) < 0 or sum(sizes) == 0 for sizes in cases.values()):
        print(f"custom_grouped_gemms: error: --cases takes LxR or R0+R1+... (rows, at least one) joined by commas; "
              f"got {args.cases}", file=sys.stderr)
        return 2
    if args.rounds < 1 or not 0 <= args.margin < 1:
        print(f"custom_grouped_gemms: error: --rounds takes 1 or more and --margin a fraction in [0, 1); got "
              f"{args.rounds} and {args.margin}", file=sys.stderr)
        return 2
    device = common.cuda_or_refuse("custom_grouped_gemms")
    if device is None:
        return 2
    deadline = time.monotonic() + args.budget_s
    header = common.run_header(device)
    print(common.header_line(header))
    # Compiled as each case launches them: its experts and mean rows decide BLOCK_L and TMA.
    cb.precompile([(op, c, max(1, sum(sizes) // len(sizes)), len(sizes)) for sizes in cases.values()
                   for op in gemms for c in case_tiles(op, sizes)[0].values()])
    peak = common.matmul_peak_tflops(8192, device)
    bandwidth = common.copy_bandwidth_gbs(COPY_BYTES, device)
    print(f"measured here: bf16 matmul 8192^3 {peak:.0f} TFLOP/s, device copy {bandwidth:.0f} GB/s "
          f"(read + write, {COPY_BYTES >> 20} MiB): the GEMMs' bytes floors")
    runs = {}
    for case, sizes in cases.items():
        tiles, picks = {}, {}
        for op in gemms:
            tiles[op], picks[op] = case_tiles(op, sizes)
        ops = sweep_case(sizes, tiles, picks, device=device, timer=lambda fn: cb.bench(fn, rep=50),
                         rounds=args.rounds, deadline=deadline, bandwidth_gbs=bandwidth)
        runs[case] = {"sizes": sizes, "regime": gs.regime(sum(sizes), len(sizes)), "ops": ops,
                      "sums": case_sums(ops)}
        print("\n".join(sums_lines(sizes, ops, peak)), flush=True)
    picks = would_pick(runs, args.margin)
    print("\n".join(picks_lines(picks, runs, args.margin)))
    common.write_json(args.json, payload(header, peak, runs, picks, args, bandwidth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
