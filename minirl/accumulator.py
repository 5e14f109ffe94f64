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
- A non-finite chunk loss poisons its window (B12): the window is abandoned whole at its end, its
  gradients zeroed and its divisor sum reset, with no optimizer step, so the next window holds only
  the next mini-batch. Finiteness is tracked on the device and read once, when the window closes,
  together with the gradient norm: the rest of a poisoned window still runs and is dropped with it,
  since telling the host after each call would be a sync per micro-batch on a GPU (a stall of its
  queue). The window's length is fixed (n_micro calls, or an open PPO window closed by `finish()`),
  so a drop never misaligns the next window. The flag is agreed across ranks (a max all-reduce) before
  the read, so every rank takes the same branch and FSDP's collectives stay matched.
- `roll_up` (B13): losses and rates token-weighted by the divisor, counts summed, computed on the
  device and read back once per step.

The caller owns the forward; the window owns backward, scaling, clipping and the step. The host
reads per optimizer step are the window's one (`finish`) and the step's metrics (`roll_up`), at any
n_micro.
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
        """Close the window: scale by 1 / max(sum of divisors, 1) (B8; a one-call window as it is, B7),
        then clip (B9), then one host read: every rank's finiteness and the norm; a step if both are
        finite, else the window is dropped (B12). {"grad_norm": ...}, plus "skipped_nonfinite": 1.0
        for a drop."""
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
    """The learning rate of optimizer step k (0-based): linear warmup to `peak` over `warmup` steps,
    then constant, or a cosine from `peak` down to `min_ratio * peak` at step `total`, one past the
    run's last (as Hugging Face's cosine schedule): at --rl.min-lr-ratio 0 the last update still moves."""
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

    Keys ending in a COUNTS suffix are summed; `*_max` keys take the max; a family's `<prefix>_loss`
    is weighted by its divisor `<prefix>_denom`, its other keys (per-token rates: the clip fraction,
    KL, entropy) by its `<prefix>_tokens` where it counts them, else by the divisor:
    sum(x_i * w_i) / sum(w_i), which telescopes back to the whole batch's value (under a seq-mean
    loss the divisor counts sequences, so a token rate weighted by it would not). Keys without a
    weight in their family (or whose weights sum to 0) are averaged over the calls that report them. Values may be numbers or 0-dim device tensors (the objective's): the tensors are
    combined on their device and read back in one transfer, the step's one read of its metrics.
    """
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
            family = k.split("_", 1)[0]  # the loss by its divisor; a per-token rate by its tokens
            weights = [f"{family}_denom"] if k.endswith("_loss") else [f"{family}_tokens", f"{family}_denom"]
            weight = next((w for w in weights if all(w in c for c in with_k)), None)
            if weight is not None:
                w = torch.stack([as_t(c[weight]) for c in with_k])
                total = w.sum()
                out[k] = torch.where(total > 0, (v * w).sum() / total.clamp_min(1e-300), v.mean())
            else:
                out[k] = v.mean()
    values = torch.stack(list(out.values())).tolist() if out else []  # one read (a sync on a GPU)
    return dict(zip(out, values))


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
