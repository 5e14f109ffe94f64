"""Disaggregated refit: the stepped policy goes from train rank 0 to every rollout rank over a
collective (the refit group, `dist.refit_group`: gloo on CPU, NCCL on GPUs), in buckets,
straight into each engine's load. The TCPStore carries no weights, only which versions exist.

- `manifest(model, dtype)`: the plan of a transfer, fixed by the model: every parameter's name,
  global shape and the engine's dtype, packed in order into buckets of at most BUCKET_BYTES (a
  larger parameter gets a bucket of its own), each entry 16-byte aligned. Train rank 0 writes it
  to the store once; the rollout ranks read it once.
- `send(group, buckets, named_tensors)`: train rank 0 fills one bucket at a time from the gathered
  full parameters (`dist.full_parameters`, a collective that every train rank iterates) and
  broadcasts it to the rollout ranks, one broadcast per bucket for all of them.
- `receive(group, buckets)`: a rollout rank's iterator of (name, tensor): it receives a bucket and
  yields views into it, which `Engine.load_weights` copies into the engine as they come. Each
  bucket gets a fresh buffer: vLLM's layer-wise reload may keep a view until its layer is complete.
- Pipelined: the sender packs bucket k+1 while bucket k is on the wire, and the receiver has
  bucket k+1 arriving while the engine loads bucket k (the collectives run asynchronously: gloo's
  worker threads, NCCL's stream), so a refit costs about the engine's load plus one bucket.

Peak extra memory per refit: two buckets on each side (before: the store's host held whole
serialised copies of the model, and each side made three).
"""

from __future__ import annotations

import math

import torch

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
