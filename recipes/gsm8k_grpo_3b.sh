#!/usr/bin/env bash
# GRPO on GSM8K, Qwen2.5-3B-Instruct, one node of 8 GPUs, colocated, with several optimizer steps per
# collected batch (n_mini = 4): each batch of 128 prompts x 8 samples (1024 trajectories over the 8
# data-parallel ranks) is scored once for pi_old (the ahead pass, B17), then trained as 4 mini-batches
# of 256, each accumulated over 4 micro-batches of 64 (8 rows per rank per forward/backward).
#   pip install -e '.[cuda,gsm8k]' && python recipes/prepare_gsm8k.py --model Qwen/Qwen2.5-3B-Instruct --out data/gsm8k_3b
#   bash recipes/gsm8k_grpo_3b.sh
# Expect: read the step-0 eval_accuracy (greedy, all 1319 test problems, verl's strict `#### N` score) as
# this model's baseline under this scorer (the Qwen2.5 report's figure for the 3B instruct model, about
# 0.8, is its own prompt and scorer); GRPO should add a few points. Not yet run on GPUs by the minirl authors.
# Add --dry-run to print each rank's devices and memory estimate without touching a GPU.
set -euo pipefail
exec torchrun --nproc-per-node 8 -m minirl.grpo \
  --model.path Qwen/Qwen2.5-3B-Instruct \
  --model.dtype bfloat16 --model.activation-checkpointing \
  --task.name jsonl --task.path data/gsm8k_3b/train.jsonl \
  --task.eval-path data/gsm8k_3b/test.jsonl --task.eval-prompts 1319 \
  --steps 200 \
  --rl.group-size 8 \
  --rl.batch-per-replica 1024 \
  --rl.mini-batch-per-replica 256 \
  --rl.micro-batch-per-replica 64 \
  --rl.lr 1e-6 \
  --rl.kl-coef 0.001 \
  --rollout.max-prompt-tokens 512 --rollout.max-tokens 768 \
  --rollout.gpu-memory-utilization 0.5 \
  --checkpoint.every 25 \
  --log.eval-every 20 \
  --log.run-dir runs/gsm8k_grpo_3b \
  "$@"
