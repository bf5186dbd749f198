"""Where one expert FFN call's time goes, op beside op: GPU kernels, the GPU's idle time, the host.

The grid (`custom_grouped_grid.py`) and the FP8 break-even (`fp8_break_even.py`) say which op
is faster at a point; this says why. At each point (`--cases`, local experts x rows per expert,
or rows of each expert) and for each op (`--ops`), one step is a forward + backward (gradients of x and both
weights, `custom_grouped_ops.fwd_bwd`), and with `--optimizer-step` an (empty) optimizer step
after it, as fp8_break_even.py times: the FP8 tier's weight copies are made again every step.
Per op and point:

- step: the median ms of a step between CUDA events (`common.median_ms`, fp8_break_even.py's
  timer): the host's time counts where the GPU waits for it, as a training step sees it;
- GPU: ms a step with the host's launches queued ahead (`custom_grouped_ops.gpu_ms`);
- kernels: torch.profiler's CUDA kernel table per step over 3 steps (benchmarks/kernel_profile.py's
  `summarize`: every kernel's ms and launches a step, by kind), the span of those steps'
  kernels and the idle time inside it, and the longest idle gaps with the kernels either side;
- GEMMs: the same steps' kernels by which of the six GEMMs launched them, each GEMM's time
  against its own bytes and FLOPs at the copy bandwidth and matmul rate measured at the
  start of the run, and its grid against the SMs (benchmarks/gemm_floors.py);
- host: a cProfile of 20 steps, the Python functions with the most own time, ms a step.

Step time well above GPU time, and the idle time inside the kernels' span, say the host's
launching sets the pace; a kernel table whose sum is near the step says the GPU does.

The ops: `custom_grouped` (the BF16 op), `grouped_mm` (torch's grouped GEMM with plain
autograd), `TE` (TE's grouped GEMM as the `grouped_linear` tier runs it, split sizes handed over
on the host), `device_mxfp8` (mode fp8-hopper, FP8 at every size). `--tiles NAME` adds
`custom_grouped` with one tile table at every point (custom_grouped_ops.py's `with_table`:
a table of grouped_swiglu.CONFIGS, or `previous`), where that is not the table it runs there.

`--cases-from FILE` takes the cases from the last step of a `benchmarks/te_example.py
--splits-json` file instead: each MoE layer's rows per expert as TE's example routed them,
one case a layer; the report then ends with each op's times and GEMMs summed over the cases,
a whole step's expert GEMMs.

    python3 -m benchmarks.op_profile [--family 8x7b|8x22b] [--cases 1x64,1x512 | --cases-from FILE] \
        [--ops custom_grouped,device_mxfp8,...] [--tiles NAME ...] [--optimizer-step] [--json FILE]

`scripts/gpu_runs.py rows OUT fp8-profile`, `... misses-8x22b` and `... misses-causes` run it.
"""

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.common import FAMILIES
from benchmarks.custom_grouped_grid import COPY_BYTES, MATMUL_N, SPIN_CYCLES, kernel_jobs, te_peer
from benchmarks.custom_grouped_ops import (
    TABLE_NAMES,
    fwd_bwd,
    gpu_ms,
    make_inputs,
    parse_cases,
    precompile,
    table_at,
    with_table,
)
from benchmarks.gemm_floors import by_step, gemm_table, kernel_launches, print_gemm_table
from benchmarks.kernel_profile import ACTIVE, SKIPPED, WARMUP, print_summary, profile_summary
from te_mixtral.errors import TierUnavailable
from te_mixtral.experts.custom_grouped import grouped_mm_swiglu
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier
from te_mixtral.experts.kernels.grouped_swiglu import bf16_configs, grouped_swiglu, regime
from te_mixtral.experts.kernels.schedule import max_programs

OPS = ("custom_grouped", "grouped_mm", "TE", "device_mxfp8")
CPROFILE_STEPS = 20
HOST_TOP = 15
KERNELS_SHOWN = 12


def make_op(name: str, sizes: list[int]):
    """The op `name` with the grid's signature op(x, counts, w1, w2), or a reason it cannot run;
    "custom_grouped, TABLE" is ours with tile table TABLE at every size."""
    if name == "custom_grouped":
        return grouped_swiglu
    if name.startswith("custom_grouped, "):
        return with_table(name.removeprefix("custom_grouped, "))
    if name == "grouped_mm":
        return grouped_mm_swiglu
    if name == "TE":
        te, why_not = te_peer()
        return why_not if te is None else (lambda x, counts, w1, w2: te(x, sizes, w1, w2))
    tier = DeviceMXFP8Tier("fp8-hopper", min_rows_per_expert=0)
    try:
        tier.check_available(torch.device("cuda"))
    except TierUnavailable as error:
        return str(error)
    return tier


def make_step(op, inputs, optimizer):
    """One step of `op` on `inputs`: fwd+bwd, then `optimizer`'s step where given (it clears
    the FP8 tier's weight copies, as a training step's does)."""
    fwd_bwd_step = fwd_bwd(op, *inputs)

    def step():
        fwd_bwd_step()
        if optimizer is not None:
            optimizer.step()
    return step


