"""Each of the expert FFN's six GEMMs against its own floors, from profiled steps.

op_profile.py's kernel table says how long each kernel ran, summed over a step; this says
which GEMM of the fwd+bwd each launch was, and how far that GEMM is from the least time its
bytes and its FLOPs allow. Per GEMM of a step:

- which: every op profiled launches the six in one order, gate_up, down, down_dgrad,
  down_wgrad, gate_up_dgrad, gate_up_wgrad (`custom_grouped_ops.OPS`): ours in its backward,
  grouped_mm through autograd (a GEMM's first operand's gradient before its second's), TE
  through `grouped_linear._GroupedMatmul`. A step's GEMM kernels (kind "gemm" in
  kernel_profile.py's sense, less torch's `prepare_grouped_gemm_data` set-up kernels), taken
  in launch order (CUPTI's correlation ids, which grow with each launch the host makes, on
  whatever stream the kernel then runs), fall into six equal runs: one kernel a GEMM for
  ours and grouped_mm, one an expert for TE. A split-K reduction belongs to the GEMM
  launched before it; every other kernel (the peers' SwiGLU, casts, memsets) is "other".
  Each GEMM's kernel names are printed, so a wrong split shows (ours: `_rows_gemm` but for
  the two weight gradients' `_wgrad_gemm`; cuBLAS's names carry the layout, TN forward, NN
  data gradient, NT weight gradient).
- its time: busy, the union of its kernels' intervals (kernels that ran side by side count
  once, gaps between them not at all), beside their summed time and their span.
- its floors: its bytes (`custom_grouped_ops.gemm_bytes`: operands read once and results
  written once as ours moves them; the weight, read or written, is nearly all of it at few
  rows) at the copy bandwidth measured in the run, and its FLOPs at the bf16 matmul rate
  measured in the run; x floor is busy over the larger of the two, and x sum busy over the
  two added: near 1 where the GEMM moved its bytes and ran its MMAs one after the other
  rather than side by side (near x floor where either hid the other).
- its grid: its kernels' CTAs as CUPTI recorded the launch (where torch exposes the
  record), against the GPU's SMs, with the registers a thread and shared memory a CTA the
  compiled kernel asked and CUPTI's estimate of the occupancy they allow (the warps an SM
  can hold, of its 64: few warps keep few loads and stores in flight, which a GEMM bound by
  moving its bytes needs many of); for ours also what its tile table makes of the point:
  the tile, the persistent programs (`rows_programs`, `wgrad_programs`: the grid the
  launcher asks), the output tiles the rows make, how many rounds of the programs that is
  (below 1: programs without a whole tile, which stream-K's TAIL_SPLIT can share work out
  to), the row tiles an expert takes (each streams the expert's weight tile again, from L2
  or from memory) and the reduction steps a tile takes.

Nothing here is measured that op_profile.py's profiler window did not time: the floors and
the grid of ours are arithmetic on the point's shapes and the measured rates.
"""

import math
import re

from benchmarks.custom_grouped_ops import OPS, gemm_bytes, gemm_flops
from benchmarks.kernel_profile import idle_gaps, kind_of
from te_mixtral.experts.kernels.grouped_gemm import rows_programs
from te_mixtral.experts.kernels.schedule import cdiv
from te_mixtral.experts.kernels.wgrad_gemm import wgrad_programs

GRID = re.compile(r'"grid":\s*\[\s*(\d+),\s*(\d+),\s*(\d+)\s*\]')
# The launch record's numbers: our key -> (torch's typed field, CUPTI's JSON key).
RECORD = {"registers": ("registers_per_thread", "registers per thread"), "shared_bytes": ("shared_memory", "shared memory"),
          "occupancy_pct": ("est_occupancy_pct", "est. achieved occupancy %")}
SET_UP = "prepare_grouped_gemm_data"  # grouped_mm's set-up kernel before each GEMM: no GEMM itself


