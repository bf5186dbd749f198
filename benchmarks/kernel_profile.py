"""CUDA kernel time per training step, by kind of kernel: our run of a config, or TE's example.

Step timings say which model is faster; this says where. It trains a few steps under
`torch.profiler` and reports, per optimizer step, the kernel time of steps 4-6 of 8 (the first
two skipped, the third a profiler warm-up), grouped by kernel name into kinds (GEMMs,
attention, optimizer, copies, ...) with their launches, then the 40 longest kernels:

    python3 -m benchmarks.kernel_profile ours [--config configs/mixtral-8x7b-8layer.yaml] [--tier custom_grouped] \
        [--json OUT.json] [training flags, e.g. --lora.rank 16]
    python3 -m benchmarks.kernel_profile te --example-dir .peers/te_mixtral_example [--config ...] [--json OUT.json]

`te` trains TE's te_mixtral example through benchmarks/te_example.py (see there). Steps are
counted by a global optimizer post-step hook, which waits for the GPU before it cuts, so both
models are cut at the same points and each window holds the kernels of its own steps.
Kernel time is what the GPU spent, not wall time: profiling slows the host, and the sum can
fall short of a step where the GPU waits for it. So it is torch.profiler's per-kernel time,
not benchmarks/common.py's timer, that is reported here.

Where the GPU waits. Beside the kernel time, the report gives the window's span (first
kernel's start to last kernel's end, per step) and the idle time inside it (no kernel,
copy or memset running on any stream), with the longest idle gaps and the kernels on either
side: a host that cannot launch fast enough, or stops for a result (`.item()`, `.tolist()`),
shows there. The profiler's own overhead on the host makes these an upper bound.

`--json` writes all of it (every kernel, its kind, time and launches per step; the kinds;
span, idle and gaps), which benchmarks/kernel_compare.py sets side by side. Under torchrun
each rank prints its own and writes its own file (the rank before the suffix from rank 1 on).
"""

import argparse
import os
import re
import sys
from collections import defaultdict

from benchmarks import common

SKIPPED, WARMUP, ACTIVE = 2, 1, 3
# First match wins: the name of a kernel says what it is.
KINDS = [("attention", r"flash|fmha|cudnn|attn|sdpa"), ("gradient norm", r"NormTwoOps|LpNorm|l2norm"),
         ("optimizer", r"adam|multi_tensor|norm.*functor"), ("nccl", r"nccl"),
         ("gemm", r"gemm|nvjet|sm90_xmma|cutlass|matmul"),
         ("loss", r"LogSoftMax|nll_loss|cross_entropy|online_softmax|element_mul"),
         ("router", r"softmax|topk|logsumexp|bitonicSort"),
         ("permute", r"permute|sort|scan|index|scatter|gather|histogram"), ("norm", r"rmsnorm|layernorm"),
         ("rope", r"rope"), ("swiglu", r"gated_act|silu|swiglu"), ("add", r"CUDAFunctor_add|AddFunctor"),
         ("copy/cast", r"copy|cast|convert|fill|memset|memcpy|cat"), ("elementwise", r"elementwise|vectorized"),
         ("reduce", r"reduce")]
TOP_KERNELS, TOP_GAPS = 40, 12


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.I)), "other")


def idle_gaps(intervals: list[tuple[float, float, str]]) -> tuple[float, list[dict]]:
    """The span of `intervals` (start and end in microseconds, the kernel's name) and its idle
    gaps, where nothing runs on any stream: [{"us", "after", "before"}], longest first."""
    if not intervals:
        return 0.0, []
    intervals = sorted(intervals)
    gaps, (_, busy_until, last) = [], intervals[0]
    for start, end, name in intervals[1:]:
        if start > busy_until:
            gaps.append({"us": start - busy_until, "after": last, "before": name})
        if end > busy_until:
            busy_until, last = end, name
    return busy_until - intervals[0][0], sorted(gaps, key=lambda g: -g["us"])