def kernel_profile(step) -> tuple[dict, list[dict]]:
    """kernel_profile.py's summary of ACTIVE steps, each cut after a synchronize (kernels
    launched in one step and run in the next would count in the next), and those steps'
    launches one by one (gemm_floors.py's `kernel_launches`, with CUPTI's launch records
    exposed for their grids)."""
    from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, schedule

    found, launches = {}, []

    def done(prof):
        found.update(profile_summary(prof))
        launches.extend(kernel_launches(prof))

    try:
        records = _ExperimentalConfig(expose_kineto_event_metadata=True)
    except TypeError:  # a torch without the option: the GEMM table goes without the launch records
        records = _ExperimentalConfig()
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=SKIPPED, warmup=WARMUP, active=ACTIVE),
                 on_trace_ready=done, experimental_config=records) as prof:
        for _ in range(SKIPPED + WARMUP + ACTIVE):
            step()
            torch.cuda.synchronize()
            prof.step()
    return found, launches


def host_profile(step, device: torch.device, top: int = HOST_TOP) -> list[dict]:
    """The `top` Python functions by own time over CPROFILE_STEPS steps, per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(CPROFILE_STEPS):
        step()
    profiler.disable()
    common.synchronize(device)
    stats = pstats.Stats(profiler).stats
    rows = [{"function": f"{file.rsplit('/', 1)[-1]}:{line}({fn})", "calls": calls / CPROFILE_STEPS,
             "own_ms": 1e3 * own / CPROFILE_STEPS, "cum_ms": 1e3 * cum / CPROFILE_STEPS}
            for (file, line, fn), (_, calls, own, cum, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def our_table(name: str, sizes: list[int], device: torch.device) -> dict | None:
    """The tile table op `name` runs at a point of `sizes`: ours' own choice, or its `--tiles`
    table; None for the other ops."""
    rows, experts = sum(sizes), len(sizes)
    if name == "custom_grouped":
        return bf16_configs(device)[regime(rows, experts)]
    if name.startswith("custom_grouped, "):
        return table_at(name.removeprefix("custom_grouped, "), rows, experts)
    return None


def measure(step, gemms) -> dict:
    """The step's times, kernel table and host profile; `gemms(launches)` makes the GEMM
    table from the kernel table's launches."""
    device = torch.device("cuda")
    step_ms = common.median_ms(step, device)
    summary, launches = kernel_profile(step)
    return {"step_ms": step_ms, "gpu_ms": gpu_ms(step, calls=20, spin_cycles=SPIN_CYCLES), **summary,
            **gemms(launches), "host": host_profile(step, device)}


def gemms_of(sizes: list[int], D: int, F: int, rates: dict, table: dict | None):
    """`measure`'s `gemms`: gemm_floors.py's table at a point, or why there is none (the
    launches did not fall into equal steps, or their GEMM kernels into the six GEMMs)."""
    device = torch.device("cuda")

    def gemms(launches: list[dict]) -> dict:
        try:
            return {"gemms": gemm_table(by_step(launches, ACTIVE), sizes, D, F, rates["copy_bandwidth_gbs"],
                                        rates["matmul_tflops"], max_programs(device), table)}
        except ValueError as error:
            return {"gemms_skipped": str(error)}
    return gemms


def print_op(case: str, name: str, r: dict) -> None:
    print_summary(r, f"{case} {name}: step {r['step_ms']:.3f} ms, GPU {r['gpu_ms']:.3f} ms a step", KERNELS_SHOWN, 3)
    if "gemms" in r:
        print_gemm_table(r["gemms"])
    else:
        print(f"  no GEMM table: {r['gemms_skipped']}")
    print("host, own ms a step (cProfile): " + "; ".join(
        f"{h['function']} {h['own_ms']:.3f} ({h['calls']:.0f}x)" for h in r["host"][:8]))


def cases_from(path: Path) -> dict[str, list[int]]:
    """{"layer i": rows per expert} of the last step in a te_example.py `--splits-json` file."""
    steps = json.loads(path.read_text())["steps"]
    if not steps or not all(isinstance(n, int) and n >= 0 for layer in steps[-1] for n in layer):
        raise ValueError(f"{path} holds no step of rows per expert")
    return {f"layer {i}": layer for i, layer in enumerate(steps[-1])}


def totals(results: list[dict]) -> dict:
    """Per op, its step and GPU ms and each GEMM's busy ms summed over the cases it ran at."""
    found = {}
    for r in results:
        if "step_ms" not in r:
            continue
        total = found.setdefault(r["op"], {"cases": 0, "step_ms": 0.0, "gpu_ms": 0.0, "gemms": {}})
        total["cases"] += 1
        total["step_ms"] += r["step_ms"]
        total["gpu_ms"] += r["gpu_ms"]
        for g in r.get("gemms", {}).get("gemms", []):
            total["gemms"][g["gemm"]] = total["gemms"].get(g["gemm"], 0.0) + g["busy_ms"]
    return found


