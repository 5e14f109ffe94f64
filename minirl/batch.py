"""The rank-local rollout store and the dispatch that turns a (mini, micro) index into tensors.

The driver loop passes indices only (B3). `pack` turns this
rank's samples into right-padded tensors once per collected batch. `plan_chunks` decides which
rows each (mini, micro) index means: fixed-size micro-batches, or, with a token budget (X1),
micro-batches packed under the budget and balanced by token cost. `RolloutStore.chunk(mini,
micro)` returns those rows trimmed to the chunk's own longest sequence, so the trainer sees a
plain batch and a micro-batch of short completions costs short activations.

Devices: the store lives on the host; `to_device` is the ONE place a chunk moves to the
trainer's device (pinned and non-blocking on CUDA), and `RolloutStore.chunk` calls it, so
every tensor the trainer computes with is on its device. A chunk's `lengths` stay a host list of
ints: the packed layout is planned on the host (models.layout), with no device sync per forward.

The store counts its readers (spec: "BulkStore readers"): every planned chunk is read once per
training epoch, plus once more when the pi_old ahead pass runs. The caller sets the count
from the SAME predicate that runs the pass (B18); reading past it raises (the batch is already
released) and `close()` raises if reads were left over (a leak).

Shapes: B_r rows on this rank, T = longest prompt + completion in the batch.
Row layout: [prompt tokens | completion tokens | pad]; `mask` is 1.0 on completion tokens.
"""

from __future__ import annotations

import torch

from minirl import dist, packing
from minirl.rollout import Samples

Plan = list[list[list[int]]]  # plan[mini][micro] = row indices on this rank


def pack(samples: Samples, advantages: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Samples -> {input_ids (B_r, T) long, mask (B_r, T), rollout_logp (B_r, T), advantages (B_r,), lengths (B_r,)}."""
    rows = [p + c for p, c in zip(samples.prompt_tokens, samples.completion_tokens)]
    B, T = len(rows), max(map(len, rows))
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    rollout_logp = torch.zeros(B, T)
    for i, (p, c, lp) in enumerate(zip(samples.prompt_tokens, samples.completion_tokens, samples.logprobs)):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c)
        mask[i, len(p):n] = 1.0
        rollout_logp[i, len(p):n] = torch.tensor(lp, dtype=torch.float32)
    return {"input_ids": input_ids, "mask": mask, "rollout_logp": rollout_logp,
            "advantages": advantages.float(), "lengths": torch.tensor([len(r) for r in rows])}


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Move a chunk to the trainer's device. On CUDA the host copy is pinned first so the
    transfer is asynchronous (torch's pinned-memory allocator keeps the buffer until it is done)."""
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}
    return {k: v.to(device) for k, v in tensors.items()}


def plan_chunks(lengths: list[int], n_mini: int, micro_rows: int, max_tokens: int = 0, packed: bool = False) -> Plan:
    """Rows of each mini-batch (contiguous, equal) split into micro-batches.

    max_tokens == 0: consecutive slices of `micro_rows` rows (n_micro fixed by config).
    max_tokens > 0: the fewest micro-batches whose computed tokens fit the budget, balanced by
    cost, and the SAME count on every data-parallel rank (a collective), since FSDP needs every
    rank to run the same number of forward/backward calls. Computed tokens are rows x longest row
    padded, or the packed lanes' tokens when `packed` (the trainer runs padding-free,
    packing.computed_tokens), so a packed budget holds more short rows. A row longer than the
    budget gets a micro-batch of its own.
    """
    per_mini = len(lengths) // n_mini
    plan = []
    for mini in range(n_mini):
        rows = list(range(mini * per_mini, (mini + 1) * per_mini))
        if not max_tokens:
            plan.append([rows[i:i + micro_rows] for i in range(0, per_mini, micro_rows)])
            continue
        cost = _packed_cost if packed else _cost
        n = _agree_max(_first_fit_count(rows, lengths, max_tokens, cost))
        while True:
            bins = _balanced(rows, lengths, n, cost)
            ok = all(cost(b, lengths) <= max_tokens or len(b) == 1 for b in bins)
            if _agree_max(0 if ok else 1) == 0:
                break
            n += 1
        plan.append(bins)
    return plan


def _cost(rows: list[int], lengths: list[int]) -> int:
    return len(rows) * max((lengths[r] for r in rows), default=0)  # padded tokens of the chunk


def _packed_cost(rows: list[int], lengths: list[int]) -> int:
    return packing.computed_tokens([lengths[r] for r in rows])


def _first_fit_count(rows, lengths, budget, cost=_cost) -> int:
    bins: list[list[int]] = []
    for r in sorted(rows, key=lambda r: -lengths[r]):
        for b in bins:
            if cost(b + [r], lengths) <= budget:
                b.append(r)
                break
        else:
            bins.append([r])
    return len(bins)


def _balanced(rows, lengths, n, cost=_cost) -> list[list[int]]:
    """Longest-first into the bin with the least cost so far; each bin's rows kept in batch order."""
    n = min(n, len(rows))
    bins: list[list[int]] = [[] for _ in range(n)]
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        min(bins, key=lambda b: (cost(b + [r], lengths), len(b))).append(r)
    return [sorted(b) for b in bins]


def _agree_max(x: int) -> int:
    return int(dist.all_reduce(torch.tensor([float(x)]), "max").item())


class RolloutStore:
    """This rank's collected batch, handed out chunk by chunk and released after its last reader."""

    def __init__(self, batch: dict[str, torch.Tensor], plan: Plan, reads_per_chunk: int,
                 device: torch.device = torch.device("cpu")):
        self.batch, self.plan, self.device = batch, plan, device
        self.lengths = batch["lengths"].tolist()  # host ints, read once per batch
        self.reads_left = reads_per_chunk * sum(len(m) for m in plan)

    def chunk(self, mini: int, micro: int) -> dict:
        """The rows of (mini, micro), columns trimmed to the chunk's longest row, on the trainer's
        device; `lengths` as a host list."""
        if self.reads_left <= 0:
            self._read()  # raises
        picked = self.plan[mini][micro]
        lengths = [self.lengths[r] for r in picked]
        rows, T = torch.tensor(picked), max(lengths)
        out = {k: (v[rows, :T] if v.dim() == 2 else v[rows]) for k, v in self.batch.items() if k != "lengths"}
        self._read()
        return {**to_device(out, self.device), "lengths": lengths}

    def skip(self) -> None:
        """A planned read that will not happen (the rest of a poisoned window)."""
        self._read()

    def _read(self) -> None:
        if self.reads_left <= 0:
            raise KeyError("rollout store: read after the batch was released "
                           "(the ahead pass ran but the reader count was not raised for it)")
        self.reads_left -= 1
        if self.reads_left == 0:
            self.batch = {}  # release the bulk

    def close(self) -> None:
        if self.reads_left:
            raise RuntimeError(f"rollout store: {self.reads_left} planned read(s) never happened: the batch "
                               "leaked (reader count raised for an ahead pass that did not run)")
