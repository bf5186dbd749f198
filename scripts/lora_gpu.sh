#!/usr/bin/env bash
# scripts/lora_gpu.sh OUT_DIR RUN [RUN ...]
#   docs/lora.md's runs.
# The same as `python3 scripts/gpu_runs.py lora ...` (its catalog: scripts/gpu_catalogs/lora.py);
# this name stays because dated results pages cite it.
exec python3 "$(dirname "$0")/gpu_runs.py" lora "$@"
