#!/usr/bin/env bash
# PPO with a critic on GSM8K, Qwen2.5-0.5B-Instruct, one node of 8 GPUs, disaggregated and streamed:
# GPUs 0-1 generate (vLLM), GPUs 2-7 train policy and critic (FSDP2) on completed groups while the
# rest of each step is still generating.
#   pip install -e '.[cuda,gsm8k]' && python recipes/prepare_gsm8k.py --out data/gsm8k
#   bash recipes/gsm8k_ppo_8gpu.sh
# Expect: read the step-0 eval_accuracy as this model's baseline. It is greedy on all 1319 test problems,
# scored as verl's gsm8k reward scores them (reward_score/gsm8k.py, method="strict": the last "#### N" in
# the last 300 characters, compared as a string; --task.answer-format strict, the default), except that a
# completion cut at --rollout.max-tokens earns 0, which verl does not do. For reference only: verl's
# baseline table (docs/algo/baseline.md) lists Qwen2.5-0.5B-Instruct at 36.4 (a number it takes from the
# Qwen blog, not its own eval) and 56.7 after its PPO run.
# Against verl's quickstart PPO run on this model (as we read it: 256 prompts x 1 sample per step,
# 256 response tokens, actor lr 1e-6, critic lr 1e-5, mini-batches of 64, KL 0.001, 15 epochs):
# - the same learning rates, response length, samples per prompt and about 15 epochs (435 steps);
# - 252 prompts a step, not 256: a step splits evenly over the 6 train ranks;
# - ONE policy optimizer step per batch, not 4 mini-batches of 64: streaming trains each chunk as it
#   completes and steps once (rule S20 requires ppo_epochs = 1); for verl-like mini-batches use full
#   batch (--async-rl.min-groups-for-streaming-train 252) with --ppo.ppo-epochs;
# - the KL: verl subtracts it from the reward (kl_ctrl.kl_coef 0.001); here --ppo.kl-coef 0.001 is a
#   k3 KL term in the policy loss against the frozen starting model (GRPO-style).
# `train_pump: step S chunk K` lines show the streaming. Not yet run on GPUs by the minirl authors:
# a first run should watch the first steps' memory and time/step, and adjust the flags below.
# `bash recipes/gsm8k_ppo_8gpu.sh --dry-run` prints each rank's devices and memory estimate first.
set -euo pipefail
exec torchrun --nproc-per-node 8 -m minirl.ppo \
  --model.path Qwen/Qwen2.5-0.5B-Instruct \
  --model.dtype bfloat16 --model.activation-checkpointing \
  --task.name jsonl --task.path data/gsm8k/train.jsonl \
  --task.eval-path data/gsm8k/test.jsonl --task.eval-prompts 1319 \
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
  --ppo.policy-micro-batch-rows 8 --ppo.critic-micro-batch-rows 8 \
  --ppo.adv-estimator.gamma 1.0 --ppo.adv-estimator.lam 1.0 \
  --async-rl.min-groups-for-streaming-train 42 \
  --async-rl.rollout-groups-per-call 42 \
  --async-rl.sampler.name in_order \
  --async-rl.sampler.max-lookahead-versions 1 \
  --rollout.max-prompt-tokens 512 --rollout.max-tokens 256 \
  --rollout.gpu-memory-utilization 0.6 \
  --checkpoint.every 50 \
  --log.eval-every 25 \
  --log.run-dir runs/gsm8k_ppo_0.5b \
  "$@"
