"""The optimizer-step window: deferred normalization, scale -> clip -> step, the poisoned window.

Rules B5-B13 of docs/invariants.md: deferred normalization, the poisoned window, the metric roll-up.
One window is `n_micro` calls of `backward(loss, divisor)`, then one optimizer step:

- n_micro == 1: `loss.backward()` exactly as the single-call path always did (B7): the
  deferred path's `(sum a_i) * s` and `sum(a_i * s)` differ in the last bits.
- n_micro > 1: backpropagate each chunk's UN-normalized sum `loss * divisor`, add up the
  divisors, and on the last call scale every gradient once by `1 / max(sum, 1)` (B8), THEN
  clip, THEN step (B9). `max(., 1)`: an all-empty window has sum 0 and a zero gradient, not NaN (B10).
  Exact because gradients are linear; no extra collective, because each divisor is already a DP
  mean and the DP mean is linear over chunks.
- A non-finite chunk loss poisons its window (B12): gradients are zeroed, the divisor sum is
  reset, and exactly the remaining calls of that window are discarded (`discarding()` is true
  for them), so the next step sees only the next mini-batch. An open window (n_micro=None, a
  PPO step) stays poisoned until `finish()`: every later `backward` is refused, and `finish()`
  takes no step and leaves no gradient behind. Finiteness is agreed across ranks first, so
  every rank takes the same branch and FSDP's collectives stay matched.
- `roll_up` (B13): losses and rates token-weighted by the divisor, counts summed.

The caller owns the forward; the window owns backward, scaling, clipping and the step.
"""

from __future__ import annotations

import math
import time

import torch

from minirl import dist

COUNTS = ("_denom", "_n", "_tokens")   # metric suffixes that are counts: summed, never averaged
MAXIMA = ("_max",)                     # metric suffixes reduced by max
SHARED = ("skipped_nonfinite",)        # counts every rank holds alike: summed over calls, max over ranks


