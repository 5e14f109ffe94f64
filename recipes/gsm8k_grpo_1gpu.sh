#!/usr/bin/env bash
# GRPO on GSM8K, Qwen2.5-0.5B-Instruct, one GPU, colocated: vLLM generates, sleeps, the trainer
# takes the card, then the new weights go back to the engine (docs/guide-batching.md).
#   pip install -e '.[cuda,gsm8k]' && python recipes/prepare_gsm8k.py --out data/gsm8k
#   bash recipes/gsm8k_grpo_1gpu.sh
# Expect: read the step-0 eval_accuracy (greedy, all 1319 test problems, verl's strict `#### N` score) as
# this model's baseline under this scorer; peers report GRPO adding several points on this model within a
# few hundred steps (their numbers, not minirl's). Not yet run on a GPU by the minirl authors: watch the first steps' memory;
# if a step runs out of memory, halve --rl.micro-batch-per-replica (docs/guide-batching.md).
# Add --dry-run to print each rank's devices and memory estimate without touching a GPU.
set -euo pipefail
exec python -m minirl.grpo \
  --model.path Qwen/Qwen2.5-0.5B-Instruct \
  --model.dtype bfloat16 --model.activation-checkpointing \
  --task.name jsonl --task.path data/gsm8k/train.jsonl \
  --task.eval-path data/gsm8k/test.jsonl --task.eval-prompts 1319 \
  --steps 300 \
  --rl.group-size 8 \
  --rl.batch-per-replica 256 \
  --rl.mini-batch-per-replica 0 \
  --rl.micro-batch-per-replica 16 \
  --rl.lr 1e-6 \
  --rl.kl-coef 0.001 \
  --rl.colocated-offload \
  --rollout.max-prompt-tokens 512 --rollout.max-tokens 512 \
  --rollout.gpu-memory-utilization 0.5 \
  --checkpoint.every 50 \
  --log.eval-every 25 \
  --log.run-dir runs/gsm8k_grpo_0.5b \
  "$@"
