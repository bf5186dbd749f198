#!/usr/bin/env python3
"""The GPU runs, in one place: each catalog is data (a run's name -> the processes it
launches, scripts/gpu_catalogs/), and this launcher runs any of them the same way.

    python3 scripts/gpu_runs.py check OUT_DIR [NGPU] [STEPS]     everything that needs a GPU, on a fresh machine
    python3 scripts/gpu_runs.py tiers OUT_DIR CONFIG NGPU EP TIER [TIER ...] [-- EXTRA ...]
    python3 scripts/gpu_runs.py multi OUT_DIR NGPU [TIER ...]     the NCCL tests, every EP layout that fits
    python3 scripts/gpu_runs.py depth OUT_DIR RUN [RUN ...]       docs/full-model.md's runs
    python3 scripts/gpu_runs.py lora OUT_DIR RUN [RUN ...]        docs/lora.md's runs
    python3 scripts/gpu_runs.py rows OUT_DIR RUN [RUN ...]        few rows per expert: our kernels, FP8's break-even, decoding
    python3 scripts/gpu_runs.py list [depth|lora|rows]           the named runs, and the commands they launch
    python3 scripts/gpu_runs.py lanes OUT_DIR "GPUS CATALOG RUN ..." ...   several of the above at once

(`scripts/gpu_check.sh`, `run_tiers.sh`, `multi_gpu.sh`, `depth_gpu.sh` and `lora_gpu.sh`
call these with the same arguments: dated results pages name those command lines.)

- check: versions, the Transformer Engine import, the CUDA tests (`pytest -m cuda`), the
  expert FFN benchmark, and the tier runs on configs/mixtral-8x7b-2layer.yaml, EP over all
  NGPU GPUs (default 1). STEPS picks some of "tests bench tiers" (default: all three), to
  split the work over calls of a machine with a per-call time limit.
- tiers: `loop` first (the reference), then each other tier with --loss-check against it,
  each with its phase profile (`hf`, transformers' own model, without: the profile does not
  cover it; and single-process only). Every run's results.json and config land in
  OUT_DIR/TIER/, its log in OUT_DIR/TIER.log. EXTRA goes to every run.
- multi: on one host with NGPU GPUs (2, 4 or 8), the multi-GPU tests, then `tiers` at every
  EP layout that fits, and sharded by FSDP (gpu_catalogs/tiers.py's `multi_runs` says which).
  Default tiers: grouped_linear custom_grouped.
- depth, lora, rows: the named runs of gpu_catalogs/depth.py, lora.py and rows.py, in the
  order given. Each catalog's docstring says what its runs share, each run's comment what it
  is for; `list` shows the commands.
- lanes: each quoted lane is one of the command lines above without OUT_DIR ("0,1 depth
  ep2-cap0" runs `depth OUT_DIR/lane1-depth ep2-cap0` on GPUs 0 and 1), or several joined by
  " + " (run one after the other), all lanes at once on their own GPUs, so that one call of a
  machine with several GPUs runs several one-GPU jobs side by side. Each lane's output goes to
  OUT_DIR/laneK.log and its last lines to the screen once all have ended. KILL_AFTER_S=N in
  the environment: stop every lane still running after N seconds.

Each process's whole output goes to OUT_DIR/NAME.log; the screen gets its last lines (but the
per-step ones), or all of it for the tier runs and the test suites. Every run is attempted
even if an earlier one failed; the last line names those that failed, and the exit status
is non-zero if any did. STOP_AFTER_S=N in the environment: start nothing once N seconds
have gone, so that a call with a time limit still ends with its summary.

Transformer Engine and `datasets` must already be importable (installing them is the
caller's business: pip, an NGC container, or a machine-specific `source ...` first);
torchtitan too for depth's `titan`, the TE example (scripts/fetch_te_example.sh) for
`te-8layer`, axolotl's files (scripts/fetch_axolotl.sh) and bitsandbytes for lora's `axolotl-*`.
"""

import os
import re
import shlex
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

# The catalogs are the package beside this file. Run as `python3 scripts/gpu_runs.py`, Python puts
# this folder on sys.path itself; loaded by its path (tests/test_gpu_runs.py) it does not.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from gpu_catalogs.depth import DEPTH_RUNS
from gpu_catalogs.launch import GPUS, Launch, Note
from gpu_catalogs.lora import LORA_RUNS
from gpu_catalogs.rows import ROWS_RUNS
from gpu_catalogs.tiers import check_runs, multi_runs, tier_runs

REPO = HERE.parent
# The named catalogs, by the command that runs them.
CATALOGS = {"depth": DEPTH_RUNS, "lora": LORA_RUNS, "rows": ROWS_RUNS}

STEP_LINE = re.compile(r"^step |router:")


def launch(run: Launch, out: Path) -> bool:
    """Run one command from the repository root, its whole output into OUT_DIR/NAME.log;
    whether it succeeded."""
    log_path = out / f"{run.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if run.args[:1] != ("-c",):  # a script of its own is not worth printing
        print(f"$ {shlex.join(run.command(out))}", flush=True)
    last = deque(maxlen=run.tail or 1)
    try:
        with open(log_path, "w") as log, subprocess.Popen(
                run.command(out), cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **run.env},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as process:
            for line in process.stdout:
                log.write(line)
                if run.tail is None:
                    print(line, end="", flush=True)
                elif not STEP_LINE.search(line):
                    last.append(line)
    except OSError as e:  # the program is not there
        print(f"{run.name}: {e}")
        return False
    if run.tail:
        print("".join(last), end="")
    if run.show:
        lines = log_path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("=== "):
                print("\n".join(lines[i:i + run.show + 1]))
    return process.returncode == 0


