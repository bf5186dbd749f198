#!/usr/bin/env bash
# scripts/depth_gpu.sh OUT_DIR RUN [RUN ...]
#   docs/full-model.md's runs.
# The same as `python3 scripts/gpu_runs.py depth ...` (its catalog: scripts/gpu_catalogs/depth.py);
# this name stays because dated results pages cite it.
exec python3 "$(dirname "$0")/gpu_runs.py" depth "$@"
