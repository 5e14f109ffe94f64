#!/usr/bin/env bash
# GRPO on a real pretrained model on CPU: SmolLM2-135M-Instruct (built once from a package, no model hub:
# recipes/prepare_smollm2.py) on word arithmetic asked as chat messages (recipes/prepare_arith.py), answered
# `#### N` and scored strictly (verl's strict GSM8K score; a completion cut by --rollout.max-tokens earns 0),
# plus a small bonus for the worked format (recipes/arith_rewards.py: work shown, then `#### N`) so that groups
# differ at the start.
# Sampling at temperature 0.7, top-p 0.9: at temperature 1 this model's samples are mostly off-topic text.
# The measured numbers are in the README's recipe table; the curve: minirl-plot runs/cpu_smollm2_grpo;
# completions: runs/cpu_smollm2_grpo/samples.jsonl (--log.train-samples writes training rollouts there too).
# Scored again outside minirl by Hugging Face generate: python bench/score_arith.py runs/cpu_smollm2_grpo/final
set -euo pipefail
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python}; fi
"$PY" recipes/prepare_smollm2.py --out models/smollm2-135m-instruct > /dev/null  # once: about 35 s
"$PY" recipes/prepare_arith.py --out data/arith > /dev/null
exec "$PY" -m minirl.grpo \
  --model.path models/smollm2-135m-instruct \
  --task.name jsonl --task.path data/arith/train.jsonl --task.eval-path data/arith/test.jsonl \
  --task.eval-prompts 100 \
  --task.reward minirl.rewards:gsm8k --task.reward recipes/arith_rewards.py:shows_work_then_marker \
  --task.reward-weights 1 0.2 \
  --steps 40 \
  --seed 0 \
  --rl.group-size 8 \
  --rl.batch-per-replica 32 \
  --rl.micro-batch-per-replica 16 \
  --rl.lr 2e-5 \
  --rollout.max-tokens 32 \
  --rollout.temperature 0.7 --rollout.top-p 0.9 \
  --rollout.max-prompt-tokens 96 \
  --log.eval-every 10 \
  --log.train-samples 2 \
  --log.run-dir runs/cpu_smollm2_grpo \
  "$@"