def summarize(kernels: list[tuple[str, float, int]], intervals: list[tuple[float, float, str]], steps: int) -> dict:
    """Per step: every kernel (name, total microseconds and launches over the `steps`) with its
    kind, sorted longest first; the kinds' sums; the span, the idle time and the longest gaps
    of the kernels' `intervals` (microseconds, as the profiler gives them)."""
    rows = sorted(({"name": name, "kind": kind_of(name), "ms": us / 1e3 / steps, "launches": count / steps}
                   for name, us, count in kernels if us > 0), key=lambda r: -r["ms"])
    kinds = defaultdict(lambda: {"ms": 0.0, "launches": 0.0})
    for row in rows:
        kinds[row["kind"]]["ms"] += row["ms"]
        kinds[row["kind"]]["launches"] += row["launches"]
    span_us, gaps = idle_gaps(intervals)
    return {"kernel_ms": sum(r["ms"] for r in rows), "span_ms": span_us / 1e3 / steps,
            "idle_ms": sum(g["us"] for g in gaps) / 1e3 / steps, "launches": sum(r["launches"] for r in rows),
            "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])), "kernels": rows,
            "gaps": [{"ms": g["us"] / 1e3, "after": g["after"], "before": g["before"]} for g in gaps[:TOP_GAPS]]}


def print_summary(summary: dict, label: str) -> None:
    print(f"=== {label}: {summary['kernel_ms']:.1f} ms of CUDA kernels per step ({summary['launches']:.0f} launches); "
          f"span {summary['span_ms']:.1f} ms, idle {summary['idle_ms']:.1f} ms")
    for kind, total in summary["kinds"].items():
        print(f"  {kind:14s} {total['ms']:8.1f} ms {total['launches']:7.0f}x")
    for row in summary["kernels"][:TOP_KERNELS]:
        print(f"{row['ms']:8.2f} ms {row['launches']:6.0f}x  {row['name'][:150]}")
    print("longest idle gaps (ms, in the whole window): after -> before")
    for gap in summary["gaps"]:
        print(f"{gap['ms']:8.3f}  {gap['after'][:70]} -> {gap['before'][:70]}")


def profile_summary(prof) -> dict:
    """`summarize` of a finished profiler window of ACTIVE steps."""
    from torch.autograd import DeviceType

    kernels = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages()]
    intervals = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return summarize(kernels, intervals, ACTIVE)


def rank_path(path, rank: int):
    return path if path is None or rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=("ours", "te"))
    parser.add_argument("--config", default="configs/mixtral-8x7b-8layer.yaml")
    parser.add_argument("--tier", default="custom_grouped", help="ours: the expert tier")
    parser.add_argument("--example-dir", default=".peers/te_mixtral_example", help="te: a copy of TE's example")
    parser.add_argument("--output-dir", default="/tmp/kernel_profile", help="ours: the run's folder (replaced)")
    common.add_json_flag(parser)
    args, extra = parser.parse_known_args(argv)
    if extra and args.which == "te":
        parser.error(f"unrecognized arguments: {' '.join(extra)} (only 'ours' takes training flags)")

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    # No header of its own: the run it profiles prints one (ours, or te_example.py's).
    device = common.cuda_or_refuse("kernel_profile")
    if device is None:
        return 2
    steps = SKIPPED + WARMUP + ACTIVE + 2
    if args.which == "ours":
        from te_mixtral.cli import main as train
        train_args = ["--config", args.config, "--tier", args.tier, "--steps", str(steps), "--timing_warmup_steps",
                      "2", "--output-dir", args.output_dir, "--overwrite", "true", "--plots", "false", *extra]
    else:
        from benchmarks.te_example import main as train
        train_args = ["--example-dir", args.example_dir, "--config", args.config, "--steps", str(steps), "--warmup", "2"]
    label = f"{args.which} ({args.config}{' ' + ' '.join(extra) if extra else ''})"

    def report(prof):
        summary = profile_summary(prof)
        print_summary(summary, label)
        common.write_json(rank_path(args.json, int(os.environ.get("RANK", "0"))),
                          {"header": common.run_header(device, which=args.which, config=args.config,
                                                       tier=args.tier if args.which == "ours" else None,
                                                       training_flags=extra),
                           "label": label, "steps": ACTIVE, **summary})

    prof = profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=SKIPPED, warmup=WARMUP, active=ACTIVE),
                   on_trace_ready=report)

    def next_step(*_):
        # The host runs ahead of the GPU: without the wait, kernels launched before a step
        # boundary but run after it are counted in the next step (a whole optimizer step of
        # launches too many per window, measured).
        torch.cuda.synchronize()
        prof.step()

    register_optimizer_step_post_hook(next_step)
    with prof:
        return train(train_args)


if __name__ == "__main__":
    sys.exit(main())
