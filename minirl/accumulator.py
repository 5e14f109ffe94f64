"""The optimizer-step window: deferred normalization, scale -> clip -> step, the poisoned window, and
the metric roll-up (rules B5-B13 in docs/invariants.md).

One window is `n_micro` calls of `backward(loss, divisor)`, then `finish()`: at n_micro == 1 a plain
`loss.backward()` (B7); else each chunk's un-normalized `loss * divisor` is backpropagated, the
divisors summed, and every gradient scaled once by 1 / max(sum, 1) (B8, B10), THEN clipped, THEN
stepped (B9). Exact because gradients are linear; no collective of its own, because each divisor is
already a DP mean. A non-finite loss poisons its window (B12): it runs to its fixed end and is
dropped whole, agreed across ranks. The host reads per optimizer step are `finish`'s one and the
step's metrics (`roll_up`, B13).
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
        """n_micro=None opens a window of unknown length that the caller closes with `finish()` (PPO streaming).
        `schedule(k)`: optimizer step k's learning rate, set before every step; None = the optimizer's own."""
        self.model, self.optimizer, self.schedule = model, optimizer, schedule
        self.n_micro, self.max_grad_norm = n_micro, max_grad_norm
        self.calls = 0          # calls so far in the current window
        self.denom = 0.0        # sum of divisors in the current window (a float64 device scalar once a call came)
        self.finite = None      # a device flag: every loss of the current window is finite
        self.steps = 0          # optimizer steps taken
        self.skipped = 0        # windows abandoned for a non-finite loss or gradient
        self.step_s = 0.0       # wall time spent in clip + optimizer steps (MINIRL_PROFILE_LOOP)

    def timer(self):
        """For the profile: a function that gives the time spent in optimizer steps from now on."""
        t0 = self.step_s
        return lambda: {"optimizer_s": self.step_s - t0}

    def backward(self, loss: torch.Tensor, divisor: torch.Tensor | float) -> dict | None:
        """Backpropagate one call; close the window on its last and return `finish()`'s metrics."""
        finite = torch.isfinite(loss.detach())
        self.finite = finite if self.finite is None else self.finite & finite
        if self.n_micro == 1:
            loss.backward()
        else:
            (loss * divisor).backward()
            self.denom = self.denom + torch.as_tensor(divisor, dtype=torch.float64)
        self.calls += 1
        if self.n_micro is None or self.calls < self.n_micro:
            return None
        return self.finish()

    def finish(self) -> dict:
        """Close the window: scale by 1 / max(sum of divisors, 1) (B8, B7), clip (B9), then the one host read
        of every rank's finiteness and the norm: a step if both are finite, else the window is dropped (B12)."""
        t0 = time.perf_counter()
        if self.n_micro != 1:
            d = self.denom
            scale = 1.0 / (d.clamp_min(1.0) if isinstance(d, torch.Tensor) else max(d, 1.0))  # on the device
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(scale)
        norm = _clip(self.model, self.max_grad_norm)
        finite = self.finite if self.finite is not None else torch.ones((), dtype=torch.bool, device=norm.device)
        bad = dist.all_reduce((~finite).to(norm.device, torch.float32).reshape(1), "max")[0]  # any rank's
        finite, norm = torch.stack([1 - bad, norm.float()]).tolist()  # the window's one host read (a GPU sync)
        if not finite or not math.isfinite(norm):
            self._reset()
            self.skipped += 1
            return {"skipped_nonfinite": 1.0} if not finite else {"skipped_nonfinite": 1.0, "grad_norm": norm}
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
        self.calls, self.denom, self.finite = 0, 0.0, None


def lr_schedule(peak: float, warmup: int, total: int, kind: str = "constant", min_ratio: float = 0.0):
    """Optimizer step k's learning rate: linear warmup to `peak`, then constant, or a cosine down to
    `min_ratio * peak` at step `total`, one past the run's last (Hugging Face's: the last update moves)."""
    def lr(k: int) -> float:
        if k < warmup:
            return peak * (k + 1) / warmup
        if kind == "constant":
            return peak
        progress = min(1.0, (k - warmup) / max(1, total - warmup))
        return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return lr


class StalledError(RuntimeError):
    """The run stopped because its updates kept coming out non-finite; the message says why."""


