#!/usr/bin/env bash
# scripts/gpu_check.sh OUT_DIR [NGPU] [STEPS]
#   everything that needs a GPU, on a fresh GPU machine.
# The same as `python3 scripts/gpu_runs.py check ...` (its catalog: scripts/gpu_catalogs/tiers.py);
# this name stays because dated results pages cite it.
exec python3 "$(dirname "$0")/gpu_runs.py" check "$@"
