"""The async_rl sampler: which completed prompt groups the trainer takes next (rules S1, S2, S16-S18,
S21, S23 in docs/invariants.md). The controller keeps a `ReadyGroups` set and asks `take()` for the
next chunk.

- `select_count` is the pure rule (S16, S17): cap at the remainder, align down, wait below the
  minimum unless the aligned remainder is all ready, and defer a non-final chunk that would leave
  fewer than ceil(min_groups / 2) groups. 0 means wait. Full batch waits for the whole batch (S18).
- `in_order` takes only a contiguous run from the oldest unconsumed group; `ready_first` any ready
  group. A group of version v is usable at step s only if s - v <= max_lookahead_versions (S23).
- Consumed groups are released only after both updates (`release`): nothing duplicated or dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def select_count(num_ready: int, num_remaining: int, min_groups: int, align: int = 1) -> int:
    """How many ready groups to take now (0 = wait). Pure; see the module docstring."""
    take = min(num_ready, num_remaining)
    take -= take % align
    if take <= 0:
        return 0
    final_remainder = num_remaining - num_remaining % align
    if take == final_remainder:
        return take                      # the aligned remainder is all ready: flush, even below the minimum
    if take < min_groups:
        return 0                         # not enough for a chunk yet
    if num_remaining - take < math.ceil(min_groups / 2):
        return 0                         # would strand a tail below the floor: wait for the rest
    return take


@dataclass
class Group:
    """One prompt's G completed samples, tagged with the policy version that sampled them."""

    index: int        # issue order within the step's batch
    version: int


@dataclass
class ReadyGroups:
    """The controller's view of one step's batch: ready, claimed (in a chunk) and released groups."""

    num_prompts: int
    min_groups: int
    name: str = "in_order"
    max_lookahead_versions: int = 1
    align: int = 1
    ready: dict[int, Group] = field(default_factory=dict)
    claimed: dict[int, Group] = field(default_factory=dict)
    released: int = 0

    def __post_init__(self):
        if self.name not in ("in_order", "ready_first"):
            raise ValueError(f"--async-rl.sampler.name={self.name!r}: use in_order or ready_first")

    @property
    def remaining(self) -> int:
        return self.num_prompts - len(self.claimed) - self.released

    def add(self, group: Group, step: int) -> bool:
        """A group finished generating. Returns False (dropped) if it is too stale for this step."""
        if step - group.version > self.max_lookahead_versions:
            return False
        if group.index in self.ready or group.index in self.claimed:  # `python -O` keeps this check
            raise ValueError(f"duplicate group {group.index}: it is already {'ready' if group.index in self.ready else 'claimed'}")
        self.ready[group.index] = group
        return True

    def _eligible(self) -> list[int]:
        if self.name == "ready_first":
            return sorted(self.ready)
        # in_order: the contiguous run of ready groups after the claimed ones (each claim is such a run, so
        # the claimed groups are always 0 .. len(claimed) - 1)
        run = []
        for i in range(len(self.claimed), self.num_prompts):
            if i not in self.ready:
                break
            run.append(i)
        return run

    def take(self) -> list[Group]:
        """Claim the next chunk, or [] to wait. Streaming uses select_count; full batch waits for all."""
        eligible = self._eligible()
        if self.min_groups >= self.num_prompts:
            n = self.remaining if len(eligible) == self.remaining else 0
        else:
            n = select_count(len(eligible), self.remaining, self.min_groups, self.align)
        chunk = [self.ready.pop(i) for i in eligible[:n]]
        for g in chunk:
            self.claimed[g.index] = g
        return chunk

    def release(self) -> None:
        """After the policy AND critic updates: the step's consumed groups leave the store."""
        self.released += len(self.claimed)
        self.claimed.clear()
