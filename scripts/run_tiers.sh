#!/usr/bin/env bash
# scripts/run_tiers.sh OUT_DIR CONFIG NGPU EP TIER [TIER ...] [-- EXTRA ...]
#   loop, then every other tier loss-checked against it.
# The same as `python3 scripts/gpu_runs.py tiers ...` (its catalog: scripts/gpu_catalogs/tiers.py);
# this name stays because dated results pages cite it.
exec python3 "$(dirname "$0")/gpu_runs.py" tiers "$@"
