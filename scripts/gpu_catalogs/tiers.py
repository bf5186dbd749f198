"""The tier sweeps: `tier_runs` runs `loop` (the reference) and each other tier loss-checked
against it; `check` and `multi` are made of them, built from the command line's numbers rather
than named: `check_runs`, everything a fresh GPU machine should pass, and `multi_runs`, the
multi-GPU tests and every EP layout a host fits."""

from gpu_catalogs.launch import GPUS, Launch, Note


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


def check_runs(ngpu: int, steps: str) -> dict[str, list]:
    """Versions, the Transformer Engine import, then those of "tests bench tiers" that `steps`
    names: the CUDA tests, the expert FFN benchmark, the tier runs at EP over all `ngpu` GPUs."""
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
    """The multi-GPU tests, then `tiers` at every EP layout that fits `ngpu` GPUs: EP=2 on two
    GPUs; with four, EP=4 and EP=2 x DP=2; with eight, also EP=8 and EP=2 x DP=4. The sharded
    (--sharding fsdp) runs check the estimate's FSDP terms: EP=1 x DP=2 on two GPUs, EP=2 x DP=2
    on four."""
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