def kernel_launches(prof) -> list[dict]:
    """Every kernel, memset and copy of a finished profiler window, as {name, order (the
    launch's correlation id), start_us, end_us} and its `launch_record`."""
    from torch.autograd import DeviceType

    return [{"name": e.name, "order": e.id, "start_us": e.time_range.start, "end_us": e.time_range.end,
             **launch_record(e)} for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def launch_record(event) -> dict:
    """A kernel's CTAs, registers a thread, shared memory a CTA (bytes) and estimated
    occupancy (%) from its CUPTI launch record, each None where torch does not expose it:
    torch's typed `event_metadata`, or the record's JSON text in torch versions before it."""
    typed = getattr(event, "event_metadata", None)
    text = getattr(event, "_metadata_json", None) or vars(event).get("metadata_json") or ""
    grid = getattr(typed, "grid", None)
    if grid is None and (found := GRID.search(text)):
        grid = [int(n) for n in found.groups()]
    record = {"ctas": math.prod(grid) if grid else None}
    for key, (field, json_key) in RECORD.items():
        value = getattr(typed, field, None)
        if value is None and (found := re.search(rf'"{re.escape(json_key)}":\s*([\d.]+)', text)):
            value = float(found.group(1))
        record[key] = value
    return record


def by_step(launches: list[dict], steps: int) -> list[list[dict]]:
    """`launches` of `steps` steps, each step's in launch order. Every step ends in a
    synchronize, so a step's kernels all start before the next step's: the first of them by
    start time are the first step's. Raises ValueError where the steps did not launch the
    same kernels."""
    ordered = sorted(launches, key=lambda k: k["start_us"])
    if not ordered or len(ordered) % steps:
        raise ValueError(f"{len(ordered)} kernels do not make {steps} equal steps")
    size = len(ordered) // steps
    chunks = [ordered[i * size:(i + 1) * size] for i in range(steps)]
    if any(sorted(k["name"] for k in chunk) != sorted(k["name"] for k in chunks[0]) for chunk in chunks):
        raise ValueError(f"the {steps} steps did not launch the same kernels")
    orders = [k["order"] for k in chunks[0]]
    by_launch = len(set(orders)) == len(orders) and min(orders) > 0  # else start time is all there is
    return [sorted(chunk, key=lambda k: k["order"] if by_launch else k["start_us"]) for chunk in chunks]


def by_gemm(step: list[dict]) -> dict[str, list[dict]]:
    """One step's launches (in launch order) as {GEMM: its kernels, "other": the rest}: the
    GEMM kernels in six equal runs in OPS' order, each split-K reduction with the GEMM
    launched before it. Raises ValueError where the GEMM kernels do not split in six."""
    gemm_kernels = [k for k in step if kind_of(k["name"]) == "gemm" and SET_UP not in k["name"]]
    if not gemm_kernels or len(gemm_kernels) % len(OPS):
        raise ValueError(f"{len(gemm_kernels)} GEMM kernels a step do not make the {len(OPS)} GEMMs")
    run = len(gemm_kernels) // len(OPS)
    which = {id(k): OPS[i // run] for i, k in enumerate(gemm_kernels)}
    found, last = {op: [] for op in (*OPS, "other")}, None
    for k in step:
        if id(k) in which:
            last = which[id(k)]
            found[last].append(k)
        elif last is not None and kind_of(k["name"]) == "reduce":  # split-K's second pass
            found[last].append(k)
        else:
            found["other"].append(k)
    return found


def our_grid(op: str, cfg: dict, sizes: list[int], D: int, F: int, sms: int) -> dict:
    """What ours' tile `cfg` makes of GEMM `op` at a point: the programs its launcher asks
    (sms: `max_programs`), the output tiles, rounds of the programs, row tiles an expert and
    reduction steps a tile (the most of any expert)."""
    R, L = sum(sizes), len(sizes)
    bm, bn, bi = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_I"]
    if op.endswith("wgrad"):
        M, N = (D, F) if op == "down_wgrad" else (2 * F, D)  # out [L, M, N]; rows are the reduction
        programs, tiles = wgrad_programs(L, M, N, cfg, sms), L * cdiv(M, bm) * cdiv(N, bn)
        row_tiles, steps = None, cdiv(max(sizes), bi)
    else:
        n, inner = {"gate_up": (F, D), "down": (D, F), "down_dgrad": (F, D), "gate_up_dgrad": (D, 2 * F)}[op]
        programs, tiles = rows_programs(R, L, n, cfg, sms), sum(cdiv(c, bm) for c in sizes) * cdiv(n, bn)
        row_tiles, steps = cdiv(max(sizes), bm), cdiv(inner, bi)
    return {"tile": f"{bm}x{bn}x{bi}", "warps": cfg["num_warps"], "stages": cfg["num_stages"],
            "progs_per_sm": cfg.get("PROGS_PER_SM", 1), "tail_split": cfg.get("TAIL_SPLIT", 1),
            "flatten": cfg.get("FLATTEN", False), "programs": programs, "tiles": tiles,
            "rounds": tiles / programs, "row_tiles": row_tiles, "k_steps": steps}


def gemm_table(steps: list[list[dict]], sizes: list[int], D: int, F: int, bandwidth_gbs: float, tflops: float,
               sms: int, table: dict | None = None) -> dict:
    """Per GEMM, over `steps` (`by_step`'s): its kernels' names, launches, busy / summed /
    span ms a step, bytes, FLOPs, the two floors (ms) and busy over the larger and over
    their sum, its launches' records (the distinct values of each); with ours' tile `table`,
    `our_grid`. Also "other" (ms, launches a step)."""
    split = [by_gemm(step) for step in steps]
    rows = []
    for op in OPS:
        kernels = [s[op] for s in split]
        busy = [_busy_us(ks) for ks in kernels]
        nbytes, flops = gemm_bytes(op, sizes, D, F), gemm_flops(op, sizes, D, F)
        floor_ms, compute_ms = nbytes / (bandwidth_gbs * 1e6), flops / (tflops * 1e9)
        row = {"gemm": op, "names": sorted({k["name"] for k in kernels[0]}), "launches": len(kernels[0]),
               "busy_ms": _mean(b / 1e3 for b in busy),
               "kernel_ms": _mean(sum(k["end_us"] - k["start_us"] for k in ks) / 1e3 for ks in kernels),
               "span_ms": _mean((max(k["end_us"] for k in ks) - min(k["start_us"] for k in ks)) / 1e3
                                for ks in kernels),
               "bytes": nbytes, "flops": flops, "floor_ms": floor_ms, "compute_ms": compute_ms,
               **{key: sorted({k[key] for k in kernels[0] if k.get(key) is not None})
                  for key in ("ctas", "registers", "shared_bytes", "occupancy_pct")}}
        row["x_floor"] = row["busy_ms"] / max(floor_ms, compute_ms)
        row["x_sum"] = row["busy_ms"] / (floor_ms + compute_ms)
        if table is not None:
            row["ours"] = our_grid(op, table[op], sizes, D, F, sms)
        rows.append(row)
    other = [s["other"] for s in split]
    return {"sms": sms, "gemms": rows, "other_ms": _mean(sum(k["end_us"] - k["start_us"] for k in ks) / 1e3
                                                         for ks in other),
            "other_launches": len(other[0])}


def _busy_us(kernels: list[dict]) -> float:
    span, gaps = idle_gaps([(k["start_us"], k["end_us"], k["name"]) for k in kernels])
    return span - sum(g["us"] for g in gaps)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def print_gemm_table(found: dict) -> None:
    """`gemm_table`'s rows, one line a GEMM, and the totals."""
    print(f"  per GEMM, ms a step: busy (kernels summed / span), launches; floors: bytes at the copy bandwidth, "
          f"FLOPs at the matmul rate; x floor = busy / the larger, x sum = busy / the two added; CTAs of its "
          f"launches / {found['sms']} SMs")
    for r in found["gemms"]:
        grid = "/".join(map(str, r["ctas"])) or "-"
        resources = (f", {'/'.join(f'{n:.0f}' for n in r['registers']) or '-'} regs, "
                     f"{'/'.join(f'{n / 1024:.0f}' for n in r['shared_bytes']) or '-'} KiB, occupancy "
                     f"{'/'.join(f'{n:.0f}' for n in r['occupancy_pct']) or '-'} %")
        line = (f"  {r['gemm']:13s} {r['busy_ms']:7.3f} ({r['kernel_ms']:.3f} / {r['span_ms']:.3f}) "
                f"{r['launches']:3d}x  {r['bytes'] / 1e6:8.1f} MB {r['floor_ms']:7.3f}  {r['flops'] / 1e9:7.1f} GFLOP "
                f"{r['compute_ms']:7.3f}  x{r['x_floor']:.2f} (sum x{r['x_sum']:.2f})  CTAs {grid}{resources}")
        if "ours" in r:
            o = r["ours"]
            line += (f"  | tile {o['tile']} w{o['warps']} s{o['stages']} p{o['progs_per_sm']} split{o['tail_split']}"
                     f"{' flat' if o['flatten'] else ''}: {o['programs']} programs, {o['tiles']} tiles, "
                     f"{o['rounds']:.2f} rounds, "
                     + (f"{o['row_tiles']} row tiles/expert, " if o["row_tiles"] is not None else "")
                     + f"{o['k_steps']} k steps")
        print(line)
        print(f"      {'; '.join(name[:90] for name in r['names'])}")
    total = sum(r["busy_ms"] for r in found["gemms"])
    floors = sum(max(r["floor_ms"], r["compute_ms"]) for r in found["gemms"])
    print(f"  six GEMMs: busy {total:.3f} ms against {floors:.3f} (x{total / floors:.2f}); other kernels "
          f"{found['other_ms']:.3f} ms ({found['other_launches']} launches)")
