"""Where a GRPO step's time goes (MINIRL_PROFILE_LOOP=1), and the framework's own share.

    python bench/profile_loop.py              # about 2 minutes on 2 CPU cores

Runs `python -m minirl.grpo` colocated on one process with the real vLLM engine, a checkpoint
every second step and a held-out evaluation every third, and reads the per-step `grpo_step`
profile from metrics.jsonl. Each phase's time is the wall time from the previous boundary to
its own (the run log's marks, logger.RunLog.mark):

- generate: vLLM sampling; score: decode, rewards, advantages, packing;
- forward/backward: `train` minus the optimizer; optimizer: clip + AdamW step (Accumulator.step_s);
- hand-off: rollout sleep/wake and trainer offload/onload; weight_sync: trainer -> engine;
- checkpoint, eval: when the step has them;
- overhead: the step's wall time minus all of the above (logging, metrics reduction, loop code).

Medians over the measured steps (the first is dropped: it warms caches). Beside them, the FLOP
floor: the step's model FLOPs (2N per generated or prompt token, 6N per trained token) over the
float32 matmul rate of this machine measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import matmul_flops_per_s, median, run, table, untrained_tiny, write  # noqa: E402

GROUPS = {
    "generate": ["generate"], "score": ["score"], "optimizer": [], "forward/backward": ["train"],
    "hand-off": ["rollout.sleep", "trainer.onload", "trainer.offload", "rollout.wake_up(weights)",
                 "rollout.wake_up(kv_cache)"],
    "weight_sync": ["weight_sync"], "checkpoint": ["checkpoint.save"], "eval": ["eval"],
}


def split(rec: dict) -> dict:
    prof = rec["grpo_step"]
    out = {g: sum(prof.get(f"{ph}/s", 0.0) for ph in phases) for g, phases in GROUPS.items()}
    out["optimizer"] = prof.get("train/optimizer_s", 0.0)
    out["forward/backward"] -= out["optimizer"]
    out["overhead"] = rec["time/step"] - sum(out.values())
    out["step"] = rec["time/step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args()
    model, n = untrained_tiny(a.hidden, a.layers)
    with tempfile.TemporaryDirectory() as d:
        run([sys.executable, "-m", "minirl.grpo", "--steps", str(a.steps), *model,
             "--rl.batch-per-replica", str(a.batch), "--rl.group-size", "4", "--rollout.max-tokens",
             str(a.max_tokens), "--checkpoint.every", "2", "--log.eval-every", "3", "--log.run-dir", d],
            env={"MINIRL_PROFILE_LOOP": "1"})
        recs = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))][1:]
    parts = [split(r) for r in recs]
    keys = list(GROUPS) + ["overhead"]
    med = {k: median(p[k] for p in parts) for k in keys + ["step"]}
    mean = {k: sum(p[k] for p in parts) / len(parts) for k in keys + ["step"]}
    rate = matmul_flops_per_s()
    tokens = median(r["completion_len_mean"] * a.batch for r in recs)
    from minirl.tasks import CountTask  # the char tokenizer: one token per non-space character
    prompt = median(len(CountTask(0, 0).train_problem(i).prompt.replace(" ", "")) for i in range(64))
    floor = (2 * n * (tokens + prompt * a.batch) + 6 * n * (tokens + prompt * a.batch)) / rate
    rows = [[k, med[k], mean[k], mean[k] / mean["step"]] for k in keys]
    rows.append(["step (wall)", med["step"], mean["step"], 1.0])
    print(table(["phase", "median_s", "mean_s", "share_of_mean_step"], rows))
    print(f"framework overhead: {mean['overhead'] / mean['step']:.1%} of a step; "
          f"FLOP floor {floor:.3f} s vs median step {med['step']:.3f} s ({med['step'] / floor:.0f}x)")
    print(write("profile_loop", {"args": vars(a), "median_s": med, "mean_s": mean, "matmul_flops_per_s": rate,
                                 "floor_s": floor, "steps_measured": len(parts)}))


if __name__ == "__main__":
    main()
