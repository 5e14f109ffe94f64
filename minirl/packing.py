"""Padding-free rows: a micro-batch's sequences laid end to end, positions restarting per row.

A right-padded (B, T) micro-batch computes B x T tokens for sum(lengths) real ones; with skewed
completion lengths most of that is pad. Packed, the rows go end to end into lanes of `capacity`
tokens (first fit, longest first) and each row's `position_ids` restart at 0. transformers reads the
restarts and builds a block-diagonal causal mask (sdpa, eager), so a token attends only to its own
row and every number equals the padded path's up to float rounding (test_packing.py guards
logprobs, values and gradients to 1e-6). A model loaded with flash attention is packed into ONE
lane: transformers serves packed positions through varlen flash kernels only at batch size 1.

Lanes are as long as the longest row, so no lane is longer than the padded batch and attention
(quadratic in a lane's length under a dense mask) never costs more than padded; only the ends of
the lanes are pad (`Layout.computed` counts them).

`exact(forward)` checks, once per model at load time, that the model really separates packed rows
(one that ignored `position_ids` would let rows see each other): minirl packs only where it does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def computed(self) -> int:
        """Tokens the forward computes (real plus the lanes' tail pad)."""
        return self.lanes * self.capacity

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
        B, T = self.shape
        return y.new_zeros(B * T).index_put((self.dst,), y.reshape(-1)[self.src]).view(B, T)


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
    """Whether `forward(input_ids, position_ids) -> (B, T, D)` keeps packed rows apart: two rows
    (5 and 3 tokens) scored alone and packed into one lane must agree. Returns the largest
    difference relative to the outputs' scale, or None when it is within `tol` (float32)."""
    a = torch.arange(1, 6) % vocab
    b = torch.arange(7, 10) % vocab
    alone = [forward(x[None], torch.arange(len(x))[None])[0] for x in (a, b)]
    both = forward(torch.cat([a, b])[None], torch.cat([torch.arange(5), torch.arange(3)])[None])[0]
    diff = max((both[:5] - alone[0]).abs().max().item(), (both[5:] - alone[1]).abs().max().item())
    scale = 1.0 + max(x.abs().max().item() for x in alone)
    return None if diff <= tol * scale else diff / scale
