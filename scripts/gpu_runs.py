#!/usr/bin/env python3
"""The GPU runs, in one place: each catalog is data (a run's name -> the processes it
launches), and one launcher runs any of them the same way.

    python3 scripts/gpu_runs.py check OUT_DIR [NGPU] [STEPS]     everything that needs a GPU, on a fresh machine
    python3 scripts/gpu_runs.py tiers OUT_DIR CONFIG NGPU EP TIER [TIER ...] [-- EXTRA ...]
    python3 scripts/gpu_runs.py multi OUT_DIR NGPU [TIER ...]     the NCCL tests, every EP layout that fits
    python3 scripts/gpu_runs.py depth OUT_DIR RUN [RUN ...]       docs/depth.md's runs
    python3 scripts/gpu_runs.py lora OUT_DIR RUN [RUN ...]        docs/lora.md's runs
    python3 scripts/gpu_runs.py rows OUT_DIR RUN [RUN ...]        few rows per expert: our kernels, FP8's break-even, decoding
    python3 scripts/gpu_runs.py list [depth|lora]                the named runs, and the commands they launch
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
  EP layout that fits: EP=2 on two GPUs; with four, EP=4 and EP=2 x DP=2; with eight, also
  EP=8 and EP=2 x DP=4. The sharded (--sharding fsdp) runs check the estimate's FSDP terms:
  EP=1 x DP=2 on two GPUs, EP=2 x DP=2 on four. Default tiers: grouped_linear custom_grouped.
- depth: what stands between a rank's share of the full Mixtral-8x7B and its targets: 16
  layers at EP=2 on two GPUs with each recompute setting and tier, each with its phase
  profile, a kernel profile, the 2-layer one-GPU step, the two peers, the 8-layer kernel
  profiles beside TE's example and the TE backend's fusions with and without, the expert
  GEMMs' tiles at the 8-layer step's rows, and the full model at EP=4 (docs/full-model.md says why each). Every training run: full fine-tuning, bf16 parameters
  with master_adamw, the config's lr 2e-5, one packed 8192-token sequence per GPU per step,
  15 steps of which the first 5 are left out of the timing, the same seed.
- lanes: each quoted lane is one of the command lines above without OUT_DIR ("0,1 depth
  ep2-cap0" runs `depth OUT_DIR/lane1-depth ep2-cap0` on GPUs 0 and 1), or several joined by
  " + " (run one after the other), all lanes at once on their own GPUs, so that one call of a machine with several GPUs runs several one-GPU jobs side by
  side. Each lane's output goes to OUT_DIR/laneK.log and its last lines to the screen once all
  have ended. KILL_AFTER_S=N in the environment: stop every lane still running after N seconds.
- lora: the adapter tests, then Mixtral-8x7B LoRA runs beside full fine-tuning, the FP8 and
  NF4 bases, transformers + PEFT and axolotl's ScatterMoE-LoRA (and Mixtral-8x22B over the
  NF4 base). Every run: custom_grouped (BF16 base) unless named, one packed 8192-token
  sequence per GPU per step, 30 steps, the same seed, so that the runs' losses compare the
  bases step by step (nf4-smoke's short run aside: 2 layers, 8 steps, each of its runs under
  a time limit).

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
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Launch:
    """One command: `python3 ARGS`, under torchrun when `nproc` > 1 (or `program` ARGS).
    "{out}" in ARGS stands for OUT_DIR."""

    name: str  # its log is OUT_DIR/NAME.log; a failure is listed by this name
    nproc: int
    args: tuple[str, ...]
    program: tuple[str, ...] = ("python3",)
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    tail: int | None = 18  # lines shown at the end (per-step lines left out); None: all of it as it comes
    show: int = 0  # also show each "=== " heading of the log with this many lines after it (a table)
    timeout_s: int | None = None  # stopped past this many seconds (coreutils' timeout), a failure

    def command(self, out: Path) -> list[str]:
        program = list(self.program)
        if self.nproc > 1:
            program = ["torchrun", "--standalone", f"--nproc_per_node={self.nproc}"]
        if self.timeout_s:
            program = ["timeout", "--kill-after=10", str(self.timeout_s), *program]
        return program + [arg.replace("{out}", str(out)) for arg in self.args]


@dataclass(frozen=True)
class Note:
    """A line printed in place of a launch (a run left out, and why)."""

    text: str


# --- tier sweeps (check, tiers, multi) --------------------------------------------------


def tier_runs(out: str, config: str, ngpu: int, ep: int, tiers: list[str], extra: list[str],
              env: dict[str, str] | None = None) -> list:
    """`loop`, then each other tier loss-checked against it, into OUT_DIR/`out`/."""
    where = f"{{out}}/{out}".rstrip("/") if out else "{out}"

    def run(tier: str, *own: str) -> Launch:
        return Launch(f"{out}/{tier}".lstrip("/"), ngpu,
                      ("run_finetune_ep.py", "--config", config, "--tier", tier, "--ep-size", str(ep),
                       "--output-dir", f"{where}/{tier}", *own, *extra), env=dict(env or {}), tail=None)

    check = ("--loss-check", f"{where}/loop/results.json")
    runs = [run("loop", "--profile_phases", "true")]
    for tier in tiers:
        if tier == "loop":
            continue
        if tier == "hf":
            runs.append(Note("hf skipped: single process only") if ngpu > 1 else run("hf", *check))
        else:
            runs.append(run(tier, *check, "--profile_phases", "true"))
    return runs


# Printed by the first steps of `check`, run in a process of their own from the repository root.
VERSIONS = """
import sys
from importlib import metadata

import torch

from te_mixtral.te_support import te_version

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"

print(f"python {sys.version.split()[0]}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
      f"TE {te_version() or 'not installed'}  triton {version('triton')}")
count = torch.cuda.device_count()
print(f"GPUs visible to torch: {count}, asked for: {sys.argv[1]}")
sys.exit(0 if count >= int(sys.argv[1]) else 1)
"""
TE_IMPORT = """
import torch

from te_mixtral.experts.grouped_linear import MIN_TE_VERSION
from te_mixtral.experts.registry import make_tier
from te_mixtral.te_support import require_te

