#!/usr/bin/env bash
# scripts/multi_gpu.sh OUT_DIR NGPU [TIER ...]
#   the multi-GPU tests and the tier runs at every EP layout that fits.
# The same as `python3 scripts/gpu_runs.py multi ...` (its catalog: scripts/gpu_catalogs/tiers.py);
# this name stays because dated results pages cite it.
exec python3 "$(dirname "$0")/gpu_runs.py" multi "$@"
