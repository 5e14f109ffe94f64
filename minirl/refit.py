"""Disaggregated placement's wiring and its refit (only ppo.py and placement.py reach this module).

- `init_disaggregated` (INSTEAD of `dist.init()`): ranks [0, R) generate, [R, N) train (`Roles`).
  vLLM hangs when built on some ranks of a group spanning all of them, so the train ranks form their
  default group among themselves and each rollout rank none (`dist.private_world`). Every rank joins
  the run's store at MASTER_ADDR:MASTER_PORT (torchrun's own, else hosted by global rank 0) for control
  messages and small blobs in parts (`put`, `take`, `drop`), never weights. `share_claim`: every rank
  waits there for train rank 0's claim of the run directory before it writes anything.
- `refit_group`: train rank 0 (member 0) and the rollout ranks (1..R), built on that store outside
  torch's registry: gloo on CPU, NCCL on GPUs.
- The refit: `manifest` fixes every parameter's place in buckets of at most BUCKET_BYTES; `send`
  (train rank 0) packs the gathered parameters bucket by bucket and broadcasts each; `receive` (a
  rollout rank) yields views into each bucket as it lands, for `Engine.load_weights`. Both sides
  keep bucket k+1 on the wire while bucket k is packed or loaded: two buckets of extra memory a side.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from minirl import dist

# ---- who plays which side, and how the sides meet ----


@dataclass(frozen=True)
class Roles:
    """Which side a torchrun rank plays under disaggregated placement: exactly one."""

    global_rank: int
    global_world: int
    rollout_ranks: int  # R
    devices: dist.Devices

    @property
    def generates(self) -> bool:
        return self.global_rank < self.rollout_ranks

    @property
    def trains(self) -> bool:
        return not self.generates


def init_disaggregated(rollout_ranks: int) -> tuple[Roles, dist.World | None, tdist.Store]:
    """Join the run's store; train ranks form their default process group on it (under the prefix
    `train/`), wherever train rank 0 runs. Returns (roles, the train World or None, the store)."""
    g_rank, g_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    devices = dist.device_map(g_rank, local_rank, g_world, rollout_ranks, "disaggregated", dist.device_type())
    roles = Roles(g_rank, g_world, rollout_ranks, devices)
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    dist.place(devices.trainer or devices.engine, int(os.environ.get("LOCAL_WORLD_SIZE", g_world)), g_rank,
               f"{addr}:{port}")
    store = run_store(addr, port, g_world, host=g_rank == 0)
    if not roles.trains:
        return roles, None, store
    t_rank, t_world = g_rank - rollout_ranks, g_world - rollout_ranks
    device = devices.trainer
    tdist.init_process_group(dist.backend_for(device.type), store=tdist.PrefixStore("train/", store), rank=t_rank,
                             world_size=t_world, device_id=device if device.type == "cuda" else None)
    os.environ.update(RANK=str(t_rank), WORLD_SIZE=str(t_world))
    return roles, dist.World(t_rank, t_world, local_rank, device), store


def run_store(addr: str, port: int, world_size: int = 1, host: bool = False) -> tdist.Store:
    """The run's store, under a prefix of this launch attempt's own. Under torchrun it is torchrun's own,
    already listening at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True: every rank a client,
    as torch's env:// does); under another launcher global rank 0 (`host`) hosts it there. Never a second
    port: one next to MASTER_PORT can be any other socket's (EADDRINUSE seen in CI). The long timeout: a
    rollout rank waits on it for the next policy version for a whole train step."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = tdist.TCPStore(addr, port, world_size, is_master=host and not agent, use_libuv=True,
                           timeout=datetime.timedelta(minutes=30))
    return tdist.PrefixStore(_attempt(), store)


def share_claim(store, roles: Roles, owner: dict) -> dict:
    """The run's identity as train rank 0 claimed the run directory in preflight (`launch.claim`: the
    locks, --log.overwrite's clearing, run.json). It posts it; every other rank waits for it here, so no
    rank writes into the run directory (a rollout rank's engine log) before the claim has cleared it, and
    none runs at all when the claim was refused (torchrun stops the others when train rank 0 exits)."""
    if roles.global_rank == roles.rollout_ranks:
        store.set("claim", json.dumps(owner))
        return owner
    while not store.check(["claim"]):  # polled: a store's get would hold a Ctrl-C or SIGTERM until it returns
        time.sleep(0.05)
    return json.loads(store.get("claim"))


def _attempt() -> str:
    return f"minirl/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # PrefixStore adds the slash


def host_address(peer: str) -> str:
    """This host's address on the route to `peer` (a UDP connect sends nothing): what a peer on
    another node knows this host by, unlike `gethostname()`, which may resolve to loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def store_client(store: tdist.PrefixStore) -> tdist.PrefixStore:
    """Another connection to the run's store (for a thread of its own)."""
    under = store.underlying_store
    return tdist.PrefixStore(_attempt(), tdist.TCPStore(under.host, under.port, is_master=False, use_libuv=True))


# The libuv TCPStore refuses values over 8 MiB: blobs go in parts, the part count written last.
PART_BYTES = 4 << 20


