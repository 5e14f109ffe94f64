#!/usr/bin/env bash
# PPO with a critic on GSM8K, Qwen2.5-0.5B-Instruct, two nodes of 8 GPUs, disaggregated and streamed:
# all of node 0 generates (8 vLLM engines, global ranks 0-7), all of node 1 trains policy and critic
# (8 FSDP2 ranks) on completed groups while the rest of each step is still generating. The same command
# on each node, with its rank and node 0's address as the other node reaches it (docs/gpu.md, "Two or
# more nodes"):
#   export GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0   # the interface the nodes share
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash recipes/gsm8k_ppo_2x8gpu.sh   # on node 0 (10.0.0.1)
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash recipes/gsm8k_ppo_2x8gpu.sh   # on node 1
# The one-node recipe's schedule (recipes/gsm8k_ppo_8gpu.sh says how it compares with verl's), at a batch
# that splits over 8 train ranks: 256 prompts a step (32 per train rank), chunks of at least 64 groups
# (8 per train rank), each rollout rank sampling its 32 groups a step in one vLLM call.
# Read the step-0 eval_accuracy as this model's baseline under this scorer. Not yet run on GPUs by the
# minirl authors. `... --dry-run` prints all 16 ranks' nodes, devices and memory first.
set -euo pipefail
exec torchrun --nnodes 2 --node-rank "${NODE_RANK:?set NODE_RANK to this node's rank: 0 or 1}" --nproc-per-node 8 \
  --master-addr "${MASTER_ADDR:?set MASTER_ADDR to node 0 address}" --master-port "${MASTER_PORT:-29500}" \
  -m minirl.ppo \
  --model.path Qwen/Qwen2.5-0.5B-Instruct \
  --model.dtype bfloat16 --model.activation-checkpointing \
  --task.name jsonl --task.path data/gsm8k/train.jsonl \
  --task.eval-path data/gsm8k/test.jsonl --task.eval-prompts 1319 \
  --grid.gpu-placement disaggregated --grid.rollout-ranks 8 \
  --steps 435 \
  --ppo.num-prompts-per-step 256 \
  --ppo.num-generations-per-prompt 1 \
  --ppo.ppo-epochs 1 \
  --ppo.critic-ppo-epochs 1 \
  --ppo.lr 1e-6 \
  --ppo.value-lr 1e-5 \
  --ppo.kl-coef 0.001 \
  --ppo.policy-micro-batch-rows 8 --ppo.critic-micro-batch-rows 8 \
  --ppo.adv-estimator.gamma 1.0 --ppo.adv-estimator.lam 1.0 \
  --async-rl.min-groups-for-streaming-train 64 \
  --async-rl.rollout-groups-per-call 32 \
  --async-rl.sampler.name in_order \
  --async-rl.sampler.max-lookahead-versions 1 \
  --rollout.max-prompt-tokens 512 --rollout.max-tokens 256 \
  --rollout.gpu-memory-utilization 0.6 \
  --checkpoint.every 50 \
  --log.eval-every 25 \
  --log.run-dir runs/gsm8k_ppo_2x8 \
  "$@"
