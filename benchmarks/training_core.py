"""Today's training core against the bf16-master one, on the same work in the same run.

For each tier named, the app runs twice on one config: `--optimizer adamw` (fp32 parameters,
torch's fused AdamW: the reference) and `--optimizer master_adamw` (bf16 parameters, the fp32
master kept as 16-bit remainders, bf16 moments, te_mixtral/optim/). The second run is
loss-checked against the first. The table gives median step time, model TFLOP/s per GPU,
peak memory, bytes per parameter held for parameters, gradients and optimizer state, and
the ratios of the new core to the old.

    python3 -m benchmarks.training_core OUT_DIR [--tiers custom_grouped grouped_linear]
        [--config configs/mixtral-8x7b-2layer.yaml] [-- extra run_finetune_ep.py args]

`--quick` runs the tiny config on the CPU (bf16, which master_adamw keeps its parameters in;
the loop tier) to check that the script works, not to measure anything. Every run is checked
as the app checks it before the first starts: a bad flag is one line, not a failed run per log.

Its times are the app's own (each run's results.json, timed as every run is), not
benchmarks/common.py's timer: the point is a whole training step of each core. OUT_DIR holds
the runs (each with its results.json and run header), their logs and training_core.json, the
table: a folder rather than --json, since the runs write there too.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from te_mixtral.cli import parse_args
from te_mixtral.config import load_run_config
from te_mixtral.errors import UserError
from te_mixtral.files import write_text_atomic
from te_mixtral.measure.report import format_table

# Bytes per parameter for parameters + gradients + optimizer state, by optimizer.
BYTES_PER_PARAM = {"adamw": 4 + 4 + 8, "master_adamw": 2 + 2 + 2 + 4}
CORES = ("adamw", "master_adamw")
# --quick: the CPU check of the script. bf16 on both cores, as on a GPU (master_adamw needs it).
QUICK_CONFIG, QUICK_TIERS = "configs/tiny.yaml", ["loop"]
QUICK_ARGS = ["--steps", "6", "--timing-warmup-steps", "2", "--dtype", "bf16"]


def app_args(config: str, tier: str, core: str, extra: list[str]) -> list[str]:
    """The app's arguments for one run, but where it writes and what it checks the loss against."""
    return ["--config", config, "--tier", tier, "--optimizer", core, *extra]


def check_runs(config: str, tiers: list[str], extra: list[str]) -> None:
    """Every run's config read as the app reads it: a `UserError` for the first it would refuse."""
    for tier in tiers:
        for core in CORES:
            args, overrides = parse_args(app_args(config, tier, core, extra))
            load_run_config(args.config, overrides)


def run(out: Path, config: str, tier: str, core: str, extra: list[str], reference: Path | None) -> dict:
    folder = out / f"{tier}-{core}"
    command = [sys.executable, "run_finetune_ep.py", *app_args(config, tier, core, extra), "--output-dir", str(folder)]
    if reference is not None:
        command += ["--loss-check", str(reference)]
    print("==", " ".join(command), flush=True)
    log = out / f"{tier}-{core}.log"
    with open(log, "w") as stream:
        code = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT).returncode
    print(f"== exit {code} (log {log})", flush=True)
    results = folder / "results.json"
    return json.loads(results.read_text()) if results.exists() else {}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiers", nargs="+", default=["custom_grouped", "grouped_linear"])
    parser.add_argument("--config", default="configs/mixtral-8x7b-2layer.yaml")
    parser.add_argument("--quick", action="store_true")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.quick:
        args.config, args.tiers = QUICK_CONFIG, QUICK_TIERS
        extra += QUICK_ARGS
    try:
        check_runs(args.config, args.tiers, extra)
    except UserError as error:
        print(f"training_core: error: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)

    rows, failed = [], []
    for tier in args.tiers:
        results = {}
        for core in CORES:
            reference = args.out / f"{tier}-adamw" / "results.json" if core != "adamw" else None
            results[core] = run(args.out, args.config, tier, core, extra, reference)
        for core in CORES:
            r = results[core]
            if not r:
                failed.append(f"{tier}/{core}")
                continue
            s, base = r["summary"], results["adamw"].get("summary")
            check = r.get("loss_check")
            rows.append([
                tier, core, f"{s['median_step_ms']:.1f}", f"{s['tflops_per_gpu'] or 0:.0f}",
                f"{s['peak_memory_gib']:.1f}", str(BYTES_PER_PARAM[core]),
                f"{s['median_step_ms'] / base['median_step_ms']:.2f}" if base else "-",
                f"{s['peak_memory_gib'] / base['peak_memory_gib']:.2f}" if base else "-",
                ("passed" if check["passed"] else "FAILED") + f" (mean {check['mean_diff']:.1e})"
                if check else "reference",
            ])
    device = next((r["header"]["device"] for r in map(lambda p: json.loads(p.read_text()),
                                                       args.out.glob("*/results.json"))), "unknown")
    print(f"\nTraining core on {device}, {args.config}\n")
    print(format_table(rows, ["tier", "optimizer", "step ms", "TFLOP/s/GPU", "peak GiB", "B/param",
                              "step vs adamw", "memory vs adamw", "loss check vs adamw"]))
    write_text_atomic(args.out / "training_core.json", json.dumps({"device": device, "config": args.config,
                                                                   "rows": rows}, indent=1))
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
