"""Advantages: GAE with masked holes, masked whitening, and GRPO group advantages.

Shapes: B sequences, T completion positions, P prompts, G samples per prompt (B = P*G).
`mask` is 1.0 on the completion tokens that are trained on. GAE and group advantages are local
to the rank that calls them (a row's advantage needs only its own row, a group lives on one
rank). Whitening is not: each train rank holds only its share of a chunk's (or the batch's)
rows, so `masked_whiten` takes its moments over every rank's valid entries (S19: "within each
chunk" under streaming, "over the complete batch" in full batch, never over one rank's shard).
"""

from __future__ import annotations

import torch

from minirl import dist


@torch.no_grad()
def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's valid tokens.

    Masked positions inside a row (tool output, a shared prefix) are skipped as if absent: the
    recursion links each valid token to the next VALID token, and the value after a row's last
    valid token is 0 (the episode ends there). Rewards and values at masked positions never
    reach a valid result (they are selected away, so even NaN there is harmless).
    Returns (advantages, returns), both (B, T), zero at masked positions;
    returns = advantages + values on valid tokens.
    """
    B, T = rewards.shape
    valid = mask.bool()
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)  # V(s_{t+1}) of the next valid token
    carry = torch.zeros_like(next_value)                                        # A_{t+1} of the next valid token
    for t in reversed(range(T)):
        m = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * carry
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        carry = torch.where(m, a, carry)
        next_value = torch.where(m, values[:, t], next_value)
    returns = torch.where(valid, adv + values, torch.zeros_like(adv))
    return adv, returns


@torch.no_grad()
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the valid entries of every rank; zero at masked positions.

    A collective: every rank of the default group calls it at the same point. The moments are
    two-pass and in float64: count and sum all-reduced, then the sum of squared deviations from
    that mean all-reduced, so each rank's result equals whitening all ranks' entries together.
    Masked sums, never boolean indexing: the result stays on x's device. With fewer than two
    valid entries there is no spread to normalise by: the result is centred only.
    """
    m = mask.to(x.dtype)
    n, total = dist.all_reduce(torch.stack([m.sum(), (x * m).sum()]).double())
    mean = total / n.clamp_min(1)
    centred = x - mean.to(x.dtype)
    var = dist.all_reduce((centred.square() * m).sum().double().reshape(1))[0] / n.clamp_min(1)
    scaled = torch.where(n > 1, centred / (var.sqrt().to(x.dtype) + eps), centred)
    return torch.where(mask.bool(), scaled, torch.zeros_like(x))


@torch.no_grad()
def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each sample's reward minus its prompt group's mean, optionally over the group's std.

    rewards: (B,) with groups contiguous (rows i*G .. i*G+G-1). A group whose rewards are all
    equal has std 0; its advantages are 0 (not NaN, not inflated by 1/eps). A non-finite reward
    stays non-finite (its group's advantages are NaN), so the loss is non-finite and the update is
    skipped and counted (accumulator.py), instead of the broken reward passing as "no signal".
    Returns (B,).
    """
    r = rewards.view(-1, group_size)                       # (P, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = r.std(dim=1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        adv = torch.where(std > eps, adv / std.clamp_min(eps), adv * 0.0)  # NaN * 0 stays NaN
    return adv.reshape(-1)
