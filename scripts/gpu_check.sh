#!/usr/bin/env bash
# Everything that needs a GPU, in one go, on a fresh GPU machine:
#   versions -> Transformer Engine import -> CUDA tests -> expert FFN benchmark -> (end-to-end runs)
#
# Usage, from anywhere:  scripts/gpu_check.sh OUT_DIR [NGPU] [STEPS]
#   OUT_DIR  logs and JSON results are written here (created if missing)
#   NGPU     GPUs the end-to-end runs may use (default 1); fewer present is an error
#   STEPS    which of "tests bench tiers" to run (default: all three), e.g. to split the
#            work over two calls of a machine with a per-call time limit
#
# Transformer Engine must already be importable: installing it is the caller's business
# (pip, an NGC container, or a machine-specific `source ...` before this script).
# Every step runs even if an earlier one failed; the exit status is non-zero if any failed.
set -uo pipefail

OUT_DIR=${1:?usage: scripts/gpu_check.sh OUT_DIR [NGPU]}
NGPU=${2:-1}
STEPS=${3:-tests bench tiers}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$REPO"
export PYTHONUNBUFFERED=1

failed=()  # names of the steps that failed; `|| failed+=(...)` runs in this shell, pipes or not
step() { echo; echo "=== $1 ==="; }

# --- versions --------------------------------------------------------------------------
step "versions"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || failed+=("nvidia-smi")
python3 - "$NGPU" <<'EOF' || failed+=("versions")
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
EOF

# --- Transformer Engine ----------------------------------------------------------------
step "Transformer Engine import"
python3 - <<'EOF' || failed+=("te-import")
import torch

from te_mixtral.experts.registry import make_tier
from te_mixtral.experts.grouped_linear import MIN_TE_VERSION
from te_mixtral.te_support import require_te

te = require_te(MIN_TE_VERSION)
print(f"imported {te.__name__} from {te.__file__}")
make_tier("grouped_linear").check_available(torch.device("cuda"))
print("tier grouped_linear: available")
EOF

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

# --- CUDA tests ------------------------------------------------------------------------
if wanted tests; then
step "pytest -m cuda tests"
python3 -m pytest -m cuda tests -q -rfEs 2>&1 | tee "$OUT_DIR/pytest_gpu.log" || failed+=("pytest")
fi

# --- expert FFN benchmark --------------------------------------------------------------
if wanted bench; then
step "python3 -m benchmarks.expert_ffn"
python3 -m benchmarks.expert_ffn --json "$OUT_DIR/expert_ffn.json" 2>&1 | tee "$OUT_DIR/expert_ffn.log" \
    || failed+=("expert_ffn")
fi

# --- end-to-end tier runs --------------------------------------------------------------
# Reduced-layer Mixtral-8x7B, one packed 8192-token sequence per GPU, EP over all GPUs;
# `loop` first, every other tier loss-checked against it.
if wanted tiers; then
step "tier runs: configs/mixtral-8x7b-2layer.yaml, EP=$NGPU"
scripts/run_tiers.sh "$OUT_DIR/tiers" configs/mixtral-8x7b-2layer.yaml "$NGPU" "$NGPU" \
    hf grouped_linear custom_grouped device_mxfp8 -- --batch_size "$NGPU" || failed+=("tier runs")
fi

# --- summary ---------------------------------------------------------------------------
step "summary"
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}  (logs in $OUT_DIR)"
    exit 1
fi
echo "all steps passed  (logs in $OUT_DIR)"
