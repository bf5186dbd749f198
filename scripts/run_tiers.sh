#!/usr/bin/env bash
# Step-time and loss-check tiers on one config: `loop` first (the reference), then each
# other tier with --loss-check against it. Every run's results.json, config and log land
# in OUT_DIR/<tier>/.
#
#   scripts/run_tiers.sh OUT_DIR CONFIG NGPU EP TIER [TIER...] [-- extra run_finetune_ep.py args]
#   scripts/run_tiers.sh runs/h100 configs/mixtral-8x7b-2layer.yaml 1 1 hf grouped_linear
set -uo pipefail
out=$1 config=$2 ngpu=$3 ep=$4
shift 4
tiers=() extra=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do tiers+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift && extra=("$@")
cd "$(dirname "$0")/.."
mkdir -p "$out"

failed=()
launch() {  # tier, then its own arguments
  local tier=$1; shift
  local cmd=(python3 run_finetune_ep.py)
  [ "$ngpu" -gt 1 ] && cmd=(torchrun --standalone --nproc_per_node="$ngpu" run_finetune_ep.py)
  echo "== $tier: ${cmd[*]} --config $config --tier $tier --ep-size $ep --output-dir $out/$tier $* ${extra[*]}"
  "${cmd[@]}" --config "$config" --tier "$tier" --ep-size "$ep" --output-dir "$out/$tier" "$@" "${extra[@]}" \
    2>&1 | tee "$out/$tier.log"
  local code=${PIPESTATUS[0]}
  echo "== $tier exit $code"
  [ "$code" -eq 0 ] || failed+=("$tier")
}

# Every te_mixtral tier also times its phases (te_mixtral/measure/phases.py); `hf` is transformers'
# own model, which that profile does not cover.
launch loop --profile_phases true
for tier in "${tiers[@]}"; do
  [ "$tier" = loop ] && continue
  if [ "$tier" = hf ]; then
    if [ "$ngpu" -gt 1 ]; then echo "== hf skipped: single process only"; continue; fi
    launch hf --loss-check "$out/loop/results.json"
  else
    launch "$tier" --loss-check "$out/loop/results.json" --profile_phases true
  fi
done

if ((${#failed[@]})); then echo "== failed: ${failed[*]}"; exit 1; fi
