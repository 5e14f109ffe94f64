"""Policy and value losses. Each returns (loss, divisor, metrics) (rule B6 in docs/invariants.md).

The loss is normalized per chunk, and the divisor it was normalized by (`<prefix>_denom`: masked
completion tokens, or non-empty sequences for a seq-mean mode) is a data-parallel MEAN, so summed
over chunks it is the batch's divisor and composes with FSDP's mean-reduced gradients without a
world-size factor. An all-empty chunk returns loss 0 (attached to the graph) and divisor 0, never
NaN. Nothing is read back to the host: loss, divisor and metrics stay 0-dim device tensors.

Shapes: B sequences, T positions; per-token tensors are (B, T); `mask` is 1.0 on trained tokens.
"""

from __future__ import annotations

import torch

from minirl import dist


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _normalize(per_token: torch.Tensor, mask: torch.Tensor, agg: str, norm_len: int = 1):
    """Local sum of the loss and the DP-mean divisor it is normalized by, by verl's loss_agg_mode names:
    - token-mean: every masked token of the step weighs the same; the divisor counts tokens.
    - seq-mean-token-mean: each sequence's token mean, then the mean over non-empty sequences (the
      GRPO paper's); seq-mean-token-sum: each sequence's token sum; seq-mean-token-sum-norm: the token
      sum over a constant `norm_len` (Dr. GRPO: the generation budget, --rollout.max-tokens). The three
      divide by the count of non-empty sequences, so a micro-batched step is still the whole step's mean.
    """
    if agg == "token-mean":
        local_sum = (per_token * mask).sum()
        local_n = mask.sum()
    else:
        n_tok = mask.sum(dim=1)                                            # (B,)
        seq = (per_token * mask).sum(dim=1)                                # (B,): each sequence's token sum
        if agg == "seq-mean-token-mean":
            seq = seq / n_tok.clamp_min(1)
        elif agg == "seq-mean-token-sum-norm":
            seq = seq / norm_len
        local_sum = seq.sum()
        local_n = (n_tok > 0).sum().to(per_token.dtype)
    divisor = dist.all_reduce(local_n.detach().clone().float(), "avg")  # the DP mean
    # divisor 0: every rank's sum is 0 too, so this is 0 (and its gradient zero), with no host read
    loss = local_sum / divisor.clamp_min(torch.finfo(divisor.dtype).tiny)
    return loss, divisor


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled token (Schulman's k1, k2, k3;
    verl's `kl`, `mse`, `low_var_kl`): k1 = l - r, k2 = (l - r)^2 / 2, k3 = exp(r - l) - (r - l) - 1 >= 0."""
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    return torch.exp(d) - d - 1


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float = 0.2, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                agg: str = "token-mean", prefix: str = "grpo", clip_eps_high: float = 0.0, dual_clip: float = 0.0,
                entropy: torch.Tensor | None = None, kl_estimator: str = "k3", entropy_coef: float = 0.0,
                norm_len: int = 1):
    """PPO clipped surrogate (+ kl_coef x a KL estimate to the reference, - entropy_coef x the entropy),
    normalized per chunk as `agg` says (`_normalize`).

    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high 0 = clip_eps; DAPO's
    "clip-higher" sets it larger). `dual_clip` c > 1 (verl's clip_ratio_c) bounds the loss of a
    token with a negative advantage by -c * A, however far its ratio has grown (0 = off).
    advantages: (B, T) or (B,) (a sequence-level advantage, broadcast over tokens).
    `entropy` (B, T), the policy's per-token entropy from the same forward, is reported, and with
    entropy_coef > 0 a bonus (it must carry its graph then: `models.token_logprobs(entropy="grad")`).
    Returns (loss, divisor, metrics); metrics are local to this rank and chunk, 0-dim device tensors
    but the row count.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - clip_eps, 1 + (clip_eps_high or clip_eps))
    pg = -torch.minimum(ratio * advantages, clipped * advantages)           # (B, T)
    if dual_clip:
        pg = torch.where(advantages < 0, torch.minimum(pg, -dual_clip * advantages), pg)
    per_token = pg
    kl = None
    if ref_logp is not None and kl_coef:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        per_token = per_token + kl_coef * kl
    if entropy_coef:
        per_token = per_token - entropy_coef * entropy
    loss, divisor = _normalize(per_token, mask, agg, norm_len)

    with torch.no_grad():
        n_tok = mask.sum()
        is_clipped = ((ratio * advantages) > (clipped * advantages)).to(mask.dtype)
        m = {
            f"{prefix}_loss": loss.detach(),
            f"{prefix}_denom": divisor,
            f"{prefix}_n": float(logp.shape[0]),
            f"{prefix}_tokens": n_tok,
            f"{prefix}_clipfrac": (is_clipped * mask).sum() / n_tok.clamp_min(1),
            f"{prefix}_ratio_max": torch.where(n_tok > 0, (ratio * mask).max(), 1.0),
        }
        if kl is not None:
            m[f"{prefix}_kl"] = (kl * mask).sum() / n_tok.clamp_min(1)
        if entropy is not None:
            m[f"{prefix}_entropy"] = (entropy * mask).sum() / n_tok.clamp_min(1)
    return loss, divisor, m


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps: float, prefix: str = "value"):
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, old +- eps) - R)^2), token mean.

    `value_clipfrac` is the share of tokens whose value moved more than eps from its old value
    (|v - v_old| > eps). verl's `vf_clipfrac` counts a different set: the tokens where the clipped
    term is the larger of the two (the clip changed the loss).
    """
    mask = mask.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss, divisor = _normalize(per_token, mask, "token-mean")
    with torch.no_grad():
        n_tok = mask.sum()
        m = {
            f"{prefix}_loss": loss.detach(),
            f"{prefix}_denom": divisor,
            f"{prefix}_n": float(values.shape[0]),
            f"{prefix}_tokens": n_tok,
            f"{prefix}_clipfrac": (((values - old_values).abs() > clip_eps).to(mask.dtype) * mask).sum()
            / n_tok.clamp_min(1),
        }
    return loss, divisor, m


@torch.no_grad()
def logprob_gap(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean |trainer - engine| logprob over this chunk's masked tokens (a 0-dim tensor).

    At the same weights (GRPO) it is the kernels' mismatch: ~1e-6 on CPU in float32, larger for
    the engine's bf16 kernels on GPUs, which is why minirl takes pi_old from the trainer by default.
    For PPO under lookahead it also holds the staleness of groups sampled by an older policy.
    """
    mask = mask.to(trainer_logp.dtype)
    return ((trainer_logp - engine_logp).abs() * mask).sum() / mask.sum().clamp_min(1.0)
