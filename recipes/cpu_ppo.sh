#!/usr/bin/env bash
# PPO with a critic, streamed, on CPU: rank 0 generates with vLLM, rank 1 trains policy and critic on
# completed groups while the rest of the step is still generating.
# Expect: `train_pump: step S chunk K` lines, several per step when generation is the bottleneck, and
# `closing on K chunk(s)`; held-out greedy accuracy, scored strictly (exactly the count, then the end),
# from about 0.23 to >= 0.7 within 150-300 steps (two runs: 0.23, 0.5 at step 25, 0.84-0.87 at 150, 0.91
# from 425 on); no completion runs to the cap. All 800 steps take 2-3 minutes on 2 cores (2 min 22 s in a
# fresh clone). The warm start is the one tuned for the GRPO demo (recipes/cpu_grpo.sh says why); the
# flags are as before.
# With --async-rl.sampler.max-lookahead-versions 1 a group may come from the policy one version
# back; --ppo.use-rollout-logprobs-for-loss takes pi_old from the engine that sampled it, which on
# CPU in float32 matches the trainer to 1e-6 (logprob_gap), so the ratio corrects that staleness
# exactly. (On GPUs the engine's bf16 kernels differ from the trainer's: the default, the trainer's
# own pi_old, is the safer choice there.) Without it this demo was seen to stall at 0.69 (with the
# lenient reward and the old warm start).
set -euo pipefail
if [ -x .venv/bin/torchrun ]; then TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}; else TORCHRUN=${TORCHRUN:-torchrun}; fi
exec $TORCHRUN --standalone --nproc-per-node 2 -m minirl.ppo \
  --steps 800 \
  --seed 0 \
  --grid.rollout-ranks 1 \
  --ppo.num-prompts-per-step 8 \
  --ppo.num-generations-per-prompt 8 \
  --ppo.critic-ppo-epochs 1 \
  --async-rl.min-groups-for-streaming-train 2 \
  --async-rl.rollout-groups-per-call 2 \
  --async-rl.sampler.name in_order \
  --async-rl.sampler.max-lookahead-versions 1 \
  --ppo.use-rollout-logprobs-for-loss \
  --log.eval-every 25 \
  --log.run-dir runs/cpu_ppo \
  "$@"
