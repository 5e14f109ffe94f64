"""Weight sync: seconds per refit against model size (bytes per second), colocated vs disaggregated.

    python bench/weight_sync.py                     # three sizes, about 2 minutes on 2 CPU cores
    python bench/weight_sync.py --hidden 128 512 1024 --layers 2 8 8

Each size runs in its own process with the real vLLM engine and the trainer's FSDP2 policy:
- colocated: `Engine.load_weights(dist.full_parameters(policy))`, what `HandOff.publish` does;
- disaggregated: what `placement.StoreGroups.refit` + `placement._catch_up` do: gather, safetensors bytes,
  TCPStore set and get in 4 MiB parts (`placement.put` / `take`, localhost), parse, `Engine.load_weights`.
The two paths alternate per repeat; medians over the repeats. The ratio is disaggregated over
colocated time: the price of crossing the store instead of handing tensors over in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import LAUNCH_VARS, ROOT, median, table, write  # noqa: E402


def worker(hidden: int, layers: int, repeats: int) -> dict:
    import torch
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from minirl import dist, models
    from minirl.config import ModelConfig, RolloutConfig, TinyModelConfig
    from minirl.placement import drop, put, take
    from minirl.rollout import Engine

    world = dist.init()
    cfg = ModelConfig(tiny=TinyModelConfig(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                                           intermediate_size=2 * hidden, warm_start_steps=0))
    path = models.resolve_path(cfg)
    policy = dist.shard(models.load_policy(path), world, torch.float32)
    nbytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    engine = Engine(path, RolloutConfig(), 64, world.device)
    store = torch.distributed.TCPStore("127.0.0.1", dist.free_port(), 1, is_master=True, use_libuv=True)
    times = {"colocated": [], "disaggregated": []}
    try:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            engine.load_weights(dist.full_parameters(policy))
            t1 = time.perf_counter()
            state = {n: t.to("cpu").contiguous() for n, t in dist.full_parameters(policy)}
            put(store, f"version/{i}", st_save(state))
            engine.load_weights(st_load(take(store, f"version/{i}")).items())
            drop(store, f"version/{i}")
            t2 = time.perf_counter()
            if i:  # the first round warms allocations
                times["colocated"].append(t1 - t0)
                times["disaggregated"].append(t2 - t1)
    finally:
        engine.close()
    return {"hidden": hidden, "layers": layers, "bytes": nbytes, "times": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--worker", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(*a.worker, a.repeats)))
        return
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.setdefault("MINIRL_CACHE", os.path.join(ROOT, ".cache", "minirl"))
    results, rows = [], []
    for h, n in zip(a.hidden, a.layers):
        p = subprocess.run([sys.executable, __file__, "--worker", str(h), str(n), "--repeats", str(a.repeats)],
                           cwd=ROOT, capture_output=True, text=True, env=env)
        if p.returncode:
            sys.stderr.write(p.stderr[-3000:])
            raise SystemExit(f"bench: weight sync worker for hidden {h} failed")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        col, dis = median(r["times"]["colocated"]), median(r["times"]["disaggregated"])
        r.update(colocated_s=col, disaggregated_s=dis, colocated_bytes_per_s=r["bytes"] / col,
                 disaggregated_bytes_per_s=r["bytes"] / dis, disaggregated_over_colocated=dis / col)
        results.append(r)
        rows.append([f"{h}x{n}", r["bytes"] / 2**20, col, r["bytes"] / col / 2**20, dis, r["bytes"] / dis / 2**20,
                     dis / col])
        print(f"  hidden {h}, {n} layers done", flush=True)
    print(table(["model", "MiB", "coloc_s", "coloc_MiB/s", "disagg_s", "disagg_MiB/s", "disagg/coloc"], rows))
    print(write("weight_sync", {"args": vars(a), "sizes": results}))


if __name__ == "__main__":
    main()
