"""A run's learning curve: `python -m minirl.tools.plot RUN_DIR` (or `minirl-plot RUN_DIR`) -> RUN_DIR/curve.png.

One panel per quantity the run's metrics.jsonl holds (rewards, held-out accuracy, losses, lengths,
clip and KL, entropy, gradient norms, step time); works on a run still going or crashed.
"""

from __future__ import annotations

import argparse
import json
import os

PANELS = [  # (title, metric keys drawn in it)
    ("reward", ["reward_mean", "eval_accuracy"]),
    ("completion length (tokens)", ["completion_len_mean", "completion_len_max"]),
    ("shares", ["completion_clip_ratio", "frac_reward_zero_std"]),
    ("policy loss", ["grpo_loss", "ppo_loss"]),
    ("value loss", ["value_loss"]),
    ("KL / clip fraction", ["grpo_kl", "ppo_kl", "grpo_clipfrac", "ppo_clipfrac"]),
    ("entropy", ["entropy"]),
    ("gradient norm", ["grad_norm", "value_grad_norm"]),
    ("seconds per step", ["time/step"]),
]


def read(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"minirl-plot: {path} does not exist; give the --log.run-dir of a run")
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash
                continue
    return out


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(x, y) of one metric. An evaluation is drawn at the policy version it scored (`eval_version`:
    the number of updates behind it), which for PPO's asynchronous rollout ranks is not its record's step."""
    pts = [(r.get("eval_version", r["step"]) if key == "eval_accuracy" else r["step"], r[key])
           for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def drawn(records: list[dict]) -> list[tuple[str, list[str]]]:
    """The panels with something to draw, and their keys; several --task.reward functions join the reward panel."""
    several = sorted({k for r in records for k in r if k.startswith("reward/")})
    extra = {"reward": several if len(several) > 1 else []}
    panels = [(t, [k for k in keys + extra.get(t, []) if series(records, k)[0]]) for t, keys in PANELS]
    return [(t, keys) for t, keys in panels if keys]


def plot(run_dir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if os.path.isfile(run_dir):  # the run's metrics.jsonl itself
        run_dir = os.path.dirname(run_dir) or "."
    records = read(run_dir)
    panels = drawn(records)
    if not panels:
        raise SystemExit(f"minirl-plot: no step records in {run_dir}/metrics.jsonl yet")
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(10, 3 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for k in keys:
            x, y = series(records, k)
            ax.plot(x, y, marker="o" if k == "eval_accuracy" else None, ms=3, lw=1.2, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(os.path.abspath(run_dir), fontsize=9)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curve.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="minirl-plot", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=os.path.expanduser,
                    help="a run directory (--log.run-dir) holding metrics.jsonl, or that file")
    ap.add_argument("--out", default=None, type=os.path.expanduser, help="PNG path (default: RUN_DIR/curve.png)")
    a = ap.parse_args(argv)
    print(plot(a.run_dir, a.out))


if __name__ == "__main__":
    main()
