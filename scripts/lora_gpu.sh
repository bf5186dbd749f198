#!/usr/bin/env bash
# scripts/lora_gpu.sh OUT_DIR RUN [RUN ...]
#   docs/lora.md's runs.
# The same as `python3 scripts/gpu_runs.py lora ...`, where the catalog and its description
# live; this name stays because dated results pages cite it.
exec python3 "$(dirname "$0")/gpu_runs.py" lora "$@"
