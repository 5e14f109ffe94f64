#!/usr/bin/env bash
# The trainer-side checks for a lent H200 (bench/gpu_check.py's docstring says what it measures).
# Through the device tool: run(command="bash bench/gpu_check.sh", timeout_s=420); results land in $OUT.
# The box has torch, transformers and safetensors but no vLLM, so nothing here builds an engine.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-bench/results}"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
timeout 360 python bench/gpu_check.py --out "$OUT/gpu_check.json" "$@"
