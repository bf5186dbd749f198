#!/usr/bin/env bash
# LoRA on one GPU, in one go: the adapter tests, then 8 layers of Mixtral-8x7B fine-tuned
# in full and with LoRA (same tier, tokens and GPU), then all 32 layers with LoRA where the
# bf16 base fits (an H200: `--estimate-memory` says so first).
#
# Usage: scripts/lora_gpu.sh OUT_DIR [TIER] [STEPS]
#   TIER   expert tier of the runs (default custom_grouped)
#   STEPS  optimizer steps of each run (default 30)
# Transformer Engine and `datasets` must be importable (see scripts/gpu_check.sh).
set -uo pipefail
OUT_DIR=${1:?usage: scripts/lora_gpu.sh OUT_DIR [TIER] [STEPS]}
TIER=${2:-custom_grouped}
STEPS=${3:-30}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$REPO"
export PYTHONUNBUFFERED=1
failed=()
step() { echo; echo "=== $1 ==="; }

step "versions"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || failed+=("nvidia-smi")

step "tests"
python3 -m pytest -q -x tests/gpu/test_lora_gpu.py tests/gpu/test_custom_grouped_gpu.py \
    tests/gpu/test_grouped_linear_gpu.py 2>&1 | tee "$OUT_DIR/tests.log" | tail -15 || failed+=("tests")

COMMON=(--tier "$TIER" --steps "$STEPS" --timing_warmup_steps 5 --warmup_steps 3 --lr 2e-5 --batch_size 1
        --seq_len 8192 --dtype bf16 --plots false)
run() {  # name, extra arguments
    local name=$1; shift
    step "$name"
    python3 run_finetune_ep.py --config configs/mixtral-8x7b.yaml "${COMMON[@]}" "$@" \
        --output-dir "$OUT_DIR/$name" 2>&1 | tee "$OUT_DIR/$name.log" | grep -v "^step " | tail -22 \
        || failed+=("$name")
}
run full-8layer --model.num_hidden_layers 8 --optimizer master_adamw
run lora-8layer --model.num_hidden_layers 8 --lora.rank 16
if python3 run_finetune_ep.py --config configs/mixtral-8x7b.yaml "${COMMON[@]}" --lora.rank 16 \
        --recompute selective --estimate-memory 1 | tail -1 | grep -q "^fits"; then
    run lora-32layer --lora.rank 16 --recompute selective
else
    echo "the 32-layer bf16 base does not fit this GPU (--estimate-memory above): skipped"
fi

echo
echo "failed steps: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