def put(store, key: str, blob: bytes, note: str = "") -> None:
    """`blob` under `key` in parts; `note`: a few words read without the blob (`noted`)."""
    parts = [blob[i:i + PART_BYTES] for i in range(0, len(blob), PART_BYTES)]
    for k, part in enumerate(parts):
        store.set(f"{key}/{k}", part)
    store.set(key, f"{len(parts)} {note}".strip())  # present = complete


def noted(store, key: str) -> str:
    return store.get(key).decode().partition(" ")[2]


def take(store, key: str) -> bytes:
    return b"".join(store.get(f"{key}/{k}") for k in range(_parts(store, key)))


def drop(store, key: str) -> None:
    n = _parts(store, key)
    store.delete_key(key)
    for k in range(n):
        store.delete_key(f"{key}/{k}")


def _parts(store, key: str) -> int:
    return int(store.get(key).split()[0])


# ---- the refit group: trainer rank 0 and the rollout ranks ----

@dataclass
class PointGroup:
    """A process group outside torch's registry, on the run's TCPStore: train rank 0 and the rollout ranks (1..R)."""

    backend: object          # torch's ProcessGroupGloo / ProcessGroupNCCL
    device: torch.device     # the one device type it takes tensors on
    rank: int
    size: int

    def broadcast(self, t: torch.Tensor, src: int):
        """Start a broadcast of `t` from member `src`; returns its work (`.wait()` before using `t`)."""
        if t.device.type != self.device.type:
            raise RuntimeError(f"refit group: a {t.device.type} tensor on a group of {self.device.type} members")
        opts = tdist.BroadcastOptions()
        opts.rootRank = src
        return self.backend.broadcast([t], opts)


def refit_group(store: tdist.Store, rank: int, size: int, device: torch.device,
                timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> PointGroup:
    """Join the refit group (a rendezvous of all `size` members): gloo on CPU, NCCL on CUDA, built as
    torch builds a group's backend (torch 2.13 `_new_process_group_helper`)."""
    prefix = tdist.PrefixStore("refit/", store)
    if device.type == "cuda":
        opts = tdist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        backend = tdist.ProcessGroupNCCL(prefix, rank, size, opts)
    else:
        backend = tdist.ProcessGroupGloo(prefix, rank, size, timeout)
    return PointGroup(backend, device, rank, size)


# ---- the refit: buckets over the refit group ----

BUCKET_BYTES = 16 << 20  # small enough to pipeline on CPU (bench/weight_sync.py), large enough for NCCL
ALIGN = 16


def manifest(model: torch.nn.Module, dtype: torch.dtype) -> list[dict]:
    """[{"nbytes": n, "entries": [[name, shape, dtype name, offset], ...]}, ...] in parameter order."""
    buckets: list[dict] = []
    entries: list[list] = []
    offset = 0
    for name, p in model.named_parameters():  # a DTensor's shape is the full, global one
        nbytes = p.numel() * dtype.itemsize
        if entries and offset + nbytes > BUCKET_BYTES:
            buckets.append({"nbytes": offset, "entries": entries})
            entries, offset = [], 0
        entries.append([name, list(p.shape), str(dtype).removeprefix("torch."), offset])
        offset += -(-nbytes // ALIGN) * ALIGN
    if entries:
        buckets.append({"nbytes": offset, "entries": entries})
    return buckets


def _span(entry: list) -> tuple[torch.dtype, int]:
    dtype = getattr(torch, entry[2])
    return dtype, math.prod(entry[1]) * dtype.itemsize


def send(group, buckets: list[dict], named_tensors) -> int:
    """Train rank 0: pack the gathered parameters bucket by bucket and broadcast each. Returns bytes sent."""
    it = iter(named_tensors)
    in_flight: list = []  # (work, buffer): a buffer must live until its broadcast is done
    for b in buckets:
        buf = torch.empty(b["nbytes"], dtype=torch.uint8, device=group.device)
        for entry in b["entries"]:
            name, t = next(it)
            dtype, n = _span(entry)
            if name != entry[0] or t.dtype != dtype or list(t.shape) != entry[1]:
                raise RuntimeError(f"refit: parameter {name} {tuple(t.shape)} {t.dtype} does not match the "
                                   f"manifest's {entry[0]} {tuple(entry[1])} {dtype}")
            buf[entry[3]:entry[3] + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        in_flight.append((group.broadcast(buf, src=0), buf))
        if len(in_flight) > 1:  # at most two buckets: one on the wire, one being packed
            in_flight.pop(0)[0].wait()
    for work, _ in in_flight:
        work.wait()
    if next(it, None) is not None:
        raise RuntimeError("refit: the model has more parameters than the manifest")
    return sum(b["nbytes"] for b in buckets)


def receive(group, buckets: list[dict]):
    """A rollout rank: yield (name, tensor) for every parameter, bucket by bucket as they arrive."""
    def start(b: dict):
        buf = torch.empty(b["nbytes"], dtype=torch.uint8, device=group.device)
        return group.broadcast(buf, src=0), buf

    coming = start(buckets[0]) if buckets else None
    for k, b in enumerate(buckets):
        work, buf = coming
        coming = start(buckets[k + 1]) if k + 1 < len(buckets) else None  # on the wire while this one loads
        work.wait()
        for entry in b["entries"]:
            dtype, n = _span(entry)
            yield entry[0], buf[entry[3]:entry[3] + n].view(dtype).view(entry[1])
