"""Weight sync: seconds per refit against model size, colocated vs disaggregated across processes.

    python bench/weight_sync.py                     # three sizes x (1, 2 rollout ranks), about 5 minutes on 2 cores
    python bench/weight_sync.py --hidden 512 --layers 8 --rollout-ranks 1 --repeats 5
    python bench/weight_sync.py --model-path DIR --arms colocated disaggregated   # any local model (scale rehearsal)

Each size and rollout-rank count is one `torchrun` launch of 1 train rank + R rollout ranks, the
real vLLM engines and the trainer's FSDP2 policy, through minirl's own functions:
- colocated: on every rollout rank, `Engine.load_weights(dist.full_parameters(policy))` from a copy
  of the policy in that process, what `HandOff.publish` does;
- disaggregated: what a PPO refit does (`placement.StoreGroups.refit` + `_catch_up`): the trainer
  announces the version in the store, gathers and sends the buckets over the refit group
  (`refit.send`: gloo here, NCCL on GPUs), every rollout rank loads them as they arrive
  (`refit.receive`); timed from the announcement to the last rollout rank's load;
- store (the path before the refit group, kept to measure against): the same weights as
  safetensors bytes through the TCPStore in 4 MiB parts (`refit.put` / `take`).
The arms alternate per repeat; medians over the repeats; the first round is dropped (allocations).
One line per launch begins `refit <size> MiB: colocated <s> s, disaggregated <s> s, ratio <d/c>`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import median, run, table, torchrun, write  # noqa: E402

ARMS = ("colocated", "disaggregated", "store")


def peak_rss_gib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker(hidden: int, layers: int, rollout_ranks: int, repeats: int, bucket_mib: int, model_path: str,
           arms: list[str]) -> None:
    """One launch: global ranks [0, R) roll out, rank R trains. The train rank prints the JSON."""
    import torch
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from minirl import dist, launch, models, refit
    from minirl.config import ModelConfig, RolloutConfig, TinyModelConfig
    from minirl.refit import drop, put, take
    from minirl.rollout import Engine

    roles, world, store = refit.init_disaggregated(rollout_ranks)
    if bucket_mib:
        refit.BUCKET_BYTES = bucket_mib << 20
    cfg = ModelConfig(tiny=TinyModelConfig(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                                           intermediate_size=2 * hidden, warm_start_steps=0))
    path = model_path or launch.resolve_path(cfg)
    R, wait = rollout_ranks, lambda key: store.wait([key])
    store_arm = "store" in arms
    if roles.trains:
        policy = models.sharded(path, "policy", world, "float32")
        buckets = refit.manifest(policy, torch.float32)
        manifest = json.dumps(buckets)
        store.set("weights/manifest", manifest)
        group = refit.refit_group(store, 0, R + 1, world.device)
        nbytes = sum(b["nbytes"] for b in buckets)
        times = {arm: [] for arm in arms}
        blob = b""
        for i in range(repeats + 1):
            store.set(f"colocated/{i}", "go")
            col = [float(store.get(f"colocated_s/{i}/{r}")) for r in range(R)]
            t0 = time.perf_counter()
            store.set(f"version/{i}", "1")                     # the announcement
            refit.send(group, buckets, dist.full_parameters(policy))
            dis = max(float(store.get(f"loaded_at/{i}/{r}")) for r in range(R)) - t0
            if store_arm:
                t0 = time.perf_counter()
                state = {n: t.to("cpu").contiguous() for n, t in dist.full_parameters(policy)}
                blob = st_save(state)
                put(store, f"blob/{i}", blob)
                st = max(float(store.get(f"stored_at/{i}/{r}")) for r in range(R)) - t0
                drop(store, f"blob/{i}")
                del state
            if i:
                times["colocated"].append(max(col))
                times["disaggregated"].append(dis)
                if store_arm:
                    times["store"].append(st)
        peaks = [float(store.get(f"peak_rss/{r}")) for r in range(R)] + [peak_rss_gib()]
        store.set("done", "1")
        print(json.dumps({"hidden": hidden, "layers": layers, "rollout_ranks": R, "bytes": nbytes, "times": times,
                          "store_bytes": {"disaggregated": len(manifest) + 1, "store": len(blob)},
                          "peak_rss_gib": {"rollout": peaks[:-1], "train": peaks[-1]}}), flush=True)
    else:
        engine = Engine(path, RolloutConfig(), 64, roles.devices.engine, private=True)
        local = dist.World(0, 1, 0, roles.devices.engine)  # vLLM's private world of one is this process's group
        policy = dist.shard(models.load_policy(path), local, torch.float32)
        group = refit.refit_group(store, roles.global_rank + 1, R + 1, roles.devices.engine)
        buckets = json.loads(store.get("weights/manifest"))
        r = roles.global_rank
        try:
            for i in range(repeats + 1):
                wait(f"colocated/{i}")
                t0 = time.perf_counter()
                engine.load_weights(dist.full_parameters(policy))
                store.set(f"colocated_s/{i}/{r}", str(time.perf_counter() - t0))
                wait(f"version/{i}")
                engine.load_weights(refit.receive(group, buckets))
                store.set(f"loaded_at/{i}/{r}", str(time.perf_counter()))
                if store_arm:
                    wait(f"blob/{i}")
                    engine.load_weights(st_load(take(store, f"blob/{i}")).items())
                    store.set(f"stored_at/{i}/{r}", str(time.perf_counter()))
            store.set(f"peak_rss/{r}", str(peak_rss_gib()))
            wait("done")  # outside torchrun global rank 0 hosts the store
        finally:
            engine.close()
    dist.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rollout-ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=0, help="refit bucket size (0 = refit.BUCKET_BYTES)")
    ap.add_argument("--model-path", default="", help="a local model folder instead of the tiny model's sizes")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS,
                    help="colocated and disaggregated always run; store is the path before the refit group")
    ap.add_argument("--name", default="weight_sync", help="results file bench/results/<name>.json")
    ap.add_argument("--worker", nargs=3, type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    arms = sorted(set(a.arms) | {"colocated", "disaggregated"}, key=ARMS.index)
    if a.worker:
        return worker(*a.worker, a.repeats, a.bucket_mib, a.model_path, arms)
    results, rows, lines = [], [], []
    sizes = [(0, 0)] if a.model_path else list(zip(a.hidden, a.layers))
    for h, n in sizes:
        for R in a.rollout_ranks:
            p = run([*torchrun(R + 1), __file__, "--worker", str(h), str(n), str(R), "--repeats", str(a.repeats),
                     "--bucket-mib", str(a.bucket_mib), "--model-path", a.model_path, "--arms", *arms],
                    env={"OMP_NUM_THREADS": "1"})
            r = json.loads([x for x in p.stdout.splitlines() if x.startswith("{")][-1])
            med = {arm: median(r["times"][arm]) for arm in arms}
            mib = r["bytes"] / 2**20
            r.update({f"{arm}_s": med[arm] for arm in arms}, ratio=med["disaggregated"] / med["colocated"])
            line = (f"refit {mib:.1f} MiB: colocated {med['colocated']:.3f} s, disaggregated "
                    f"{med['disaggregated']:.3f} s, ratio {r['ratio']:.2f} (1 train + {R} rollout rank(s); "
                    f"{mib / med['disaggregated']:.0f} MiB/s; the store held {r['store_bytes']['disaggregated']} B")
            if "store" in arms:
                r["store_ratio"] = med["store"] / med["colocated"]
                line += (f"; before, through the store: {med['store']:.3f} s, ratio {r['store_ratio']:.2f}, "
                         f"{r['store_bytes']['store'] / 2**20:.1f} MiB held")
            line += ")"
            results.append(r)
            lines.append(line)
            print(line, flush=True)
            rows.append([f"{h}x{n}" if h else os.path.basename(a.model_path.rstrip("/")), R, mib, med["colocated"],
                         med["disaggregated"], r["ratio"], med.get("store", float("nan")), r.get("store_ratio", float("nan"))])
    print(table(["model", "rollout", "MiB", "coloc_s", "refit_s", "refit/coloc", "store_s", "store/coloc"], rows))
    print(write(a.name, {"args": vars(a), "sizes": results, "lines": lines}))


if __name__ == "__main__":
    main()
