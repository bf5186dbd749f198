#!/usr/bin/env bash
# The load-balancing loss on and off at Mixtral-8x7B shapes: 100 steps each, router_aux_loss_coef
# 0.02 (Mixtral's) and 0, then the expert load (busiest/mean as EP=2, 4 and 8 would place the
# experts), the step time and the LM-loss difference over the run.
#   scripts/aux_loss_run.sh OUT [extra keys...]     configs/mixtral-8x7b-8layer.yaml on one GPU
#   NGPU=2 CONFIG=configs/mixtral-8x7b-16layer-ep2.yaml scripts/aux_loss_run.sh OUT   EP=2 on two
set -euo pipefail
out=${1:?usage: scripts/aux_loss_run.sh OUT [--key value ...]}
shift
cd "$(dirname "$0")/.."
config=${CONFIG:-configs/mixtral-8x7b-8layer.yaml}  # CONFIG=configs/tiny.yaml: a quick CPU check of the script
ngpu=${NGPU:-1}
launch=(python3 run_finetune_ep.py)
[ "$ngpu" -gt 1 ] && launch=(torchrun --standalone --nproc_per_node="$ngpu" run_finetune_ep.py --ep-size "$ngpu")
for coef in 0.02 0; do
  "${launch[@]}" --config "$config" --steps 100 --log_every 10 \
    --model.router_aux_loss_coef "$coef" --output-dir "$out/aux-$coef" --overwrite true "$@"
done
python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {coef: json.loads((out / f"aux-{coef}" / "results.json").read_text()) for coef in ("0.02", "0")}
for coef, r in runs.items():
    load = r["expert_load"]
    busiest = "  ".join(f"EP={p} {statistics.mean(v):.3f}" for p, v in load["busiest_rank_over_mean"].items())
    print(f"coef {coef:>4}: median step {r['summary']['median_step_ms']:.1f} ms  aux {statistics.mean(r['aux_losses']):.4f}  "
          f"expert max/mean {statistics.mean(load['max_over_mean']):.3f} (one expert per rank)  busiest rank/mean {busiest}  "
          f"(means over the run)")
on, off = runs["0.02"]["losses"], runs["0"]["losses"]
diff = [a - b for a, b in zip(on, off)]
print(f"LM loss, coef 0.02 minus 0: mean {statistics.mean(diff):+.4f}, last 10 steps {statistics.mean(diff[-10:]):+.4f}, "
      f"final {on[-1]:.4f} vs {off[-1]:.4f}")
PY
echo "results pages: python -m te_mixtral.results $out/aux-0.02 $out/aux-0 --out docs/results --suffix aux-loss"