class Stall:
    """Stops the run after `limit` steps in a row without an optimizer step (every window non-finite):
    training on would only overwrite the checkpoints and the export."""

    def __init__(self, limit: int, hint: str):
        self.limit, self.hint, self.in_a_row = limit, hint, 0

    def step(self, stepped: bool, step: int) -> None:
        self.in_a_row = 0 if stepped else self.in_a_row + 1
        if self.in_a_row >= self.limit:
            raise StalledError(
                f"step {step}: {self.in_a_row} steps in a row ({step - self.in_a_row + 1}-{step}) took no optimizer step: "
                f"every update was non-finite. The likely cause is {self.hint}. Nothing was saved or exported from "
                "this state; resume from the newest checkpoint with a lower learning rate")


def _clip(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to `max_norm` (0 = none) and return their norm, a 0-dim tensor on their device."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        p = next(model.parameters())
        return torch.zeros((), device=p.to_local().device if hasattr(p, "to_local") else p.device)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm is a DTensor
        norm = norm.full_tensor()
    return norm


def roll_up(calls: list[dict]) -> dict:
    """Combine per-call metrics into one record of floats (B13).

    COUNTS suffixes are summed, `*_max` keys maxed; a family's `<prefix>_loss` is weighted by its divisor
    `<prefix>_denom`, its other keys (per-token rates) by its `<prefix>_tokens` where it has them, else by
    the divisor, so the result telescopes to the whole batch's value; anything else is a plain mean. The
    values may be 0-dim device tensors: combined on the device and read back in one transfer."""
    keys = sorted({k for c in calls for k in c})
    device = next((v.device for c in calls for v in c.values() if isinstance(v, torch.Tensor)), None)
    if device is None:  # host numbers only
        as_t = lambda v: torch.tensor(float(v), dtype=torch.float64)  # noqa: E731
    else:  # a number goes to the device as a fill, never a blocking copy
        as_t = lambda v: (v.to(torch.float64) if isinstance(v, torch.Tensor)  # noqa: E731
                          else torch.full((), float(v), dtype=torch.float64, device=device))
    out = {}
    for k in keys:
        with_k = [c for c in calls if k in c]
        v = torch.stack([as_t(c[k]) for c in with_k])
        if k.endswith(COUNTS + SHARED):
            out[k] = v.sum()
        elif k.endswith(MAXIMA):
            out[k] = v.max()
        else:
            weight = _weight_key(k, lambda w: all(w in c for c in with_k))
            if weight is not None:
                w = torch.stack([as_t(c[weight]) for c in with_k])
                total = w.sum()
                out[k] = torch.where(total > 0, (v * w).sum() / total.clamp_min(1e-300), v.mean())
            else:
                out[k] = v.mean()
    values = torch.stack(list(out.values())).tolist() if out else []  # one read (a sync on a GPU)
    return dict(zip(out, values))


def _weight_key(k: str, has) -> str | None:
    """The key a family's metric `k` is weighted by where `has(key)`: its loss by its divisor `<prefix>_denom`,
    its other keys (per-token rates) by its `<prefix>_tokens`, else by the divisor; None: a plain mean."""
    family = k.split("_", 1)[0]
    names = [f"{family}_denom"] if k.endswith("_loss") else [f"{family}_tokens", f"{family}_denom"]
    return next((w for w in names if has(w)), None)


def across_ranks(metrics: dict) -> dict:
    """One record for the whole data-parallel group (a collective). Counts are summed over ranks but the
    divisor (already a DP mean); `*_max` and the shared skip counts take the max; the rest is weighted by
    each rank's weight as `roll_up` weighs calls (`_weight_key`): a per-token rate by the rank's tokens, so
    ranks holding unequal token counts log the whole batch's value, a loss by the divisor every rank shares
    (the mean, exact for a loss normalized by it); a key of no family, the mean."""
    keys = sorted(metrics)
    if not keys:
        return {}
    names = [_weight_key(k, metrics.__contains__) for k in keys]
    vals = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)  # host numbers: gloo reduces them
    w = torch.tensor([float(metrics[n]) if n else 1.0 for n in names], dtype=torch.float64)
    summed, weighted, weights = dist.all_reduce(torch.cat([vals, vals * w, w]), "sum").view(3, -1).tolist()
    maxed = dist.all_reduce(vals.clone(), "max").tolist()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    out = {}
    for i, k in enumerate(keys):
        if k.endswith("_denom"):
            out[k] = metrics[k]
        elif k.endswith(MAXIMA + SHARED):
            out[k] = maxed[i]
        elif k.endswith(COUNTS):
            out[k] = summed[i]
        elif world > 1 and weights[i] > 0:
            out[k] = weighted[i] / weights[i]
        else:  # one rank's own value as it is; no weight on any rank: the plain mean
            out[k] = summed[i] / world
    return out