def run_all(sections: dict[str, list], out: Path) -> int:
    """Run each section's launches under a heading; say at the end what failed (or was not
    started), and return the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    stop_after = float(os.environ.get("STOP_AFTER_S", "0"))
    start, failed, not_started = time.monotonic(), [], []
    for heading, runs in sections.items():
        if stop_after > 0 and time.monotonic() - start >= stop_after:
            not_started.append(heading)
            continue
        print(f"\n=== {heading} ===", flush=True)
        for run in runs:
            if isinstance(run, Note):
                print(run.text)
            elif not launch(run, out):
                failed.append(run.name)
    if not_started:
        print(f"\nnot started (past STOP_AFTER_S={stop_after:g} s): {' '.join(not_started)}")
    print(f"\nfailed: {' '.join(failed) or 'none'}  (logs in {out})")
    return 1 if failed else 0


USAGE = __doc__.split("\n\n")[1]


def sections(argv: list[str]) -> tuple[Path, dict[str, list]]:
    """OUT_DIR and the runs that a command line asks for, by heading."""
    if len(argv) < 2:
        raise SystemExit(f"usage:\n{USAGE}")
    catalog, out, rest = argv[0], Path(argv[1]).resolve(), argv[2:]
    if catalog == "check":
        return out, check_runs(int(rest[0]) if rest else 1, rest[1] if len(rest) > 1 else "tests bench tiers")
    if catalog == "tiers":
        extra = rest[rest.index("--") + 1:] if "--" in rest else []
        rest = rest[:rest.index("--")] if "--" in rest else rest
        if len(rest) < 4:
            raise SystemExit(f"usage:\n{USAGE}")
        config, ngpu, ep, tiers = rest[0], int(rest[1]), int(rest[2]), rest[3:]
        return out, {f"tiers: {config}, {ngpu} GPUs, EP={ep}": tier_runs("", config, ngpu, ep, tiers, extra)}
    if catalog == "multi":
        if not rest:
            raise SystemExit(f"usage:\n{USAGE}")
        return out, multi_runs(int(rest[0]), rest[1:] or ["grouped_linear", "custom_grouped"])
    if catalog in CATALOGS:
        unknown = [name for name in rest if name not in CATALOGS[catalog]]
        if unknown or not rest:
            raise SystemExit(f"unknown or no run: {' '.join(unknown)}; {catalog}'s runs: "
                             f"{' '.join(CATALOGS[catalog])}")
        return out, {"GPUs": [GPUS], **{name: CATALOGS[catalog][name] for name in rest}}
    raise SystemExit(f"unknown catalog '{catalog}'\nusage:\n{USAGE}")


def run_lanes(out: Path, lanes: list[str]) -> int:
    """`lanes`: each "GPUS CATALOG ARG ..." a process of this script on those GPUs, all at once."""
    out.mkdir(parents=True, exist_ok=True)
    kill_after = float(os.environ.get("KILL_AFTER_S", "0")) or None
    running = []
    for k, lane in enumerate(lanes, 1):
        gpus, *segments = lane.split(maxsplit=1)
        log = open(out / f"lane{k}.log", "w")
        # "CATALOG RUN ... + CATALOG RUN ...": one after the other, each into its own folder
        commands = [shlex.join([sys.executable, __file__, catalog, str(out / f"lane{k}-{catalog}"), *rest])
                    for catalog, *rest in (segment.split() for segment in " ".join(segments).split(" + "))]
        print(f"lane{k} (GPUs {gpus}): {' ; '.join(commands)}", flush=True)
        running.append((k, log, subprocess.Popen(["bash", "-c", " ; ".join(commands) + " ; exit $?"], cwd=REPO,
                                                 stdout=log, stderr=subprocess.STDOUT,
                                                 env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus},
                                                 start_new_session=True)))
    start, codes = time.monotonic(), {}
    for k, log, process in running:
        try:
            codes[k] = process.wait(timeout=None if kill_after is None
                                    else max(0.0, kill_after - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # the lane's torchrun and its ranks too
            codes[k] = f"killed after KILL_AFTER_S={kill_after:g} s"
            process.wait()
        log.close()
    for k, _, _ in running:
        lines = (out / f"lane{k}.log").read_text(errors="replace").splitlines()
        print(f"\n##### lane{k}: {codes[k]}\n" + "\n".join(lines[-40:]), flush=True)
    return 0 if all(code == 0 for code in codes.values()) else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["lanes"]:
        if len(argv) < 3:
            raise SystemExit(f"usage:\n{USAGE}")
        return run_lanes(Path(argv[1]).resolve(), argv[2:])
    if argv[:1] == ["list"]:
        for catalog in argv[1:] or list(CATALOGS):
            for name, runs in CATALOGS[catalog].items():
                for run in runs:
                    print(f"{catalog} {name}: {shlex.join(run.command(Path('OUT_DIR')))}")
        return 0
    out, runs = sections(argv)
    return run_all(runs, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
