#!/usr/bin/env bash
# The prepared script for a lent GPU, under 10 minutes in all (bench/gpu_check.py's docstring says what
# its trainer-side checks measure). Through the device tool: run(command="bash bench/gpu_check.sh",
# timeout_s=600); results land in $OUT.
# 1. the trainer-side checks (FSDP2 over NCCL, offload, fp32 masters, the chunked head, throughput);
# 2. where vLLM with CUDA is importable (not on the lent H200 so far: its wheel is too large to carry),
#    a 1-GPU GRPO run of two steps with the profile (MINIRL_PROFILE_LOOP=1: the hand-off's phases and
#    memory), and on 2 GPUs disaggregated PPO (1 rollout + 1 train: vLLM's CUDA runner, the NCCL refit,
#    a rollout rank on vLLM's NCCL world), both with the built-in tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-bench/results}"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
python -c "from minirl import dist; print('minirl device type:', dist.device_type())"
timeout 240 python bench/gpu_check.py --out "$OUT/gpu_check.json" "$@"

if python -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null; then
  MINIRL_PROFILE_LOOP=1 timeout 150 python -m minirl.grpo --steps 2 --model.dtype bfloat16 \
    --log.run-dir "$OUT/grpo_1gpu" --log.overwrite 2>&1 | tail -n 5
  python -c "import json, sys; r = [json.loads(l) for l in open(sys.argv[1])]; \
print(json.dumps([x.get('grpo_step') for x in r if 'grpo_step' in x], indent=1))" "$OUT/grpo_1gpu/metrics.jsonl" \
    > "$OUT/grpo_1gpu_profile.json" || true
  if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    timeout 180 torchrun --standalone --nproc-per-node 2 -m minirl.ppo --steps 2 --model.dtype bfloat16 \
      --grid.rollout-ranks 1 --log.run-dir "$OUT/ppo_2gpu" --log.overwrite 2>&1 | tail -n 5
  else
    echo "gpu_check: one GPU here; the 2-GPU PPO run (NCCL refit, rollout rank on vLLM's NCCL world) is skipped"
  fi
else
  echo "gpu_check: no CUDA vLLM here; the entrypoints' two-step runs are skipped"
fi
