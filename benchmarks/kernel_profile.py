"""CUDA kernel time per training step, by kind of kernel: our run of a config, or TE's example.

Step timings say which model is faster; this says where. It trains a few steps under
`torch.profiler` and reports, per optimizer step, the kernel time of steps 4-6 of 8 (the first
two skipped, the third a profiler warm-up), grouped by kernel name into kinds (GEMMs,
attention, optimizer, copies, ...), the time the GPU sat idle between kernels (waiting for the
host, as for each MoE layer's split sizes, or for another rank), then the 40 longest kernels:

    python3 -m benchmarks.kernel_profile ours [--config configs/mixtral-8x7b-8layer.yaml] [--tier custom_grouped] \
        [training flags, e.g. --lora.rank 16]
    python3 -m benchmarks.kernel_profile te --example-dir .peers/te_mixtral_example [--config ...]

`te` trains TE's te_mixtral example through benchmarks/te_example.py (see there). Steps are
counted by a global optimizer post-step hook, which waits for the GPU before it cuts, so both
models are cut at the same points and each window holds the kernels of its own steps.
Kernel time is what the GPU spent, not wall time: profiling slows the host, and the sum can
fall short of a step where the GPU waits for it. So it is torch.profiler's per-kernel time,
not benchmarks/common.py's timer, that is reported here.
"""

import argparse
import re
import sys
from collections import defaultdict

from benchmarks import common

SKIPPED, WARMUP, ACTIVE = 2, 1, 3
# First match wins: the name of a kernel says what it is.
KINDS = [("attention", r"flash|fmha|cudnn|attn|sdpa"), ("optimizer", r"adam|multi_tensor|norm.*functor"),
         ("nccl", r"nccl"), ("gemm", r"gemm|nvjet|sm90_xmma|cutlass|matmul"),
         ("permute", r"permute|sort|scan|index|scatter|gather"), ("norm", r"rmsnorm|layernorm"),
         ("softmax/topk", r"softmax|topk|logsumexp|cross_entropy|nll"),
         ("copy/cast", r"copy|cast|convert|fill|memset|cat"), ("elementwise", r"elementwise|vectorized"),
         ("reduce", r"reduce")]


def report(prof, label: str) -> None:
    rows = sorted(((e.key, e.self_device_time_total / 1e3 / ACTIVE, e.count // ACTIVE)
                   for e in prof.key_averages() if e.self_device_time_total > 0), key=lambda r: -r[1])
    kinds = defaultdict(float)
    for name, ms, _ in rows:
        kinds[next((kind for kind, pattern in KINDS if re.search(pattern, name, re.I)), "other")] += ms
    print(f"=== {label}: {sum(r[1] for r in rows):.1f} ms of CUDA kernels per step")
    idle_ms, span_ms = idle_between_kernels(prof)
    print(f"  GPU idle between kernels: {idle_ms / ACTIVE:.1f} ms per step of {span_ms / ACTIVE:.1f} "
          f"({100 * idle_ms / max(span_ms, 1e-9):.1f} %)")
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:14s} {ms:8.1f} ms")
    for name, ms, count in rows[:40]:
        print(f"{ms:8.2f} ms {count:6d}x  {name[:150]}")


def idle_between_kernels(prof) -> tuple[float, float]:
    """The time no kernel ran, in ms, between the window's first kernel and its last, and that
    span: where the GPU waited for the host (a split size copied back, a launch) or a peer."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    if not spans:
        return 0.0, 0.0
    idle, reach = 0, spans[0][1]
    for start, end in spans[1:]:
        idle += max(0, start - reach)
        reach = max(reach, end)
    return idle / 1e3, (reach - spans[0][0]) / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=("ours", "te"))
    parser.add_argument("--config", default="configs/mixtral-8x7b-8layer.yaml")
    parser.add_argument("--tier", default="custom_grouped", help="ours: the expert tier")
    parser.add_argument("--example-dir", default=".peers/te_mixtral_example", help="te: a copy of TE's example")
    parser.add_argument("--output-dir", default="/tmp/kernel_profile", help="ours: the run's folder (replaced)")
    args, extra = parser.parse_known_args(argv)
    if extra and args.which == "te":
        parser.error(f"unrecognized arguments: {' '.join(extra)} (only 'ours' takes training flags)")

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    # No header of its own: the run it profiles prints one (ours, or te_example.py's).
    if common.cuda_or_refuse("kernel_profile") is None:
        return 2
    steps = SKIPPED + WARMUP + ACTIVE + 2
    if args.which == "ours":
        from te_mixtral.cli import main as train
        train_args = ["--config", args.config, "--tier", args.tier, "--steps", str(steps), "--timing_warmup_steps",
                      "2", "--output-dir", args.output_dir, "--overwrite", "true", "--plots", "false", *extra]
    else:
        from benchmarks.te_example import main as train
        train_args = ["--example-dir", args.example_dir, "--config", args.config, "--steps", str(steps), "--warmup", "2"]

    prof = profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=SKIPPED, warmup=WARMUP, active=ACTIVE),
                   on_trace_ready=lambda p: report(p, f"{args.which} ({args.config})"))

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