def print_totals(found: dict) -> None:
    print("\nsummed over the cases, ms: step / GPU; each GEMM's busy time")
    for name, t in found.items():
        gemms = "  ".join(f"{gemm} {ms:.2f}" for gemm, ms in t["gemms"].items())
        print(f"  {name:16s} {t['cases']} cases  {t['step_ms']:.2f} / {t['gpu_ms']:.2f}  GEMMs {sum(t['gemms'].values()):.2f}: "
              f"{gemms}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="8x7b")
    parser.add_argument("--cases", default="1x64,1x512,1x1024",
                        help="LxR (L local experts of R rows) or R0+R1+... (rows of each expert), joined by commas")
    parser.add_argument("--cases-from", type=Path, default=None,
                        help="the last step's rows per expert in each layer of a te_example.py --splits-json file")
    parser.add_argument("--ops", default="custom_grouped,device_mxfp8", help=f"any of {', '.join(OPS)}")
    parser.add_argument("--tiles", action="append", default=[],
                        help="also custom_grouped with this tile table at every point (repeatable)")
    parser.add_argument("--optimizer-step", action="store_true",
                        help="an (empty) optimizer step ends every step, as fp8_break_even.py times")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    names = args.ops.split(",")
    if args.cases_from is not None:
        try:
            cases = cases_from(args.cases_from)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
            print(f"op_profile: error: --cases-from {args.cases_from}: {common.first_line(error)}", file=sys.stderr)
            return 2
    else:
        try:
            cases = parse_cases(args.cases)
        except ValueError:
            print(f"op_profile: error: --cases takes LxR or R0+R1+... joined by commas; got {args.cases}",
                  file=sys.stderr)
            return 2
    if any(name not in OPS for name in names):
        print(f"op_profile: error: --ops takes {', '.join(OPS)} joined by commas; got {args.ops}", file=sys.stderr)
        return 2
    unknown = [name for name in args.tiles if name not in TABLE_NAMES]
    if unknown:
        print(f"op_profile: error: no tile table {unknown[0]!r}; the tables are {', '.join(TABLE_NAMES)}",
              file=sys.stderr)
        return 2
    device = common.cuda_or_refuse("op_profile")
    if device is None:
        return 2
    D, F = FAMILIES[args.family].hidden, FAMILIES[args.family].ffn
    header = common.run_header(device, family=args.family, optimizer_step=args.optimizer_step)
    print(common.header_line(header))
    if "custom_grouped" in names or args.tiles:
        precompile(kernel_jobs(args.tiles, list(cases.values())))
    rates = {"copy_bandwidth_gbs": common.copy_bandwidth_gbs(COPY_BYTES, device),
             "matmul_tflops": common.matmul_peak_tflops(MATMUL_N, device)}
    header |= rates
    print(f"measured: device copy {rates['copy_bandwidth_gbs']:.0f} GB/s (read + write, {COPY_BYTES >> 20} MiB), "
          f"bf16 matmul {MATMUL_N}^3 {rates['matmul_tflops']:.0f} TFLOP/s; "
          f"{torch.cuda.get_device_properties(device).multi_processor_count} SMs")
    print(f"fwd+bwd{' + an empty optimizer step' if args.optimizer_step else ''}, Mixtral-{args.family} "
          f"(D {D}, F {F}): step (host included, CUDA events), GPU (host queued ahead), the kernels per step")
    optimizer = None
    if args.optimizer_step:
        optimizer = torch.optim.SGD([torch.zeros(1, device=device, requires_grad=True)], lr=0.0)
    results = []
    for case, sizes in cases.items():
        inputs = make_inputs(None, len(sizes), D, F, requires_grad=True, sizes=sizes)
        ours = our_table("custom_grouped", sizes, device)
        tiles = [f"custom_grouped, {t}" for t in args.tiles if our_table(f"custom_grouped, {t}", sizes, device) != ours]
        for name in names + tiles:
            op = make_op(name, sizes)
            entry = {"case": case, "sizes": sizes, "op": name}
            if isinstance(op, str):
                print(f"--- {case} {name}: skipped: {op}")
                results.append(entry | {"skipped": op})
                continue
            gemms = (gemms_of(sizes, D, F, rates, our_table(name, sizes, device)) if name != "device_mxfp8"
                     else lambda _: {"gemms_skipped": "FP8 GEMMs, whose bytes gemm_floors.py does not count"})
            try:
                entry |= measure(make_step(op, inputs, optimizer), gemms)
            except Exception as error:  # one op that cannot run here must not cost the others
                print(f"--- {case} {name}: FAILED: {common.first_line(error)}")
                results.append(entry | {"error": common.first_line(error)})
                continue
            print_op(case, name, entry)
            results.append(entry)
        del inputs
        torch.cuda.empty_cache()
    found = totals(results)
    if args.cases_from is not None:
        print_totals(found)
    common.write_json(args.json, {"header": header, "family": args.family, "results": results, "totals": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
