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

# Where vLLM with CUDA is importable (not on the lent H200: its wheel is too large to carry there),
# two steps of each entrypoint with the built-in tiny model: GRPO on 1 GPU, PPO on 2 (1 rollout + 1 train).
if python -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null; then
  timeout 300 python -m minirl.grpo --steps 2 --model.dtype bfloat16 --log.run-dir "$OUT/grpo_1gpu" \
    2>&1 | tail -n 5
  if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    timeout 300 torchrun --standalone --nproc-per-node 2 -m minirl.ppo --steps 2 --model.dtype bfloat16 \
      --grid.rollout-ranks 1 --log.run-dir "$OUT/ppo_2gpu" 2>&1 | tail -n 5
  fi
else
  echo "gpu_check: no CUDA vLLM here; the entrypoints' two-step runs are skipped"
fi
