#!/usr/bin/env bash
# PPO with a critic on GSM8K, Qwen2.5-7B-Instruct, one node of 8 x 80 GB GPUs, disaggregated and
# streamed: GPUs 0-1 generate (vLLM, one 7B engine each), GPUs 2-7 train policy and critic (FSDP2, 6
# ranks) on completed groups while the rest of each step is still generating.
#   pip install -e '.[cuda,gsm8k]' && python recipes/prepare_gsm8k.py --model Qwen/Qwen2.5-7B-Instruct --out data/gsm8k_7b
#   bash recipes/gsm8k_ppo_7b_8gpu.sh
# What makes 7B fit (each rehearsed on CPU, docs/gpu.md, "The rehearsal"):
# - --model.activation-checkpointing: a block keeps only its input for backward (37 GiB of activations
#   per train card at 8 rows x 768 tokens without it);
# - the pump keeps one of policy and critic on a train card at a time, the other offloaded with its
#   AdamW state; a checkpoint holds both (33 GiB per train card, rehearsed: the step's peak);
# - a rollout card holds the 7B engine's bf16 weights (15 GB) and its KV cache within
#   --rollout.gpu-memory-utilization 0.85.
# The same schedule as the 0.5B recipe (recipes/gsm8k_ppo_8gpu.sh, which says how it compares with
# verl's): 252 prompts x 1 sample a step, 256 response tokens, actor lr 1e-6, critic lr 1e-5, KL 0.001.
# Expect: read the step-0 eval_accuracy (greedy, all 1319 test problems, verl's strict `#### N` score) as
# this model's baseline under this scorer (published figures near 0.9 use their own prompts and scorers).
# Not yet run on GPUs by the minirl authors.
# `bash recipes/gsm8k_ppo_7b_8gpu.sh --dry-run --rehearse` runs the train step on fake CUDA tensors on
# a CPU (a config.json is enough) and prints its peak per card beside the plan.
set -euo pipefail
exec torchrun --nproc-per-node 8 -m minirl.ppo \
  --model.path Qwen/Qwen2.5-7B-Instruct \
  --model.dtype bfloat16 --model.activation-checkpointing \
  --task.name jsonl --task.path data/gsm8k_7b/train.jsonl \
  --task.eval-path data/gsm8k_7b/test.jsonl --task.eval-prompts 1319 \
  --grid.gpu-placement disaggregated --grid.rollout-ranks 2 \
  --steps 435 \
  --ppo.num-prompts-per-step 252 \
  --ppo.num-generations-per-prompt 1 \
  --ppo.ppo-epochs 1 \
  --ppo.critic-ppo-epochs 1 \
  --ppo.lr 1e-6 \
  --ppo.value-lr 1e-5 \
  --ppo.critic-warmup-steps 0 \
  --ppo.kl-coef 0.001 \
  --ppo.policy-micro-batch-rows 7 --ppo.critic-micro-batch-rows 7 \
  --ppo.adv-estimator.gamma 1.0 --ppo.adv-estimator.lam 1.0 \
  --async-rl.min-groups-for-streaming-train 42 \
  --async-rl.rollout-groups-per-call 42 \
  --async-rl.sampler.name in_order \
  --async-rl.sampler.max-lookahead-versions 1 \
  --rollout.max-prompt-tokens 512 --rollout.max-tokens 256 \
  --rollout.gpu-memory-utilization 0.85 \
  --checkpoint.every 50 \
  --log.eval-every 25 \
  --log.run-dir runs/gsm8k_ppo_7b \
  "$@"
