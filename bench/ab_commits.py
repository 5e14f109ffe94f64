"""minirl at an older commit vs this working tree, side by side: is minirl's own step faster now?

    python bench/ab_commits.py --base f4414f7                   # the CPU demo's step; about 5 minutes
    python bench/ab_commits.py --base f4414f7 --setup natural   # bench/vs_trl.py's 25M model, natural lengths
    python bench/ab_commits.py --base f4414f7 --setup natural -- --model.no-packing   # more flags for both sides

This machine's speed drifts by half between hours, so a "before" measured on one day and an
"after" on another say little about the code. Here the base commit is checked out into a
temporary git worktree and both trees run `python -m minirl.grpo` with one of bench/vs_trl.py's
setups (default `tiny`: the CPU demo's model and hyperparameters), alternating (base, head, base,
head, ...), each run's first step dropped. Prints the medians per side and
`base step / head step <ratio>` (above 1: the working tree is faster), with each pair's ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, median, metrics, run, table, write  # noqa: E402
from vs_trl import SETUPS, minirl_flags  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to measure against (any git revision)")
    ap.add_argument("--setup", choices=SETUPS, default="tiny")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the setup's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default=None, help="results file: bench/results/NAME.json (default: ab_SETUP)")
    ap.add_argument("more", nargs="*", help="more flags for both sides' `python -m minirl.grpo`, after --")
    a = ap.parse_args()
    setup = SETUPS[a.setup]
    base = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    flags = minirl_flags(setup, a.steps or setup["steps"], setup["lr"], setup["completion"]) + a.more
    res = {side: {"step_s": [], "generate_s": [], "pairs": []} for side in ("base", "head")}
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "base")
        run(["git", "worktree", "add", "--detach", tree, base])
        try:
            for rep in range(a.repeats):
                for side, src in (("base", tree), ("head", ROOT)):
                    d = os.path.join(tmp, f"{side}{rep}")
                    # cwd and PYTHONPATH put that tree's minirl first, ahead of the editable install
                    run([sys.executable, "-m", "minirl.grpo", *flags, "--log.run-dir", d], cwd=src,
                        env={"PYTHONPATH": src})
                    recs = metrics(d)[1:]  # the first step warms up
                    res[side]["step_s"] += [r["time/step"] for r in recs]
                    # None where an older commit did not log it (median skips None)
                    res[side]["generate_s"] += [r.get("time/generate") for r in recs]
                    res[side]["pairs"].append(median([r["time/step"] for r in recs]))
                print(f"  repeat {rep}: base {res['base']['pairs'][-1]:.3g}, "
                      f"head {res['head']['pairs'][-1]:.3g} s/step", flush=True)
        finally:
            run(["git", "worktree", "remove", "--force", tree])
    rows = [[f"{side} ({base if side == 'base' else 'working tree'})", median(r["step_s"]), median(r["generate_s"]),
             median(r["step_s"]) - median(r["generate_s"])] for side, r in res.items()]
    print(table(["side", "s/step", "generate s", "rest s"], rows))
    ratio = median(res["base"]["step_s"]) / median(res["head"]["step_s"])
    pairs = [b / h for b, h in zip(res["base"]["pairs"], res["head"]["pairs"])]
    print(f"base step / head step {ratio:.2f} (per pair: {', '.join(f'{x:.2f}' for x in pairs)})")
    print(write(a.name or f"ab_{a.setup}", {"args": vars(a), "base": base, "flags": flags, "sides": res,
                                             "base_over_head_step_time": ratio, "per_pair": pairs}))


if __name__ == "__main__":
    main()
