"""Streaming vs full-batch PPO: per-step wall time and the tail, side by side in one run.

    python bench/streaming.py                 # about 5 minutes on 2 CPU cores
    python bench/streaming.py --repeats 3 --steps 8
    python bench/streaming.py --hidden 256 --layers 4 --critic-epochs 2 --max-tokens 96 --name streaming_train_bound

Both arms run `torchrun --nproc-per-node 2 -m minirl.ppo` (one rollout rank, one train rank, the
real vLLM engine) on the same seed, model and task; only --async-rl.min-groups-for-streaming-train
differs (2 = streaming, P = full batch). Arms alternate (S, F, S, F, ...) so machine noise hits
both. Completion lengths are skewed on purpose: the tiny model without its warm start stops at a
random point (EOS is one token among the vocabulary), so lengths spread from 1 to --max-tokens.
Lookahead 0: step s's groups are sampled by policy s, so all the overlap comes from streaming.
The policy's learning rate is 1e-12 by default: its weights do not move in float32, so with the
fixed per-request seeds both arms sample exactly the same completions and do exactly the same
work; only the schedule differs (the critic still trains, at its usual rate).

Per step (the first step of each run is dropped: it includes the engine's start):
- step_s: wall time of one step on the train rank.
- tail_s: from the last group being ready to the end of the update (policy step + critic).
- ideal_tail_s: the last chunk's work + closing the step (optimizer step, refit, critic epochs),
  the least any schedule must do after the last group arrives. tail / ideal shows how close it gets.
- floor_s: the step's model FLOPs (generation 2N per token, policy 6N, value 2N + 6N per critic
  epoch) over this machine's float32 matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import matmul_flops_per_s, median, metrics, run, table, torchrun, untrained_tiny, write  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--min-groups", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--critic-epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-12,
                    help="policy lr; the default keeps the policy (and so, through the fixed per-request seeds, "
                         "every completion) the same in both arms, so they differ in schedule only")
    ap.add_argument("--name", default="streaming", help="results file: bench/results/NAME.json")
    a = ap.parse_args()
    model, n = untrained_tiny(a.hidden, a.layers)
    common = [*model, "--steps", str(a.steps), "--ppo.num-prompts-per-step", str(a.prompts),
              "--ppo.num-generations-per-prompt", str(a.generations), "--rollout.max-tokens", str(a.max_tokens),
              "--ppo.critic-ppo-epochs", str(a.critic_epochs), "--async-rl.sampler.max-lookahead-versions", "0",
              "--async-rl.rollout-groups-per-call", "2", "--log.eval-every", "0", "--ppo.lr", str(a.lr)]
    arms = {"streaming": str(a.min_groups), "full_batch": str(a.prompts)}
    steps: dict[str, list[dict]] = {k: [] for k in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for name, minimum in arms.items():
                d = os.path.join(tmp, f"{name}{rep}")
                run([*torchrun(2), "-m", "minirl.ppo", *common, "--async-rl.min-groups-for-streaming-train",
                     minimum, "--log.run-dir", d])
                got = metrics(d)[1:]
                steps[name] += got
                print(f"  {name} run {rep}: step_s {median(r['time/step'] for r in got):.2f}", flush=True)
    rate = matmul_flops_per_s()
    out, rows = {}, []
    for name, recs in steps.items():
        tokens = median((r["prompt_len_mean"] + r["completion_len_mean"]) * a.prompts * a.generations for r in recs)
        flops = tokens * n * (2 + 6 + 2 + 6 * a.critic_epochs)
        o = {"step_s": median(r["time/step"] for r in recs), "tail_s": median(r.get("time/tail") for r in recs),
             "ideal_tail_s": median(r["time/last_chunk"] + r["time/close"] for r in recs),
             "chunks_per_step": median(r["ppo_chunks"] for r in recs),
             "completion_len_mean": median(r["completion_len_mean"] for r in recs),
             "floor_s": flops / rate, "steps_measured": len(recs)}
        o["tail_over_ideal"] = o["tail_s"] / o["ideal_tail_s"]
        out[name] = o
        rows.append([name, o["step_s"], o["tail_s"], o["ideal_tail_s"], o["tail_over_ideal"], o["chunks_per_step"],
                     o["floor_s"]])
    ratio = out["streaming"]["step_s"] / out["full_batch"]["step_s"]
    print(table(["arm", "step_s", "tail_s", "ideal_tail_s", "tail/ideal", "chunks", "floor_s"], rows))
    print(f"streaming / full batch, median step time: {ratio:.3f}  (matmul rate {rate / 1e9:.1f} GFLOP/s)")
    print(write(a.name, {"args": vars(a), "matmul_flops_per_s": rate, "arms": out,
                              "streaming_over_full_batch_step_time": ratio}))


if __name__ == "__main__":
    main()