class Accumulator:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, n_micro: int | None,
                 max_grad_norm: float = 0.0, schedule=None):
        """n_micro=None opens a window of unknown length (PPO streaming: the chunk count is decided
        by the sampler at run time); the caller closes it with `finish()`. `schedule(k)`: the
        learning rate of optimizer step k (`lr_schedule`), set before every step; None = the
        optimizer's own."""
        self.model, self.optimizer, self.schedule = model, optimizer, schedule
        self.n_micro, self.max_grad_norm = n_micro, max_grad_norm
        self.calls = 0          # calls so far in the current window
        self.denom = 0.0        # sum of divisors in the current window
        self.to_discard = 0     # remaining calls of a poisoned window
        self.steps = 0          # optimizer steps taken
        self.skipped = 0        # windows abandoned for a non-finite loss or gradient
        self.poisoned = False   # an open window hit a non-finite loss: drop calls until finish()
        self.step_s = 0.0       # wall time spent in clip + optimizer steps (MINIRL_PROFILE_LOOP)

    def discarding(self) -> bool:
        """True (and consumes one) while the rest of a poisoned window is being dropped; skip the call."""
        if self.poisoned:
            return True
        if self.to_discard:
            self.to_discard -= 1
            return True
        return False

    def backward(self, loss: torch.Tensor, divisor: torch.Tensor | float) -> dict | None:
        """Backpropagate one call; step on the window's last. Returns step metrics when it stepped,
        `{"skipped_nonfinite": 1.0}` when this call poisoned the window."""
        if self.poisoned:  # the rest of a poisoned open window: refused on every rank alike
            return None
        bad = torch.tensor(0.0 if torch.isfinite(loss.detach()).all() else 1.0)
        if dist.all_reduce(bad, "max").item():
            remaining = self.n_micro - self.calls - 1 if self.n_micro else 0
            self._reset()
            if hasattr(self.model, "reshard"):  # no backward comes for this forward: FSDP2's root stays gathered
                self.model.reshard()
            self.to_discard, self.poisoned = remaining, self.n_micro is None
            self.skipped += 1
            return {"skipped_nonfinite": 1.0}
        if self.n_micro == 1:
            loss.backward()
            return self._step()
        (loss * float(divisor)).backward()
        self.denom += float(divisor)
        self.calls += 1
        if self.n_micro is None or self.calls < self.n_micro:
            return None
        return self.finish()

    def finish(self) -> dict:
        """Close the window: scale by 1 / max(sum of divisors, 1), then clip, then step (B8, B9)."""
        if self.poisoned:  # already counted when the window was poisoned; nothing may leak into the next
            self.poisoned = False
            self._reset()
            return {}
        scale = 1.0 / max(self.denom, 1.0)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return self._step()

    def _step(self) -> dict:
        t0 = time.perf_counter()
        norm = _clip(self.model, self.max_grad_norm)
        if not math.isfinite(norm):
            self._reset()
            self.skipped += 1
            return {"skipped_nonfinite": 1.0, "grad_norm": norm}
        if self.schedule is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = self.schedule(self.steps)
        self.optimizer.step()
        self._reset()
        self.steps += 1
        self.step_s += time.perf_counter() - t0
        return {"grad_norm": norm}

    def _reset(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.calls, self.denom = 0, 0.0


def lr_schedule(peak: float, warmup: int, total: int, kind: str = "constant", min_ratio: float = 0.0):
    """The learning rate of optimizer step k (0-based): linear warmup to `peak` over `warmup` steps,
    then constant, or a cosine from `peak` down to `min_ratio * peak` at step `total - 1`."""
    def lr(k: int) -> float:
        if k < warmup:
            return peak * (k + 1) / warmup
        if kind == "constant":
            return peak
        progress = min(1.0, (k - warmup) / max(1, total - 1 - warmup))
        return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return lr


class StalledError(RuntimeError):
    """The run stopped because its updates kept coming out non-finite; the message says why."""


class Stall:
    """Counts consecutive steps that took no optimizer step (every window skipped as non-finite) and
    stops the run after `limit` of them: a policy that only produces NaN losses cannot learn again,
    and training on would only overwrite checkpoints and the export with it."""

    def __init__(self, limit: int, hint: str):
        self.limit, self.hint, self.in_a_row = limit, hint, 0

    def step(self, stepped: bool, step: int) -> None:
        self.in_a_row = 0 if stepped else self.in_a_row + 1
        if self.in_a_row >= self.limit:
            raise StalledError(
                f"step {step}: {self.in_a_row} steps in a row ({step - self.in_a_row + 1}-{step}) took no optimizer step: "
                f"every update was non-finite. The likely cause is {self.hint}. Nothing was saved or exported from "
                "this state; resume from the newest checkpoint with a lower learning rate")


def _clip(model: torch.nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm is a DTensor
        norm = norm.full_tensor()
    return norm.item()


def roll_up(calls: list[dict]) -> dict:
    """Combine per-call metrics into one record (B13).

    Keys ending in a COUNTS suffix are summed; `*_max` keys take the max; every other key of a
    `<prefix>_*` family is weighted by that family's divisor `<prefix>_denom`:
    sum(x_i * denom_i) / sum(denom_i), which telescopes back to the whole batch's value. Keys
    without a divisor in their family are averaged over the calls that report them.
    """
    out: dict[str, float] = {}
    keys = {k for c in calls for k in c}
    for k in sorted(keys):
        vals = [(c[k], c) for c in calls if k in c]
        if k.endswith(COUNTS + SHARED):
            out[k] = sum(v for v, _ in vals)
        elif k.endswith(MAXIMA):
            out[k] = max(v for v, _ in vals)
        else:
            denom_key = k.split("_", 1)[0] + "_denom"
            w = [c.get(denom_key) for _, c in vals]
            if all(x is not None for x in w) and sum(w) > 0:
                out[k] = sum(v * x for (v, _), x in zip(vals, w)) / sum(w)
            else:
                out[k] = sum(v for v, _ in vals) / len(vals)
    return out


def across_ranks(metrics: dict) -> dict:
    """One record for the whole data-parallel group (a collective: every rank must call it).

    Counts sum over ranks, except the divisor, which is already a DP mean and equal on every
    rank; `*_max` takes the max; counts every rank shares (`*skipped_nonfinite`: a skip is
    decided by an all-reduce, so each rank counts the same windows) take the max too, never the
    sum; everything else is the mean over ranks, which is exact for a loss normalized by the
    shared DP-mean divisor.
    """
    keys = sorted(metrics)
    if not keys:
        return {}
    vals = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    summed = dist.all_reduce(vals.clone(), "sum")
    maxed = dist.all_reduce(vals.clone(), "max")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    out = {}
    for i, k in enumerate(keys):
        if k.endswith("_denom"):
            out[k] = metrics[k]
        elif k.endswith(MAXIMA + SHARED):
            out[k] = maxed[i].item()
        elif k.endswith(COUNTS):
            out[k] = summed[i].item()
        else:
            out[k] = summed[i].item() / world
    return out
