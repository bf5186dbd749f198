#!/usr/bin/env bash
# The multi-GPU runs on one host with NGPU GPUs (2, 4 or 8): the NCCL tests, then the tier
# runs at every EP layout that fits: EP=2 on two GPUs; with four, EP=4 and EP=2 x DP=2; with
# eight, also EP=8 and EP=2 x DP=4. Each run records its peak memory beside the estimate's,
# and the sharded (--sharding fsdp) runs are the ones that check the estimate's FSDP terms:
# EP=1 x DP=2 on two GPUs, EP=2 x DP=2 on four.
# Transformer Engine must already be importable (see scripts/gpu_check.sh).
#
#   scripts/multi_gpu.sh OUT_DIR NGPU [TIER...]      (default tiers: grouped_linear custom_grouped)
set -uo pipefail
out=${1:?usage: scripts/multi_gpu.sh OUT_DIR NGPU [TIER...]} ngpu=${2:?NGPU}
shift 2
tiers=("$@")
[ ${#tiers[@]} -eq 0 ] && tiers=(grouped_linear custom_grouped)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
mkdir -p "$out"
failed=()

echo "=== pytest -m multigpu"
python3 -m pytest -m multigpu tests -q -rfEs 2>&1 | tee "$out/pytest_multigpu.log" || failed+=(pytest)

config=configs/mixtral-8x7b-2layer.yaml
steps=(--steps 12 --timing_warmup_steps 4)
echo "=== EP=2 on 2 GPUs"
CUDA_VISIBLE_DEVICES=0,1 scripts/run_tiers.sh "$out/ep2" "$config" 2 2 "${tiers[@]}" -- --batch_size 2 "${steps[@]}" \
  || failed+=(ep2)
fsdp=(--sharding fsdp --optimizer master_adamw --dtype bf16)
echo "=== EP=1 x DP=2 on 2 GPUs, sharded by FSDP"
CUDA_VISIBLE_DEVICES=0,1 scripts/run_tiers.sh "$out/dp2-fsdp" "$config" 2 1 custom_grouped -- --batch_size 2 \
  "${fsdp[@]}" "${steps[@]}" || failed+=(dp2-fsdp)
if [ "$ngpu" -ge 4 ]; then
  echo "=== EP=4 on 4 GPUs"
  scripts/run_tiers.sh "$out/ep4" "$config" 4 4 "${tiers[@]}" -- --batch_size 4 "${steps[@]}" || failed+=(ep4)
  echo "=== EP=2 x DP=2 on 4 GPUs"
  scripts/run_tiers.sh "$out/ep2dp2" "$config" 4 2 "${tiers[@]}" -- --batch_size 4 "${steps[@]}" || failed+=(ep2dp2)
  echo "=== EP=2 x DP=2 on 4 GPUs, sharded by FSDP"
  scripts/run_tiers.sh "$out/ep2dp2-fsdp" "$config" 4 2 custom_grouped -- --batch_size 4 "${fsdp[@]}" "${steps[@]}" \
    || failed+=(ep2dp2-fsdp)
fi
if [ "$ngpu" -ge 8 ]; then
  echo "=== EP=8 on 8 GPUs"
  scripts/run_tiers.sh "$out/ep8" "$config" 8 8 "${tiers[@]}" -- --batch_size 8 "${steps[@]}" || failed+=(ep8)
  echo "=== EP=2 x DP=4 on 8 GPUs (the TE tutorial's layout)"
  scripts/run_tiers.sh "$out/ep2dp4" "$config" 8 2 "${tiers[@]}" -- --batch_size 8 "${steps[@]}" || failed+=(ep2dp4)
fi
if ((${#failed[@]})); then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all multi-GPU steps passed"
