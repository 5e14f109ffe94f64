"""How long a prompt file takes to load (`tasks.make_task`: read, render, check every prompt against the budget),
at an older commit's tasks.py and this tree's, side by side.

    python bench/task_load.py --base 254fd1f              # 100,000 text rows (tiny tokenizer)
    python bench/task_load.py --base 254fd1f --chat 20000 # and chat rows through SmolLM2's template, if built

The base commit's tasks.py is imported beside this tree's (the rest of minirl is this tree's), and the two load
the same synthetic file alternately (base, head, base, head, ...). Prints the medians per side and
`base / head <ratio>` (above 1: the working tree loads faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, median, table, write  # noqa: E402

os.environ.setdefault("MINIRL_CACHE", os.path.join(ROOT, ".cache", "minirl"))
from minirl import models, tasks  # noqa: E402
from minirl.config import TaskConfig, TinyModelConfig  # noqa: E402


def rows(n: int, chat: bool, rng: random.Random) -> list[dict]:
    out = []
    for i in range(n):
        text = "".join(rng.choice("ab") for _ in range(20)) + "#a="
        if chat:
            text = " ".join(rng.choice(["how", "many", "apples", "does", "Tom", "have", "if", "he"]) for _ in range(40))
        out.append({"prompt": [{"role": "user", "content": text}] if chat else text, "answer": "3"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit whose tasks.py to measure against")
    ap.add_argument("--rows", type=int, default=100_000, help="text rows, with the built-in model's tokenizer")
    ap.add_argument("--chat", type=int, default=0, help="chat rows, with --smollm2's tokenizer and template")
    ap.add_argument("--smollm2", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    base = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    setups = [("text", a.rows, models.load_tokenizer(models.build_tiny(TinyModelConfig())), 32)]
    if a.chat:
        setups.append(("chat", a.chat, models.load_tokenizer(a.smollm2), 256))
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "tasks_base.py")
        with open(old, "w") as f:
            f.write(subprocess.run(["git", "show", f"{base}:minirl/tasks.py"], cwd=ROOT, capture_output=True,
                                   text=True, check=True).stdout)
        spec = importlib.util.spec_from_file_location("tasks_base", old)
        sides = {"base": importlib.util.module_from_spec(spec), "head": tasks}
        sys.modules["tasks_base"] = sides["base"]  # its dataclasses look their module up
        spec.loader.exec_module(sides["base"])
        times, out = {}, []
        for name, n, tok, limit in setups:
            path = os.path.join(tmp, f"{name}.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows(n, name == "chat", random.Random(1)))
            for _ in range(a.repeats):
                for side, module in sides.items():
                    t0 = time.perf_counter()
                    module.make_task(TaskConfig(name="jsonl", path=path), 0, tok, limit)
                    times.setdefault((name, side), []).append(time.perf_counter() - t0)
            b, h = median(times[(name, "base")]), median(times[(name, "head")])
            out.append([f"{n} {name} rows", f"{b:.2f}", f"{h:.2f}", f"{b / h:.2f}"])
    print(table(["file", f"base {base} s", "head s", "base / head"], out))
    print(write("task_load", {"base": base, "rows": out, "times": {f"{k[0]}/{k[1]}": v for k, v in times.items()}}))


if __name__ == "__main__":
    main()
