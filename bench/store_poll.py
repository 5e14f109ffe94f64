"""What disaggregated PPO's controller (train rank 0) reads from the run's TCPStore to learn each finished
group's version, side by side: the whole group (as before 5e7365a: `take` and `safetensors.load`, then its
`version`) or the note `refit.put` writes beside it (`refit.noted`, a few bytes).

    python bench/store_poll.py                      # 512 groups of 1 MiB, as a large step has them
    python bench/store_poll.py --groups 64 --mib 4

The groups are written by a client of a TCPStore this process serves (the rollout ranks' side), then read by
another client (the controller's) both ways, alternately, 3 times each. Prints the medians of a step's reads
and `group / note <ratio>`. The train rank that trains on a group reads it whole either way (not timed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, table, write  # noqa: E402

from minirl.refit import noted, put, take  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=512, help="finished groups a step polls")
    ap.add_argument("--mib", type=float, default=1.0, help="a group's size in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    server = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, use_libuv=True)
    client = lambda: torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)  # noqa: E731
    rollout, controller = client(), client()
    tokens = torch.zeros(int(a.mib * 2**20) // 8, dtype=torch.long)
    for i in range(a.groups):
        put(rollout, f"group/0/{i}", st_save({"input_ids": tokens, "version": torch.tensor(3)}), note="3")
    ways = {"group": lambda key: int(st_load(take(controller, key))["version"]),
            "note": lambda key: int(noted(controller, key))}
    times = {name: [] for name in ways}
    for _ in range(a.repeats):
        for name, read in ways.items():
            t0 = time.perf_counter()
            assert all(read(f"group/0/{i}") == 3 for i in range(a.groups))
            times[name].append(time.perf_counter() - t0)
    group, note = median(times["group"]), median(times["note"])
    print(table(["read", "groups", "MiB each", "s per step"], [[n, a.groups, a.mib, median(t)] for n, t in times.items()]))
    print(f"group / note {group / note:.1f}")
    print(write("store_poll", {"groups": a.groups, "mib": a.mib, "times": times, "ratio": group / note}))


if __name__ == "__main__":
    main()
