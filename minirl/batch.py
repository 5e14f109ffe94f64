"""The rank-local rollout store, the (mini, micro) plan of its rows, and padding-free packing.

- `pack` turns this rank's samples into right-padded host tensors once per batch; `plan_chunks`
  decides each (mini, micro) index's rows: fixed-size micro-batches, or under a token budget (X1)
  longest rows first into the first that has room, the same count on every rank. The loop passes
  indices only (B3): `RolloutStore.chunk(mini, micro)` returns the rows trimmed to their longest,
  moved to the trainer's device by `to_device`, the one place a chunk moves.
- The store counts its readers: each planned chunk once per epoch, plus once for the pi_old ahead
  pass, set from the same predicate that runs it (B18); a read past the count or a read left over
  at `close()` raises.
- `Layout`: a micro-batch's rows laid end to end into lanes as long as its longest row (first fit,
  longest first), positions restarting per row, so transformers' block-diagonal mask keeps each
  token to its own row (one lane for flash attention, which packs only at batch size 1). `exact`
  checks once per model that it really does; minirl packs only where it does.

Shapes: B_r rows on this rank, T = longest prompt + completion; a row is [prompt | completion | pad]
and `mask` is 1.0 on completion tokens. `lengths` stay host ints (the layout is planned on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minirl import dist
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


def as_group(s: Samples, rows: slice, rewards: list[float], parts: list[list[float]], version: int) -> dict:
    """PPO's unit of work, what a rollout rank sends: one prompt's G samples as tensors (prompt, completions
    (G, T_c) padded with 0, lengths, logprobs, rewards, each function's values, clipped, version)."""
    comps = s.completion_tokens[rows]
    T = max(map(len, comps))
    pad = lambda xs, v: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
    return {"prompt": torch.tensor(s.prompt_tokens[rows.start]),
            "completions": torch.tensor(pad(comps, 0)),
            "lengths": torch.tensor([len(c) for c in comps]),
            "logprobs": torch.tensor(pad(s.logprobs[rows], 0.0)),
            "rewards": torch.tensor(rewards, dtype=torch.float32),
            "reward_parts": torch.tensor(parts, dtype=torch.float32),  # (functions, G): reward/<name>
            "clipped": torch.tensor(s.clipped[rows]),
            "version": torch.tensor(version)}


def group_rows(groups: list[dict], pad_id: int) -> dict:
    """This rank's groups -> one PPO chunk: right-padded rows (`pack`) plus the sequence reward on each
    row's last token, `lengths` as host ints."""
    prompts, comps, lps, rewards = [], [], [], []
    for g in groups:
        for j, n in enumerate(g["lengths"].tolist()):
            prompts.append(g["prompt"].tolist())
            comps.append(g["completions"][j, :n].tolist())
            lps.append(g["logprobs"][j, :n].tolist())
            rewards.append(float(g["rewards"][j]))
    b = pack(Samples([0] * len(comps), prompts, comps, lps, ["stop"] * len(comps)), torch.zeros(len(comps)), pad_id)
    seq_rewards = torch.zeros_like(b["mask"])                                   # (B_c, T)
    seq_rewards[torch.arange(len(comps)), b["lengths"] - 1] = torch.tensor(rewards)
    return {"input_ids": b["input_ids"], "mask": b["mask"], "rewards": seq_rewards, "rollout_logp": b["rollout_logp"],
            "lengths": b["lengths"].tolist()}


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Move a chunk to the trainer's device. On CUDA the host copy is pinned first so the
    transfer is asynchronous (torch's pinned-memory allocator keeps the buffer until it is done)."""
    if device.type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}
    return {k: v.to(device) for k, v in tensors.items()}


def plan_chunks(lengths: list[int], n_mini: int, micro_rows: int, max_tokens: int = 0, cost=None) -> Plan:
    """Rows of each mini-batch (contiguous, equal) split into micro-batches.

    max_tokens == 0: consecutive slices of `micro_rows` rows. max_tokens > 0: micro-batches whose computed
    tokens (`cost` of their rows' lengths: the trainer's `models.computed_tokens`; by default padded) fit the
    budget, longest rows first, each into the first that has room (first fit decreasing: rows of like length
    together, so little is padding), the SAME count on every rank (a collective: FSDP needs equal calls): a
    rank that needs fewer halves its costliest. A row over the budget gets a micro-batch of its own."""
    tokens = lambda rows: (cost or padded_tokens)([lengths[r] for r in rows])  # noqa: E731
    per_mini = len(lengths) // n_mini
    plan = []
    for mini in range(n_mini):
        rows = list(range(mini * per_mini, (mini + 1) * per_mini))
        if not max_tokens:
            plan.append([rows[i:i + micro_rows] for i in range(0, per_mini, micro_rows)])
            continue
        bins = _first_fit(rows, lengths, max_tokens, tokens)
        n = _agree_max(len(bins))
        while True:
            _split(bins, n, lengths, tokens)
            ok = all(tokens(b) <= max_tokens or len(b) == 1 for b in bins)
            if _agree_max(0 if ok else 1) == 0:
                break
            n += 1
        plan.append(sorted(sorted(b) for b in bins))  # each micro-batch's rows in batch order
    return plan


def padded_tokens(lengths: list[int]) -> int:
    """Tokens a padded forward of rows this long computes: rows x the longest."""
    return len(lengths) * max(lengths, default=0)


def _first_fit(rows, lengths, budget, tokens) -> list[list[int]]:
    bins: list[list[int]] = []
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        for b in bins:
            if tokens(b + [r]) <= budget:
                b.append(r)
                break
        else:
            bins.append([r])
    return bins


def _split(bins: list[list[int]], n: int, lengths, tokens) -> None:
    """Halve the costliest micro-batch of several rows, its longer rows apart from its shorter, until there
    are `n` (or every row is alone)."""
    while len(bins) < n and any(len(b) > 1 for b in bins):
        b = max((b for b in bins if len(b) > 1), key=tokens)
        bins.remove(b)
        b = sorted(b, key=lambda r: (-lengths[r], r))
        bins += [b[:len(b) // 2], b[len(b) // 2:]]


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
            raise KeyError("rollout store: read after the batch was released "
                           "(the ahead pass ran but the reader count was not raised for it)")
        self.reads_left -= 1
        picked = self.plan[mini][micro]
        lengths = [self.lengths[r] for r in picked]
        rows, T = torch.tensor(picked), max(lengths)
        out = {k: (v[rows, :T] if v.dim() == 2 else v[rows]) for k, v in self.batch.items() if k != "lengths"}
        if self.reads_left == 0:
            self.batch = {}  # release the bulk after its last reader
        return {**to_device(out, self.device), "lengths": lengths}

    def close(self) -> None:
        if self.reads_left:
            raise RuntimeError(f"rollout store: {self.reads_left} planned read(s) never happened: the batch "
                               "leaked (reader count raised for an ahead pass that did not run)")


# ---- padding-free packing ----

@dataclass
class Layout:
    """Where each real token of a right-padded (B, T) batch sits in (lanes, capacity)."""
    lanes: int
    capacity: int
    positions: torch.Tensor   # (lanes, capacity) long: restarts at 0 for every row and for the tail pad
    packed: torch.Tensor      # (N,) flat index into lanes x capacity of every real token
    padded: torch.Tensor      # (N,) the same tokens' flat index into B x T
    src: torch.Tensor         # (M,) `packed` without each row's first token (its output has no context: 0)
    dst: torch.Tensor         # (M,) `padded` likewise (index lists, not a boolean mask: no data-dependent shape)
    shape: tuple[int, int]    # (B, T)

    @staticmethod
    def of(lengths: list[int], T: int, one_lane: bool = False) -> "Layout":
        capacity = sum(lengths) if one_lane else max(lengths, default=0)
        lanes = lanes_of(lengths, capacity)
        positions: list[int] = []
        packed: list[int] = []
        padded: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        for i, rows in enumerate(lanes):  # plain lists, one tensor each at the end: ~0.2 ms for 64 rows
            at = i * capacity
            for r in rows:
                n = lengths[r]
                positions += range(n)
                packed += range(at, at + n)
                padded += range(r * T, r * T + n)
                src += range(at + 1, at + n)
                dst += range(r * T + 1, r * T + n)
                at += n
            positions += range((i + 1) * capacity - at)  # the tail pad: a segment of its own
        long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return Layout(len(lanes), capacity, long(positions).view(len(lanes), capacity), long(packed), long(padded),
                      long(src), long(dst), (len(lengths), T))

    def to(self, device: torch.device) -> "Layout":
        """On CUDA through pinned memory, non-blocking: a pageable copy waits for the card's queue to drain."""
        move = (lambda t: t.pin_memory().to(device, non_blocking=True)) if device.type == "cuda" else (  # noqa: E731
            lambda t: t.to(device))
        return Layout(self.lanes, self.capacity, *(move(t) for t in (self.positions, self.packed, self.padded,
                                                                     self.src, self.dst)), self.shape)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (lanes, capacity); pads hold 0."""
        out = x.new_zeros(self.lanes * self.capacity)
        out[self.packed] = x.reshape(-1)[self.padded]
        return out.view(self.lanes, self.capacity)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """(lanes, capacity) per-token outputs read off the token BEFORE (logprobs, values) -> (B, T).
        A row's first column and its pad are 0, as the padded path's column 0 and masked pad."""
        B, T = self.shape  # a fresh (B, T) tensor, not a view: FSDP2 warns of a module that returns one
        return y.new_zeros(B, T).index_put((self.dst // T, self.dst % T), y.reshape(-1)[self.src])


def lanes_of(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices per lane: first fit, longest row first, each lane's rows in batch order."""
    lanes: list[list[int]] = []
    room: list[int] = []
    for r in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        i = next((i for i, free in enumerate(room) if free >= lengths[r]), len(lanes))
        if i == len(lanes):
            lanes.append([])
            room.append(capacity)
        lanes[i].append(r)
        room[i] -= lengths[r]
    return [sorted(rows) for rows in lanes]


def computed_tokens(lengths: list[int]) -> int:
    """Tokens a packed forward of these rows computes (lanes as long as the longest row)."""
    return len(lanes_of(lengths, max(lengths, default=0))) * max(lengths, default=0)


def one_lane(model: torch.nn.Module) -> bool:
    """transformers detects packed positions for flash attention only at batch size 1."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return impl.startswith("flash")


@torch.no_grad()
def exact(forward, vocab: int, tol: float = 1e-4) -> float | None:
    """Whether `forward(input_ids, position_ids)` keeps packed rows apart: None when two rows scored alone
    and packed agree within `tol` (relative), else the difference."""
    a = torch.arange(1, 6) % vocab
    b = torch.arange(7, 10) % vocab
    alone = [forward(x[None], torch.arange(len(x))[None])[0] for x in (a, b)]
    both = forward(torch.cat([a, b])[None], torch.cat([torch.arange(5), torch.arange(3)])[None])[0]
    diff = max((both[:5] - alone[0]).abs().max().item(), (both[5:] - alone[1]).abs().max().item())
    scale = 1.0 + max(x.abs().max().item() for x in alone)
    return None if diff <= tol * scale else diff / scale