te = require_te(MIN_TE_VERSION)
print(f"imported {te.__name__} from {te.__file__}")
make_tier("grouped_linear").check_available(torch.device("cuda"))
print("tier grouped_linear: available")
"""
GPUS = Launch("nvidia-smi", 1, ("--query-gpu=index,name,memory.total,driver_version", "--format=csv"),
              program=("nvidia-smi",), tail=None)


def check_runs(ngpu: int, steps: str) -> dict[str, list]:
    wanted = steps.split()
    runs = {"versions": [GPUS, Launch("versions", 1, ("-c", VERSIONS, str(ngpu)), tail=None)],
            "Transformer Engine import": [Launch("te-import", 1, ("-c", TE_IMPORT), tail=None)]}
    if "tests" in wanted:
        runs["pytest -m cuda tests"] = [Launch("pytest_gpu", 1, ("-m", "pytest", "-m", "cuda", "tests", "-q", "-rfEs"),
                                               tail=None)]
    if "bench" in wanted:
        runs["python3 -m benchmarks.expert_ffn"] = [
            Launch("expert_ffn", 1, ("-m", "benchmarks.expert_ffn", "--json", "{out}/expert_ffn.json"), tail=None)]
    if "tiers" in wanted:
        # Reduced-layer Mixtral-8x7B, one packed 8192-token sequence per GPU, EP over all GPUs.
        runs[f"tier runs: configs/mixtral-8x7b-2layer.yaml, EP={ngpu}"] = tier_runs(
            "tiers", "configs/mixtral-8x7b-2layer.yaml", ngpu, ngpu,
            ["hf", "grouped_linear", "custom_grouped", "device_mxfp8"], ["--batch_size", str(ngpu)])
    return runs


def multi_runs(ngpu: int, tiers: list[str]) -> dict[str, list]:
    config, steps = "configs/mixtral-8x7b-2layer.yaml", ["--steps", "12", "--timing_warmup_steps", "4"]
    fsdp = ["--sharding", "fsdp", "--optimizer", "master_adamw", "--dtype", "bf16"]
    two = {"CUDA_VISIBLE_DEVICES": "0,1"}
    runs = {"pytest -m multigpu": [Launch("pytest_multigpu", 1, ("-m", "pytest", "-m", "multigpu", "tests", "-q",
                                                                 "-rfEs"), tail=None)],
            "EP=2 on 2 GPUs": tier_runs("ep2", config, 2, 2, tiers, ["--batch_size", "2", *steps], two),
            "EP=1 x DP=2 on 2 GPUs, sharded by FSDP": tier_runs("dp2-fsdp", config, 2, 1, ["custom_grouped"],
                                                                 ["--batch_size", "2", *fsdp, *steps], two)}
    if ngpu >= 4:
        runs["EP=4 on 4 GPUs"] = tier_runs("ep4", config, 4, 4, tiers, ["--batch_size", "4", *steps])
        runs["EP=2 x DP=2 on 4 GPUs"] = tier_runs("ep2dp2", config, 4, 2, tiers, ["--batch_size", "4", *steps])
        runs["EP=2 x DP=2 on 4 GPUs, sharded by FSDP"] = tier_runs(
            "ep2dp2-fsdp", config, 4, 2, ["custom_grouped"], ["--batch_size", "4", *fsdp, *steps])
    if ngpu >= 8:
        runs["EP=8 on 8 GPUs"] = tier_runs("ep8", config, 8, 8, tiers, ["--batch_size", "8", *steps])
        runs["EP=2 x DP=4 on 8 GPUs (the TE tutorial's layout)"] = tier_runs(
            "ep2dp4", config, 8, 2, tiers, ["--batch_size", "8", *steps])
    return runs


# --- depth ------------------------------------------------------------------------------

DEPTH = "configs/mixtral-8x7b-16layer-ep2.yaml"
# The 16-layer config's training settings, on the full model at EP=4.
FULL = ("configs/mixtral-8x7b.yaml", "--ep-size", "4", "--batch_size", "4", "--lr", "2e-5", "--warmup_steps", "3",
        "--dtype", "bf16", "--optimizer", "master_adamw", "--recompute", "selective", "--profile_phases", "true")
PEER_STEPS = ("--steps", "15", "--warmup", "5")


def depth_train(name: str, nproc: int, config: str, *extra: str) -> list[Launch]:
    return [Launch(name, nproc, ("run_finetune_ep.py", "--config", config, "--steps", "15", "--timing_warmup_steps",
                                 "5", "--plots", "false", *extra, "--output-dir", f"{{out}}/{name}"))]


def pytest_gpu(name: str, *tests: str) -> list[Launch]:
    return [Launch(name, 1, ("-m", "pytest", "-q", *tests))]


# megatron-core 0.19.2 from the wheel carried in .whl/ where it does not import (its only
# dependencies, torch, numpy and packaging, are on the GPU image).
MEGATRON_INSTALL = Launch("megatron-core", 1, ("-c", "python3 -c 'import megatron.core' 2>/dev/null || python3 -m pip "
                                                     "install --no-deps --quiet .whl/megatron_core-0.19.2-*.whl"),
                          program=("bash",))


def beside_megatron(name: str, nproc: int, peer: tuple[str, ...], config: str, *ours: str) -> list[Launch]:
    """Megatron-Core's run, then ours at the same layers, EP, GPUs and rows, both with Mixtral's
    load-balancing loss at 0.02."""
    return [MEGATRON_INSTALL,
            Launch(f"{name}-megatron", nproc, ("-m", "benchmarks.megatron_peer", *peer, *PEER_STEPS, "--json",
                                               f"{{out}}/{name}-megatron.json")),
            *depth_train(f"{name}-ours", nproc, config, *ours, "--model.router_aux_loss_coef", "0.02")]


EIGHT = "configs/mixtral-8x7b-8layer.yaml"


def kernel_profile(name: str, which: str, *flags: str) -> Launch:
    """benchmarks/kernel_profile.py at 8 layers on one GPU (ours: custom_grouped), its table
    shown, its --json at OUT_DIR/NAME.json."""
    ours = ("--tier", "custom_grouped", "--output-dir", f"{{out}}/{name}") if which == "ours" else ()
    return Launch(name, 1, ("-m", "benchmarks.kernel_profile", which, "--config", EIGHT, *ours, *flags, "--json",
                            f"{{out}}/{name}.json"), tail=0, show=18)


# TE's te_mixtral example on one GPU at 8 layers (benchmarks/te_example.py; needs .peers/te_mixtral_example)
TE_8LAYER = Launch("te-8layer", 1, ("-m", "benchmarks.te_example", "--example-dir", ".peers/te_mixtral_example",
                                    "--config", EIGHT, *PEER_STEPS, "--json", "{out}/te-8layer.json"))


def kernel_compare(first: str, second: str, *names: str) -> Launch:
    """benchmarks/kernel_compare.py over two kernel_profile runs of the same call."""
    return Launch(f"compare-{first}-{second}", 1, ("-m", "benchmarks.kernel_compare", f"{{out}}/{first}.json",
                                                   f"{{out}}/{second}.json", *(("--names", *names) if names else ())),
                  tail=None)


# 16384 rows over 8 experts as unevenly as the 8-layer step's router on random weights (the
# busiest expert 1.68x the mean), the expert GEMMs' split in that step
SKEWED_8X2048 = "3441+2719+2243+1997+1838+1603+1399+1144"


def gemm_tiles(name: str, cases: str, *extra: str) -> Launch:
    """benchmarks/custom_grouped_gemms.py at `cases` (with `extra`'s arguments), its last lines
    (the sums, the picks) shown, its --json at OUT_DIR/NAME.json; it starts no tile but the
    tables' own after 200 s."""
    return Launch(name, 1, ("-m", "benchmarks.custom_grouped_gemms", "--cases", cases, *extra, "--budget-s", "200",
                            "--json", f"{{out}}/{name}.json"), tail=32)


def depth_16(name: str, tier: str, recompute: str, *extra: str) -> list[Launch]:
    """A 16-layer EP=2 run with its phase profile."""
    return depth_train(name, 2, DEPTH, "--ep-size", "2", "--tier", tier, "--recompute", recompute,
                       "--profile_phases", "true", *extra)


DEPTH_RUNS = {
    # 16 layers, EP=2, custom_grouped, no recompute (fits 16 layers, not the full model)
    "cg-none": depth_16("cg-none", "custom_grouped", "none"),
    # the same, the expert FFN recomputed (what the full model at EP=4 needs)
    "cg-selective": depth_16("cg-selective", "custom_grouped", "selective"),
    # the same, every layer recomputed
    "cg-full": depth_16("cg-full", "custom_grouped", "full"),
    # grouped_linear (TE's GroupedLinear), selective recompute
    "gl-selective": depth_16("gl-selective", "grouped_linear", "selective"),
    # device_mxfp8, selective recompute, no FP8 weight cache (it does not fit with one)
    "fp8-selective": depth_16("fp8-selective", "device_mxfp8", "selective", "--fp8.weight_cache", "false"),
    # CUDA kernel time per step by kind (benchmarks/kernel_profile.py), custom_grouped, selective
    # recompute, 16 layers, EP=2 (each rank prints its own)
    "profile": [Launch("profile", 2, ("-m", "benchmarks.kernel_profile", "ours", "--config", DEPTH, "--tier",
                                      "custom_grouped", "--output-dir", "{out}/profile", "--ep-size", "2",
                                      "--recompute", "selective"), show=12)],
    # 2 layers on one GPU, custom_grouped, one causal 8192-token sequence, 30 steps, master_adamw
    # (as the step it is to beat was measured)
    "2layer": depth_train("2layer", 1, "configs/mixtral-8x7b-2layer.yaml", "--tier", "custom_grouped", "--dtype",
                          "bf16", "--optimizer", "master_adamw", "--steps", "30", "--profile_phases", "true"),
    # torchtitan's MoE at the same 16 layers, EP=2, tokens and GPUs (benchmarks/torchtitan_peer.py:
    # varlen attention, bf16 training)
    "titan": [Launch("titan", 2, ("-m", "benchmarks.torchtitan_peer", "--config", DEPTH, "--ep", "2", "--attention",
                                  "varlen", "--dtype", "bfloat16", *PEER_STEPS, "--json", "{out}/titan.json"))],
    # TE's te_mixtral example on one GPU at 8 layers (16 do not fit one GPU)
    # (benchmarks/te_example.py; needs .peers/te_mixtral_example)
    "te-8layer": [TE_8LAYER],
    # ours beside it: custom_grouped, 8 layers, one GPU
    "ours-8layer": depth_train("ours-8layer", 1, EIGHT, "--tier", "custom_grouped"),
    # the kernel profiles of both at 8 layers on one GPU (benchmarks/kernel_profile.py) and their
    # table side by side (benchmarks/kernel_compare.py)
    "kernels-vs-te": [kernel_profile("kernels-ours", "ours"), kernel_profile("kernels-te", "te"),
                      kernel_compare("kernels-ours", "kernels-te")],
    # the TE backend's fusions (--te_fusions) at 8 layers on one GPU: ours with them, TE's example,
    # ours without them (step times); then the three kernel profiles, ours against TE's and ours
    # with against without
    "fusions-8layer": [*depth_train("ours-8layer", 1, EIGHT, "--tier", "custom_grouped"),
                       TE_8LAYER,
                       *depth_train("ours-8layer-unfused", 1, EIGHT, "--tier", "custom_grouped", "--te_fusions",
                                    "false"),
                       kernel_profile("kernels-ours", "ours"), kernel_profile("kernels-te", "te"),
                       kernel_profile("kernels-ours-unfused", "ours", "--te_fusions", "false"),
                       kernel_compare("kernels-ours", "kernels-te"),
                       kernel_compare("kernels-ours", "kernels-ours-unfused", "fused", "unfused")],
    # custom_grouped's six expert GEMMs alone at the 8-layer step's rows (8 experts x 2048, and
    # its uneven split): every candidate tile of the table checked against torch, then timed in
    # turn beside cuBLAS per expert and grouped_mm; last the tile-table entries it would pick
    "gemm-tiles": [gemm_tiles("gemm-tiles", f"8x2048,{SKEWED_8X2048}")],
    # the same at EP=2's rows (4 experts x 4096) and at 16 experts x 1024
    "gemm-tiles-ep": [gemm_tiles("gemm-tiles-ep", "4x4096,16x1024")],
    # TE's example's expert GEMMs by shape: 8 steps of it at 8 layers recording each layer's rows
    # per expert, then ours and TE's grouped GEMM at the last step's rows, layer by layer, GEMM by
    # GEMM (benchmarks/op_profile.py --cases-from), summed over the step
    "te-gemms-by-shape": [
        Launch("te-splits", 1, ("-m", "benchmarks.te_example", "--example-dir", ".peers/te_mixtral_example",
                                "--config", EIGHT, "--steps", "8", "--warmup", "3", "--splits-json",
                                "{out}/te-splits.json")),
        Launch("te-gemms-by-shape", 1, ("-m", "benchmarks.op_profile", "--family", "8x7b", "--cases-from",
                                        "{out}/te-splits.json", "--ops", "custom_grouped,TE", "--json",
                                        "{out}/te_gemms_by_shape.json"), tail=30)],
    # the fusions' GPU tests (tests/gpu/test_fusions_gpu.py)
    "fusion-tests": [Launch("fusion-tests", 1, ("-m", "pytest", "-q", "-rfEs", "tests/gpu/test_fusions_gpu.py"),
                            tail=None)],
    # the full model itself: all 32 layers, EP=4 on four GPUs, custom_grouped, selective recompute
    # (the estimate's choice), phase profile (four H200s)
    "full-ep4": depth_train("full-ep4", 4, *FULL, "--tier", "custom_grouped"),
    # the same with device_mxfp8, no FP8 weight cache
    "fp8-full-ep4": depth_train("fp8-full-ep4", 4, *FULL, "--tier", "device_mxfp8", "--fp8.weight_cache", "false"),
    # full-ep4 with the expert FFN recomputed in the first 27 of the 32 layers only, the fewest
    # that fit four H200s by the estimate (--estimate-memory 4 --gpu h200)
    "full-ep4-fewest": depth_train("full-ep4-fewest", 4, *FULL, "--tier", "custom_grouped", "--recompute_layers", "27"),
    # full-ep4-fewest without its phase profile, each MoE layer's exchanges in N chunks overlapped
    # with the experts (--ep_chunks N; c1: no overlap): the overlap's A/B
    **{f"full-ep4-c{n}": depth_train(f"full-ep4-c{n}", 4, *FULL, "--tier", "custom_grouped", "--recompute_layers",
                                     "27", "--profile_phases", "false", "--ep_chunks", str(n)) for n in (1, 2, 3)},
    # LoRA r=16 over the whole model at EP=4, custom_grouped, no recompute, --ep_chunks N
    **{f"lora-ep4-c{n}": depth_train(f"lora-ep4-c{n}", 4, "configs/mixtral-8x7b.yaml", "--ep-size", "4",
                                     "--batch_size", "4", "--lr", "2e-5", "--warmup_steps", "3", "--dtype", "bf16",
                                     "--tier", "custom_grouped", "--lora.rank", "16", "--recompute", "none",
                                     "--ep_chunks", str(n)) for n in (1, 2)},
    # The padded exchange's A/B (--ep_capacity: no host wait for split sizes; 0: exact splits),
    # 16 layers, EP=2, custom_grouped, selective recompute; then each one's kernel profile, whose
    # "GPU idle between kernels" line shows the host's waits
    **{f"ep2-cap{cap}": depth_16(f"ep2-cap{cap}", "custom_grouped", "selective", "--profile_phases", "false",
                                 "--ep_capacity", cap) for cap in ("0", "1.5")},
    **{f"profile-ep2-cap{cap}": [Launch(f"profile-ep2-cap{cap}", 2, (
        "-m", "benchmarks.kernel_profile", "ours", "--config", DEPTH, "--tier", "custom_grouped", "--output-dir",
        f"{{out}}/profile-ep2-cap{cap}", "--ep-size", "2", "--recompute", "selective", "--ep_capacity", cap),
        show=12)] for cap in ("0", "1.5")},
    # lora-ep4-c1 with the padded exchange
    "lora-ep4-cap1.5": depth_train("lora-ep4-cap1.5", 4, "configs/mixtral-8x7b.yaml", "--ep-size", "4",
                                   "--batch_size", "4", "--lr", "2e-5", "--warmup_steps", "3", "--dtype", "bf16",
                                   "--tier", "custom_grouped", "--lora.rank", "16", "--recompute", "none",
                                   "--ep_capacity", "1.5"),
    # whether an all-to-all runs under the expert GEMMs at all, four GPUs (benchmarks/overlap_probe.py)
    "overlap-probe": [Launch("overlap-probe", 4, ("-m", "benchmarks.overlap_probe", "--json",
                                                  "{out}/overlap-probe.json"), tail=None)],
    # the AdamW kernels on CUDA, bit for bit against the torch path on the CPU (compiled without
    # fused multiply-adds), then the optimizer step's time against its bandwidth floor
    "moments8-tests": [*pytest_gpu("adamw-kernel-tests", "-rs", "tests/optim/test_adamw_kernel.py", "-k",
                                   "cuda or compiled"),
                       Launch("optimizer-step", 1, ("-m", "benchmarks.optimizer_step", "--json",
                                                    "{out}/optimizer_step.json"), tail=30)],
    # the loss reference for 8-bit moments: 8 layers on one GPU, custom_grouped, master_adamw as
    # the config has it (bf16 moments), 200 steps on the embedded text
    "8layer-master": depth_train("8layer-master", 1, "configs/mixtral-8x7b-8layer.yaml", "--tier", "custom_grouped",
                                 "--steps", "200"),
    # the same with the experts' moments in 8 bits (--expert_moments 8bit), its loss checked
    # against 8layer-master's (run that first, in the same call)
    "8layer-8bit": depth_train("8layer-8bit", 1, "configs/mixtral-8x7b-8layer.yaml", "--tier", "custom_grouped",
                               "--steps", "200", "--expert_moments", "8bit", "--loss-check",
                               "{out}/8layer-master/results.json"),
    # the loss check's noise: a change known to be correct (TE's GroupedLinear for the experts: the
    # same sums in another order), 200 steps as 8layer-master, compared with it as 8layer-8bit is
    "8layer-control": depth_train("8layer-control", 1, "configs/mixtral-8x7b-8layer.yaml", "--tier", "grouped_linear",
                                  "--steps", "200"),
    # full-ep4 with the experts' moments in 8 bits, recomputing the expert FFN in the first 11 of
    # the 32 layers, the fewest that fit four H200s by the estimate (27 without 8-bit moments;
    # --recompute none needs 154 GiB a rank, not 140)
    "full-ep4-8bit": depth_train("full-ep4-8bit", 4, *FULL, "--tier", "custom_grouped", "--expert_moments", "8bit",
                                 "--recompute_layers", "11"),
    # what the estimate, corrected by the whole-model runs, fits on four H200s: 8-bit expert
    # moments with no recompute at all, and bf16 moments recomputing the expert FFN in 20 layers
    "full-ep4-8bit-none": depth_train("full-ep4-8bit-none", 4, *FULL, "--tier", "custom_grouped", "--expert_moments",
                                      "8bit", "--recompute", "none"),
    "full-ep4-20": depth_train("full-ep4-20", 4, *FULL, "--tier", "custom_grouped", "--recompute_layers", "20"),
    # Megatron-Core beside ours (benchmarks/megatron_peer.py, then our run at the same layers, EP,
    # GPUs and rows, both with Mixtral's load-balancing loss at 0.02):
    # 4 layers on one GPU; ours: custom_grouped, no recompute
    "megatron-4l-ep1": beside_megatron("megatron-4l-ep1", 1, ("--config", "configs/mixtral-8x7b-8layer.yaml",
                                                              "--layers", "4", "--ep", "1"),
                                       "configs/mixtral-8x7b-8layer.yaml", "--model.num_hidden_layers", "4",
                                       "--tier", "custom_grouped"),
    # 8 layers, EP=2 on two GPUs; ours: custom_grouped, no recompute
    "megatron-8l-ep2": beside_megatron("megatron-8l-ep2", 2, ("--config", DEPTH, "--layers", "8", "--ep", "2"),
                                       DEPTH, "--model.num_hidden_layers", "8", "--ep-size", "2", "--recompute",
                                       "none", "--tier", "custom_grouped"),
    # the same with Megatron's MoE all-to-all overlap (--moe-overlap, each GPU's row cut into 2
    # micro-batches of 4096 tokens)
    "megatron-8l-ep2-overlap": beside_megatron(
        "megatron-8l-ep2-overlap", 2, ("--config", DEPTH, "--layers", "8", "--ep", "2", "--moe-overlap",
                                       "--micro-batches", "2"),
        DEPTH, "--model.num_hidden_layers", "8", "--ep-size", "2", "--recompute", "none", "--tier", "custom_grouped"),
    # the whole model, EP=4 on four GPUs; Megatron with its precision-aware optimizer (bf16
    # moments, 16-bit master remainders), bf16 gradients and full recompute of every layer, to
    # fit; ours: full-ep4-fewest
    "megatron-32l-ep4": beside_megatron(
        "megatron-32l-ep4", 4, ("--config", "configs/mixtral-8x7b.yaml", "--batch-size", "4", "--ep", "4",
                                "--recompute", "full", "--precision-aware-optimizer", "--grads", "bf16"),
        *FULL, "--tier", "custom_grouped", "--recompute_layers", "27"),
}


# --- lora -------------------------------------------------------------------------------

LORA_FLAGS = ("--tier", "custom_grouped", "--steps", "30", "--timing_warmup_steps", "5", "--warmup_steps", "3", "--lr",
              "2e-5", "--seq_len", "8192", "--dtype", "bf16", "--plots", "false")
LORA_COMMON = ("--config", "configs/mixtral-8x7b.yaml", *LORA_FLAGS)
LORA = ("--lora.rank", "16")
# The LoRA peers' config: all 32 layers, one sequence per GPU, rank 16 and alpha 16 as ours.
LORA_PEER = ("--config", "configs/mixtral-8x7b-lora.yaml", "--alpha", "16")


def axolotl_peer(name: str, *extra: str) -> Launch:
    """benchmarks/axolotl_peer.py on one GPU at the LoRA peers' config, its JSON as OUT_DIR/NAME.json."""
    return Launch(name, 1, ("-m", "benchmarks.axolotl_peer", *LORA_PEER, *extra, "--json", f"{{out}}/{name}.json"))


def lora_train(name: str, nproc: int, *extra: str) -> list[Launch]:
    return [Launch(name, nproc, ("run_finetune_ep.py", *LORA_COMMON, "--batch_size", str(nproc), *extra,
                                 "--output-dir", f"{{out}}/{name}"))]


LORA_RUNS = {
    # the GPU tests of the adapters alone (LoRA, its memory estimate, its recompute)
    "lora-tests": pytest_gpu("lora-tests", "tests/gpu/test_lora_gpu.py", "tests/gpu/test_memory_lora_gpu.py",
                             "tests/gpu/test_recompute_gpu.py::test_lora_gradients_equal_no_recompute_bf16"),
    # the GPU tests of the device_mxfp8 tier
    "fp8-tests": pytest_gpu("fp8-tests", "tests/gpu/test_device_mxfp8_gpu.py"),
    # the GPU tests of the adapters and of the kernels they run in
    "tests": pytest_gpu("tests", "tests/gpu/test_lora_gpu.py", "tests/gpu/test_memory_lora_gpu.py",
                        "tests/gpu/test_custom_grouped_gpu.py", "tests/gpu/test_small_shared_gpu.py",
                        "tests/gpu/test_grouped_linear_gpu.py",
                        "tests/gpu/test_te_permute_gpu.py", "tests/gpu/test_device_mxfp8_gpu.py"),
    # 8 layers, every weight trained (bf16 parameters, master_adamw)
    "full-8layer": lora_train("full-8layer", 1, "--model.num_hidden_layers", "8", "--optimizer", "master_adamw"),
    # 8 layers, LoRA r=16 on every target
    "lora-8layer": lora_train("lora-8layer", 1, "--model.num_hidden_layers", "8", *LORA),
    # all 32 layers, LoRA r=16, selective recompute (one H200 holds it)
    "lora-32layer": lora_train("lora-32layer", 1, *LORA, "--recompute", "selective"),
    # the same recomputing the expert FFN in the first 13 layers only, the fewest that fit one
    # H200 (the run axolotl's and the NF4 base's are compared with)
    "lora-32layer-fewest": lora_train("lora-32layer-fewest", 1, *LORA, "--recompute", "selective",
                                      "--recompute_layers", "13"),
    # all 32 layers, LoRA r=16, EP=2 on two GPUs, no recompute (two H200s hold it)
    "lora-32layer-ep2": lora_train("lora-32layer-ep2", 2, *LORA, "--ep-size", "2"),
    # the same with full recompute (two H100s hold it)
    "lora-32layer-ep2-full": lora_train("lora-32layer-ep2-full", 2, *LORA, "--ep-size", "2", "--recompute", "full"),
    # all 32 layers, LoRA r=16, EP=4 on four GPUs, selective recompute (beside depth's full-ep4,
    # full fine-tuning at the same setting)
    "lora-32layer-ep4": lora_train("lora-32layer-ep4", 4, *LORA, "--ep-size", "4", "--recompute", "selective"),
    # 8 layers, LoRA r=16 over the FP8 base (beside lora-8layer)
    "lora-fp8-8layer": lora_train("lora-fp8-8layer", 1, "--model.num_hidden_layers", "8", *LORA, "--tier",
                                  "device_mxfp8"),
    # all 32 layers, LoRA r=16 over the FP8 base (device_mxfp8), selective recompute (one H100 holds it)
    "lora-fp8-32layer": lora_train("lora-fp8-32layer", 1, *LORA, "--tier", "device_mxfp8", "--recompute",
                                   "selective"),
    # the same without recompute (one H200 holds it)
    "lora-fp8-32layer-norecompute": lora_train("lora-fp8-32layer-norecompute", 1, *LORA, "--tier", "device_mxfp8",
                                               "--recompute", "none"),
    # the FP8 base against the BF16 base on one batch (benchmarks/lora_fp8_base.py); one layer:
    # the op's own error; four: with the routing it changes downstream
    "fp8-accuracy": [Launch(f"fp8-accuracy-{layers}", 1, ("-m", "benchmarks.lora_fp8_base", "--layers", str(layers)))
                     for layers in (1, 4)],
    # CUDA kernel time per step by kind (benchmarks/kernel_profile.py), 8 layers, LoRA r=16:
    # device_mxfp8 (the FP8 base) then custom_grouped (the BF16 base)
    "profile-8layer": [Launch(f"profile-8layer-{tier}", 1, ("-m", "benchmarks.kernel_profile", "ours", "--config",
                                                           "configs/mixtral-8x7b-lora.yaml", "--tier", tier,
                                                           "--model.num_hidden_layers", "8", "--recompute", "none",
                                                           "--lora.alpha", "16"), tail=0, show=40)
                       for tier in ("device_mxfp8", "custom_grouped")],
    # the same over the NF4 base (custom_grouped, --lora.base nf4), its JSON beside for kernel_compare
    "profile-8layer-nf4": [Launch("profile-8layer-nf4", 1, ("-m", "benchmarks.kernel_profile", "ours", "--config",
                                                          "configs/mixtral-8x7b-lora.yaml", "--tier", "custom_grouped",
                                                          "--model.num_hidden_layers", "8", "--recompute", "none",
                                                          "--lora.alpha", "16", "--lora.base", "nf4", "--json",
                                                          "{out}/profile-8layer-nf4.json"), tail=0, show=40)],
    # the GPU tests of the NF4 base (tests/gpu/test_nf4_gpu.py; its bitsandbytes test needs
    # bitsandbytes installed, e.g. pip install --no-deps .whl/bitsandbytes-*.whl, else it skips)
    "nf4-tests": pytest_gpu("nf4-tests", "-rs", "tests/gpu/test_nf4_gpu.py"),
    # the NF4 base against the BF16 base on one batch, 1 and 4 layers, beside bitsandbytes' NF4 on
    # the same weights (benchmarks/nf4_accuracy.py; without bitsandbytes, ours alone)
    "nf4-accuracy": [Launch("nf4-accuracy", 1, ("-m", "benchmarks.nf4_accuracy", "--layers", "1", "4"))],
    # all 32 layers, LoRA r=16 over the NF4 base (--lora.base nf4), selective recompute
    "lora-nf4-32layer": lora_train("lora-nf4-32layer", 1, *LORA, "--lora.base", "nf4", "--recompute", "selective"),
    # the same with full recompute (the estimate's fit for a 48 GB card)
    "lora-nf4-32layer-full": lora_train("lora-nf4-32layer-full", 1, *LORA, "--lora.base", "nf4", "--recompute",
                                        "full"),
    # the least recompute the estimate fits in 40 GiB (a 48 GB card): full recompute in the first
    # 28 layers (39.75 GiB estimated), then 29 (38.28): the estimate's peak is the head's
    # backward, and the last layers' backward, which it does not count, holds a transient BF16
    # copy of gate_up beside every layer's activations (the NF4 base above 128 rows per expert)
    "lora-nf4-32layer-fit": [launch for layers in ("28", "29") for launch in lora_train(
        f"lora-nf4-32layer-full{layers}", 1, *LORA, "--lora.base", "nf4", "--recompute", "full",
        "--recompute_layers", layers)],
    # the whole Mixtral-8x22B (56 layers), LoRA r=16 over the NF4 base, full recompute (one H200
    # holds it by the estimate, 102 GiB)
    "lora-nf4-8x22b": [Launch("lora-nf4-8x22b", 1, ("run_finetune_ep.py", "--config", "configs/mixtral-8x22b.yaml",
                                                    *LORA_FLAGS, "--batch_size", "1", *LORA, "--lora.base", "nf4",
                                                    "--recompute", "full", "--output-dir", "{out}/lora-nf4-8x22b"))],
    # transformers + PEFT on all 32 layers, the same tokens, gradient checkpointing
    # (benchmarks/peft_peer.py; one H200 holds it)
    "peft-32layer": [Launch("peft-32layer", 1, ("-m", "benchmarks.peft_peer", *LORA_PEER, "--json",
                                                "{out}/peft-32layer.json"))],
    # the same on two GPUs under torchrun, DistributedDataParallel (two H200s)
    "peft-32layer-ddp": [Launch("peft-32layer-ddp", 2, ("-m", "benchmarks.peft_peer", *LORA_PEER, "--json",
                                                        "{out}/peft-32layer-ddp.json"))],
    # axolotl 0.21's ScatterMoE-LoRA (benchmarks/axolotl_peer.py; needs .peers/axolotl, made by
    # scripts/fetch_axolotl.sh, and bitsandbytes for the NF4 base), to run first: its GPU tests, then
    # 2 layers over each base, 10 steps
    "axolotl-smoke": [*pytest_gpu("axolotl-tests", "-rs", "tests/gpu/test_axolotl_peer_gpu.py"),
                      *(axolotl_peer(f"axolotl-2layer-{base}", "--base", base, "--layers", "2", "--steps", "10",
                                     "--warmup", "3") for base in ("bf16", "nf4"))],
    # all 32 layers, the tokens of peft-32layer, bf16 base, gradient checkpointing (one H200 holds it)
    "axolotl-32layer": [axolotl_peer("axolotl-32layer")],
    # the same over bitsandbytes' NF4 (axolotl's QLoRA: load_in_4bit with quantize_moe_experts)
    "axolotl-qlora-32layer": [axolotl_peer("axolotl-qlora-32layer", "--base", "nf4")],
}

# nf4-tests, nf4-accuracy and lora-nf4-32layer in one go
LORA_RUNS["nf4"] = [*LORA_RUNS["nf4-tests"], *LORA_RUNS["nf4-accuracy"], *LORA_RUNS["lora-nf4-32layer"]]
# the NF4 base's kernels on a GPU in four minutes: its GPU tests, its accuracy, and 8 steps of
# 2 layers, LoRA r=16 over it, each stopped if it runs long
LORA_RUNS["nf4-smoke"] = [replace(run, timeout_s=seconds) for run, seconds in zip(
    [*LORA_RUNS["nf4-tests"], *LORA_RUNS["nf4-accuracy"],
     *lora_train("lora-nf4-2layer", 1, *LORA, "--lora.base", "nf4", "--recompute", "selective",
                 "--model.num_hidden_layers", "2", "--steps", "8", "--timing_warmup_steps", "3")], (80, 70, 70))]

# Few rows per expert: custom_grouped's few-rows tables, the FP8 tier's break-even, batch-1
# decoding (one GPU each)
FEW_ROWS_GRID = ("-m", "benchmarks.custom_grouped_grid", "--tokens", "16,32,64,128,256,512,1024", "--splits", "uniform",
                 "--tiles", "previous")
ROWS_RUNS = {
    # the BF16 grid at 16-1024 rows per expert over 1-8 local experts, both families: step time
    # (host included) and GPU time against TE and grouped_mm, the floors, and the tables before
    # the few-rows ones beside; then where the op's host time goes at one and two experts
    "few-rows": [*(Launch(f"grid-{family}", 1, (*FEW_ROWS_GRID, "--family", family, "--json",
                                                  f"{{out}}/grid-{family}.json"), tail=40) for family in ("8x7b", "8x22b")),
                 Launch("host-time", 1, ("-m", "benchmarks.custom_grouped_host_time", "--cases", "1x16,1x64,2x64",
                                         "--tiles", "previous", "--cprofile"), tail=60)],
    # the BF16 grid at 16-1024 rows per expert over 1-8 local experts, both families, with every
    # other expert tier beside ours as a training step calls it (loop, grouped_linear with its
    # host sync, device_mxfp8 with its run defaults: BF16 kernels under its break-even)
    "few-rows-tiers": [Launch(f"grid-tiers-{family}", 1, (
        "-m", "benchmarks.custom_grouped_grid", "--tokens", "16,32,64,128,256,512,1024", "--splits", "uniform",
        "--family", family, "--json", f"{{out}}/grid-tiers-{family}.json"), tail=60) for family in ("8x7b", "8x22b")],
    # custom_grouped's CUDA tests (accuracy against float64 at every table, CUDA graphs, no host sync)
    "few-rows-tests": pytest_gpu("custom-grouped-tests", "-m", "cuda", "tests/gpu/test_custom_grouped_gpu.py"),
    # device_mxfp8 against custom_grouped by rows per local expert, its default fallback included
    "fp8-break-even": [Launch("fp8-break-even", 1, ("-m", "benchmarks.fp8_break_even", "--json",
                                                    "{out}/fp8_break_even.json"))],
    # the two tiers' CUDA tests, then host / GPU / op ms a fwd+bwd at 1-8 local experts and
    # where the host's time goes (cProfile)
    "launch": [*pytest_gpu("launch-tests", "-m", "cuda", "tests/gpu/test_custom_grouped_gpu.py",
                           "tests/gpu/test_device_mxfp8_gpu.py"),
               Launch("host-time-launch", 1, ("-m", "benchmarks.custom_grouped_host_time", "--cases",
                                              "1x16,1x64,2x64,8x16", "--cprofile"), tail=60)],
    # where FP8's time goes at one local expert (8x7B, 64, 512 and 1024 rows), each step ending in an
    # empty optimizer step as fp8_break_even times it: kernel table, GPU idle time, host cProfile,
    # beside BF16
    "fp8-profile": [Launch("fp8-profile", 1, ("-m", "benchmarks.op_profile", "--family", "8x7b", "--cases",
                                              "1x64,1x512,1x1024", "--ops", "custom_grouped,device_mxfp8",
                                              "--optimizer-step", "--json", "{out}/fp8_profile.json"), tail=40)],
    # the 8x22B points where a peer's GPU time beat ours in the few-rows grid (its results page lists
    # them): the kernel tables of ours, TE and grouped_mm side by side
    "misses-8x22b": [Launch("misses-8x22b", 1, ("-m", "benchmarks.op_profile", "--family", "8x22b", "--cases",
                                                "8x32,4x64,8x64,1x128,2x128,4x128,8x128,2x256,4x256,1x512", "--ops",
                                                "custom_grouped,TE,grouped_mm", "--json",
                                                "{out}/misses_8x22b.json"), tail=40)],
    # the few-rows grid's points still missed without a measured cause, each GEMM of ours, TE and
    # grouped_mm against its own bytes and FLOPs, with its grid (op_profile's GEMM table): 8x7B
    # 64 x 8 and 128 x 2, where a peer's GPU time beat ours, and the points of 64-256 rows over 2-8
    # experts above 1.3x the bandwidth floor, with ours' tables beside where they differ: the ones
    # before the few-rows tables, the 128-row one, and the few-rows one of 64 rows (which ran
    # 128 x 2 in the grid); 8x22B 512 x 2 and x 8 and two of its floor misses
    "misses-causes": [
        Launch("misses-causes-8x7b", 1, ("-m", "benchmarks.op_profile", "--family", "8x7b", "--cases",
                                         "8x64,2x128,2x64,4x64,4x128,8x128,2x256", "--ops", "custom_grouped,TE,grouped_mm",
                                         "--tiles", "previous", "--tiles", "medium, few rows", "--tiles", "few rows, 64",
                                         "--json", "{out}/misses_causes_8x7b.json"), tail=40),
        Launch("misses-causes-8x22b", 1, ("-m", "benchmarks.op_profile", "--family", "8x22b", "--cases",
                                          "2x512,8x512,4x64,8x128", "--ops", "custom_grouped,TE,grouped_mm", "--json",
                                          "{out}/misses_causes_8x22b.json"), tail=40)],
    # 65-128 rows over 2-3 experts, where the op now runs the "two row tiles" table: the grid
    # beside the few-rows table of 64 rows it ran there before, both families
    "two-row-tiles": [Launch(f"two-row-tiles-{family}", 1, (
        "-m", "benchmarks.custom_grouped_grid", "--family", family, "--experts", "2,3", "--tokens", "96,128",
        "--splits", "uniform,skewed", "--tiles", "few rows, 64", "--json", f"{{out}}/two_row_tiles_{family}.json"),
        tail=30) for family in ("8x7b", "8x22b")],
    # 8x22B, 2 experts of 512 rows, where the grid and the profile disagreed on which op is faster:
    # the grid's point three times over, then its kernel profile
    "point-8x22b-2x512": [*(Launch(f"point-8x22b-2x512-grid{n}", 1, (
        "-m", "benchmarks.custom_grouped_grid", "--family", "8x22b", "--experts", "2", "--tokens", "512",
        "--splits", "uniform", "--json", f"{{out}}/point_8x22b_2x512_grid{n}.json"), tail=20) for n in (1, 2, 3)),
        Launch("point-8x22b-2x512-profile", 1, ("-m", "benchmarks.op_profile", "--family", "8x22b", "--cases", "2x512",
                                                "--ops", "custom_grouped,TE,grouped_mm", "--json",
                                                "{out}/point_8x22b_2x512_profile.json"), tail=40)],
    # the two weight gradients alone at the floor misses' points (8x7B), each tile candidate of
    # their table beside it (those that hold more programs an SM among them), checked against
    # torch, cuBLAS and grouped_mm, each with its bytes floor; last the picks
    "wgrad-tiles": [gemm_tiles("wgrad-tiles", "2x64,4x64,8x64,2x128,4x128,8x128,2x256", "--gemms",
                               "down_wgrad,gate_up_wgrad")],
    # the 64-row table's weight-gradient tile where the sweep above did not time it: one expert
    # of 65-128 rows, which the same table serves, beside the cases it was picked on
    "wgrad-one-expert": [gemm_tiles("wgrad-one-expert", "1x64,1x96,1x128,2x64,4x64,8x64", "--gemms",
                                    "down_wgrad,gate_up_wgrad")],
    # the grid's missed points that misses-causes did not profile, per GEMM
    "misses-rest": [
        Launch("misses-rest-8x7b", 1, ("-m", "benchmarks.op_profile", "--family", "8x7b", "--cases",
                                       "1x16,2x16,1x32,2x32,1x64,1x128,1x256,4x256,8x256,1x512,2x512,4x512,8x512",
                                       "--ops", "custom_grouped,TE,grouped_mm", "--json", "{out}/misses_rest_8x7b.json"),
               tail=40),
        Launch("misses-rest-8x22b", 1, ("-m", "benchmarks.op_profile", "--family", "8x22b", "--cases",
                                        "1x16,2x16,1x32,8x32,1x64,2x64,8x64,1x128,2x128,4x128,1x256,2x256,4x256,8x256,"
                                        "1x512,4x512", "--ops", "custom_grouped,TE,grouped_mm", "--json",
                                        "{out}/misses_rest_8x22b.json"), tail=40)],
    # generation's GPU tests (graphed tokens equal eager ones), then greedy batch-1 decoding of
    # the whole 8x7B beside transformers' generate and the bandwidth floor
    "decode": [*pytest_gpu("generate-tests", "-m", "cuda", "tests/gpu/test_generate_gpu.py"),
               Launch("decode-b1", 1, ("-m", "benchmarks.decode_b1", "--json", "{out}/decode_b1.json"), tail=40)],
}

CATALOGS = {"depth": DEPTH_RUNS, "lora": LORA_RUNS, "rows": ROWS_RUNS}


# --- the launcher -----------------------------------------------------------------------

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
