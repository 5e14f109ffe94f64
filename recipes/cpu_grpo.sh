#!/usr/bin/env bash
# GRPO on the built-in counting task, on CPU, one process, no downloads.
# Expect: held-out greedy accuracy from <= 0.3 at step 0 to >= 0.7 within 250-600 steps (about 2
# minutes on 2 cores); all 800 steps take 4-7 minutes. Curve: python -m minirl.plot runs/cpu_grpo.
set -euo pipefail
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python}; fi
exec "$PY" -m minirl.grpo \
  --steps 800 \
  --seed 0 \
  --rl.group-size 8 \
  --rl.batch-per-replica 64 \
  --rl.lr 1e-4 \
  --rollout.max-tokens 8 \
  --log.eval-every 25 \
  --log.run-dir runs/cpu_grpo \
  "$@"
