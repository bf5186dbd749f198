# What the GPU run scripts (scripts/lora_gpu.sh, scripts/depth_gpu.sh) share: their OUT_DIR
# argument, a heading per run, launching a run with its whole log kept, and the list of the
# runs that failed at the end. Sourced, not run: a script sets USAGE, then
#   source "$(dirname "${BASH_SOURCE[0]}")/runs_common.sh"
# takes OUT_DIR from its first argument (the run names are left in "$@"), makes the folder,
# moves to the repository root and prints the GPUs; the script ends with `finish`.
set -uo pipefail
OUT_DIR=${1:?usage: $USAGE}
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$REPO"
export PYTHONUNBUFFERED=1
failed=()
step() { echo; echo "=== $1 ==="; }

# One run on NPROC GPUs (under torchrun when more than one), the rest of the arguments given
# to python (a script, or -m and a module): its whole output in OUT_DIR/NAME.log, its last
# lines but the per-step ones on the screen, NAME listed as failed if it fails.
launch() {  # name, GPUs, python arguments
    local name=$1 nproc=$2; shift 2
    local launch=(python3)
    [ "$nproc" -gt 1 ] && launch=(torchrun --standalone --nproc_per_node="$nproc")
    "${launch[@]}" "$@" 2>&1 | tee "$OUT_DIR/$name.log" | grep -v "^step \|router:" | tail -18 || failed+=("$name")
}

finish() {  # the last line says what failed; non-zero if anything did
    echo
    echo "failed steps: ${failed[*]:-none}"
    [ ${#failed[@]} -eq 0 ]
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || failed+=("nvidia-smi")
