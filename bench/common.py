"""What every benchmark shares: run a minirl command, read its metrics, the machine's measured
matmul rate (for the FLOP floor), medians, and the JSON written to bench/results/.

Ratios, not absolute times: these machines are shared, so each benchmark alternates its two
configurations in one run (A, B, A, B, ...) and reports medians and their ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run(cmd: list[str], env: dict | None = None, timeout: int = 1800, cwd: str = ROOT) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    base.setdefault("MINIRL_CACHE", os.path.join(ROOT, ".cache", "minirl"))
    base.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})})
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"bench: {' '.join(cmd[:6])} ... failed with exit code {p.returncode}")
    return p


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "reward_mean" in line]


def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def matmul_flops_per_s(n: int = 1024, repeats: int = 5, threads: int | None = None) -> float:
    """The best float32 matmul rate of this machine right now (all cores unless `threads`)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(old)
    return 2 * n**3 / best


def param_count(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    """Qwen2 parameter counts: matmul ("dense", what FLOPs scale with) and embedding."""
    head_dim = hidden // heads
    attn = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim  # q, o, k, v
    mlp = 3 * hidden * intermediate
    return {"dense": layers * (attn + mlp) + hidden * vocab, "embedding": hidden * vocab}


def untrained_tiny(hidden: int, layers: int) -> tuple[list[str], int]:
    """Flags for the built-in tiny model at this size WITHOUT its warm start (it stops at a random
    point, so completion lengths are skewed), and its matmul parameter count (head_dim 64, 1 KV
    head, MLP 2x hidden, the 50-symbol character vocabulary)."""
    flags = ["--model.tiny.warm-start-steps", "0", "--model.tiny.hidden-size", str(hidden),
             "--model.tiny.num-layers", str(layers), "--model.tiny.num-heads", str(hidden // 64),
             "--model.tiny.intermediate-size", str(2 * hidden)]
    return flags, param_count(hidden, layers, hidden // 64, 1, 2 * hidden, 50)["dense"]


def write(name: str, payload: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"machine": {"cpus": os.cpu_count(), "torch": torch.__version__}, **payload}, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)
