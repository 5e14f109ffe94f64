"""objective.py: each loss returns (normalized loss, divisor, metrics); divisors are post-shaping counts (B6)."""

import math

import pytest
import torch

from minirl.objective import AGG_MODES, KL_ESTIMATORS, kl_penalty, policy_loss, value_loss


def _inputs(seed=0, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g)
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    return logp, old, adv, mask


def test_policy_loss_divisor_is_masked_token_count(world):
    logp, old, adv, mask = _inputs()
    logp.requires_grad_(True)
    loss, divisor, m = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    assert divisor.item() == mask.sum().item() == m["grpo_denom"]
    ratio = torch.exp(logp - old)
    A = adv[:, None].expand_as(logp)
    per_tok = -torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A)
    torch.testing.assert_close(loss, (per_tok * mask).sum() / mask.sum())
    clipped = ((ratio * A) > (ratio.clamp(0.8, 1.2) * A)).float()
    assert abs(m["grpo_clipfrac"] - ((clipped * mask).sum() / mask.sum()).item()) < 1e-6
    assert m["grpo_n"] == 6 and m["grpo_tokens"] == mask.sum().item()


def test_sequence_mean_divisor_counts_nonempty_sequences(world):
    logp, old, adv, mask = _inputs(1)
    mask[2] = 0.0
    for agg in AGG_MODES[1:]:
        _, divisor, _ = policy_loss(logp, old, adv, mask, 0.2, agg=agg)
        assert divisor.item() == 5, agg


@pytest.mark.parametrize("agg", AGG_MODES)
def test_each_loss_agg_mode_is_verls_on_one_chunk(world, agg):
    """verl's agg_loss (trainer/ppo/core_algos.py) written out, on a chunk with no empty row. For
    seq-mean-token-sum-norm verl divides the token sum by the mask's width per micro-batch; minirl by
    the constant --rollout.max-tokens and the sequence count, so a micro-batched step stays exact."""
    logp, old, adv, mask = _inputs(8)
    mask[:, 0] = 1.0
    loss, _, _ = policy_loss(logp, old, adv, mask, 0.2, agg=agg, norm_len=mask.shape[1])
    A = adv[:, None].expand_as(logp)
    ratio = torch.exp(logp - old)
    mat = -torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A)
    seq = (mat * mask).sum(-1)
    want = {"token-mean": (mat * mask).sum() / mask.sum(), "seq-mean-token-sum": seq.mean(),
            "seq-mean-token-mean": (seq / mask.sum(-1)).mean(),
            "seq-mean-token-sum-norm": seq.sum() / mask.shape[-1] / mask.shape[0]}[agg]
    torch.testing.assert_close(loss, want)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimators_are_verls_kl_mse_and_low_var_kl(world, estimator):
    """verl's kl_penalty: k1 ("kl") l - r, k2 ("mse") (l - r)^2 / 2, k3 ("low_var_kl") exp(r - l) - (r - l) - 1."""
    logp, _, _, _ = _inputs(9)
    ref = logp + 0.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    want = {"k1": logp - ref, "k2": 0.5 * (logp - ref) ** 2, "k3": torch.exp(ref - logp) - (ref - logp) - 1}
    torch.testing.assert_close(kl_penalty(logp, ref, estimator), want[estimator])


def test_the_entropy_bonus_lowers_the_loss_by_its_coefficient_times_the_mean_entropy(world):
    logp, old, adv, mask = _inputs(10)
    ent = (torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_(True)
    base, _, _ = policy_loss(logp, old, adv, mask, 0.2, entropy=ent)
    bonus, _, m = policy_loss(logp, old, adv, mask, 0.2, entropy=ent, entropy_coef=0.05)
    torch.testing.assert_close(base - bonus, 0.05 * (ent * mask).sum() / mask.sum())
    bonus.backward()
    torch.testing.assert_close(ent.grad, -0.05 * mask / mask.sum())


def test_all_empty_chunk_gives_zero_loss_and_zero_divisor_not_nan(world):
    logp, old, adv, mask = _inputs(2)
    logp.requires_grad_(True)
    loss, divisor, m = policy_loss(logp, old, adv, torch.zeros_like(mask), 0.2)
    assert divisor.item() == 0 and loss.item() == 0.0 and torch.isfinite(loss)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    vloss, vdiv, _ = value_loss(logp.detach().requires_grad_(), old, old, torch.zeros_like(mask), 0.2)
    assert vdiv.item() == 0 and vloss.item() == 0.0


def test_kl_term_is_zero_at_the_reference_and_positive_away(world):
    logp, old, adv, mask = _inputs(3)
    _, _, m0 = policy_loss(logp, old, adv, mask, 0.2, ref_logp=logp.clone(), kl_coef=0.1)
    _, _, m1 = policy_loss(logp, old, adv, mask, 0.2, ref_logp=logp - 0.5, kl_coef=0.1)
    assert m0["grpo_kl"] == 0.0 and m1["grpo_kl"] > 0.0


def test_kl_penalty_is_k3_of_kl_to_the_reference_with_its_gradient(world):
    """With zero advantages the loss is kl_coef times the token mean of k3 = exp(r - l) - (r - l) - 1
    (l the policy's logprob, r the reference's: an estimate of KL(policy || reference)), and its
    gradient is kl_coef * (1 - exp(r - l)) / N on every masked token: the penalty trains the policy."""
    logp, old, _, mask = _inputs(4)
    ref = logp - 0.7 * torch.rand(logp.shape, generator=torch.Generator().manual_seed(5)) + 0.2
    logp.requires_grad_(True)
    coef = 0.3
    loss, divisor, m = policy_loss(logp, old, torch.zeros(logp.shape[0]), mask, 0.2, ref_logp=ref, kl_coef=coef)
    d = ref - logp.detach()
    k3 = torch.exp(d) - d - 1
    torch.testing.assert_close(loss, coef * (k3 * mask).sum() / mask.sum())
    assert abs(m["grpo_kl"] - ((k3 * mask).sum() / mask.sum()).item()) < 1e-6
    loss.backward()
    torch.testing.assert_close(logp.grad, coef * (1 - torch.exp(d)) * mask / mask.sum())


def test_entropy_metric_is_the_mean_over_masked_tokens(world):
    logp, old, adv, mask = _inputs(6)
    ent = torch.rand(logp.shape, generator=torch.Generator().manual_seed(7)) * 3
    _, _, m = policy_loss(logp, old, adv, mask, 0.2, entropy=ent)
    assert abs(m["grpo_entropy"] - ((ent * mask).sum() / mask.sum()).item()) < 1e-6
    assert abs(m["grpo_entropy"] - ent.mean().item()) > 1e-3  # the unmasked mean is another number here


def test_value_loss_is_clipped_around_old_values(world):
    v_old = torch.zeros(2, 3)
    ret = torch.ones(2, 3)
    v = torch.full((2, 3), 0.5, requires_grad=True)
    mask = torch.ones(2, 3)
    loss, div, m = value_loss(v, v_old, ret, mask, clip_eps=0.2)
    # clipped prediction 0.2 is further from the return than 0.5: max picks (0.2 - 1)^2
    torch.testing.assert_close(loss, torch.tensor(0.5 * 0.8 ** 2))
    assert div.item() == 6 and m["value_clipfrac"] == 1.0


def reference_pg(ratio, adv, low, high, c):
    """verl's compute_policy_loss, written out: clip to [1 - low, 1 + high]; for A < 0 bound by -c * A."""
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
    clip1 = torch.maximum(pg1, pg2)
    if not c:
        return clip1
    return torch.where(adv < 0, torch.minimum(-adv * c, clip1), clip1)


@pytest.mark.parametrize("low, high, c", [(0.2, 0.0, 0.0), (0.2, 0.28, 0.0), (0.2, 0.0, 3.0), (0.2, 0.28, 3.0)])
def test_clip_higher_and_dual_clip_follow_the_formula(low, high, c):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + torch.randn(B, T, generator=g) * 1.5        # ratios from ~0.01 to ~90: every clip binds somewhere
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    loss, divisor, m = policy_loss(logp, old, adv, mask, clip_eps=low, clip_eps_high=high, dual_clip=c)
    ref = reference_pg(torch.exp(logp - old), adv, low, high or low, c)
    assert torch.allclose(loss, (ref * mask).sum() / mask.sum(), atol=1e-6)
    if c:  # the dual clip really binds on these ratios
        assert not torch.allclose(ref, reference_pg(torch.exp(logp - old), adv, low, high or low, 0.0))


def test_logprob_gap_is_the_mean_absolute_difference_over_the_masked_tokens():
    from minirl.objective import logprob_gap
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    engine = torch.tensor([[-1.5, -2.0, -1.0], [-0.25, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert logprob_gap(trainer, engine, mask).item() == (0.5 + 0.0 + 0.25 + 0.0) / 4
    assert logprob_gap(trainer, engine, torch.zeros_like(mask)).item() == 0.0
    one = torch.zeros_like(mask)
    one[0, 0] = 1.0
    assert logprob_gap(trainer, engine, one).item() == 0.5  # a chunk of one token: its own gap


def test_without_a_kl_coefficient_the_reference_changes_nothing_and_no_kl_is_reported():
    g = torch.Generator().manual_seed(0)
    logp, old, ref = (torch.randn(3, 5, generator=g) for _ in range(3))
    adv, mask = torch.randn(3, generator=g), torch.ones(3, 5)
    plain = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    with_ref = policy_loss(logp, old, adv, mask, clip_eps=0.2, ref_logp=ref, kl_coef=0.0)
    assert torch.equal(plain[0], with_ref[0]) and "grpo_kl" not in with_ref[2]
    by_default = policy_loss(logp, old, adv, mask, clip_eps=0.2, ref_logp=ref)  # kl_coef defaults to none
    assert torch.equal(plain[0], by_default[0]) and "grpo_kl" not in by_default[2]
    assert "grpo_kl" in policy_loss(logp, old, adv, mask, clip_eps=0.2, ref_logp=ref, kl_coef=0.1)[2]


def test_value_loss_is_clipped_on_both_sides_of_the_old_values(world):
    """A value that fell 0.5 below its old value with a return above: the clipped prediction is old - eps
    (0.8 here, not old + eps), which is nearer the return, so the unclipped term (larger) is the loss."""
    v_old, ret, mask = torch.ones(1, 2), torch.full((1, 2), 2.0), torch.ones(1, 2)
    v = torch.full((1, 2), 0.5, requires_grad=True)
    loss, _, m = value_loss(v, v_old, ret, mask, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * 1.5 ** 2))
    v = torch.full((1, 2), 0.5, requires_grad=True)
    far = value_loss(v, v_old, torch.full((1, 2), -1.0), mask, clip_eps=0.2)[0]  # return below: the clip is larger
    torch.testing.assert_close(far, torch.tensor(0.5 * 1.8 ** 2))
    assert m["value_clipfrac"] == 1.0


def _reference_metrics(logp, old, adv, mask, ref, ent, eps):
    """policy_loss's metrics by their definitions, token by token in float64."""
    toks = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    ratio = lambda b, t: math.exp(float(logp[b, t] - old[b, t]))  # noqa: E731
    clipped = [b_t for b_t in toks if ratio(*b_t) * float(adv[b_t[0]]) >
               min(max(ratio(*b_t), 1 - eps), 1 + eps) * float(adv[b_t[0]])]
    k3 = lambda b, t: math.exp(float(ref[b, t] - logp[b, t])) - float(ref[b, t] - logp[b, t]) - 1  # noqa: E731
    n = max(len(toks), 1)
    return {"clipfrac": len(clipped) / n, "ratio_max": max([ratio(*x) for x in toks], default=1.0),
            "kl": sum(k3(*x) for x in toks) / n, "entropy": sum(float(ent[x]) for x in toks) / n,
            "tokens": float(len(toks)), "n": float(mask.shape[0])}


@pytest.mark.parametrize("rows", ["a mixed batch", "one token", "no token"])
def test_every_reported_metric_is_its_definition(world, rows):
    """Each key policy_loss reports, against its definition computed token by token: the clip fraction
    (tokens whose clipped branch is the one taken), the largest ratio (1 with no token), the KL and
    entropy token means, the counts; and each loss mode's value on rows of one token and of none."""
    g = torch.Generator().manual_seed(5)
    B, T = 4, 6
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    mask = {"a mixed batch": torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0], [0] * 6, [1, 1, 1, 1, 1, 1]]),
            "one token": torch.tensor([[0, 0, 1, 0, 0, 0]] + [[0] * 6] * 3),
            "no token": torch.zeros(B, T)}[rows].double()
    old[0, 2] = logp[0, 2] - 0.5  # the one token's ratio is 1.65 with a positive advantage: it is clipped
    _, _, m = policy_loss(logp, old, adv, mask, clip_eps=0.2, ref_logp=ref, kl_coef=0.1, entropy=ent)
    want = _reference_metrics(logp, old, adv, mask, ref, ent, 0.2)
    for key, value in want.items():
        assert abs(float(m[f"grpo_{key}"]) - value) < 1e-12, (rows, key, float(m[f"grpo_{key}"]), value)
    per_seq = [(mask[b] > 0).nonzero().flatten().tolist() for b in range(B)]
    pg = lambda b, t: -min(_ratio(logp, old, b, t) * float(adv[b]),  # noqa: E731
                           min(max(_ratio(logp, old, b, t), 0.8), 1.2) * float(adv[b])) + 0.1 * (
        math.exp(float(ref[b, t] - logp[b, t])) - float(ref[b, t] - logp[b, t]) - 1)
    seqs = [b for b in range(B) if per_seq[b]]
    expected = {"token-mean": sum(pg(b, t) for b in seqs for t in per_seq[b]) / max(sum(map(len, per_seq)), 1),
                "seq-mean-token-mean": sum(sum(pg(b, t) for t in per_seq[b]) / len(per_seq[b]) for b in seqs)
                / max(len(seqs), 1),
                "seq-mean-token-sum": sum(pg(b, t) for b in seqs for t in per_seq[b]) / max(len(seqs), 1),
                "seq-mean-token-sum-norm": sum(pg(b, t) for b in seqs for t in per_seq[b]) / 7 / max(len(seqs), 1)}
    for agg, value in expected.items():
        loss, div, _ = policy_loss(logp, old, adv, mask, clip_eps=0.2, ref_logp=ref, kl_coef=0.1, agg=agg, norm_len=7)
        assert abs(loss.item() - value) < 1e-12, (rows, agg, loss.item(), value)
        assert div.item() == (sum(map(len, per_seq)) if agg == "token-mean" else len(seqs))


def _ratio(logp, old, b, t):
    return math.exp(float(logp[b, t] - old[b, t]))


@pytest.mark.parametrize("rows", ["a mixed batch", "one token", "no token"])
def test_the_value_loss_and_its_clip_fraction_are_their_definitions(world, rows):
    g = torch.Generator().manual_seed(6)
    v_old = torch.randn(3, 5, generator=g, dtype=torch.float64)
    v = v_old + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    ret = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = {"a mixed batch": torch.tensor([[1, 1, 1, 0, 0], [0, 1, 0, 0, 0], [1, 1, 1, 1, 1]]),
            "one token": torch.tensor([[0, 0, 0, 1, 0], [0] * 5, [0] * 5]), "no token": torch.zeros(3, 5)}[rows].double()
    v[0, 3] = v_old[0, 3] + 0.5  # the one token moved past the clip
    toks = [(b, t) for b in range(3) for t in range(5) if mask[b, t]]
    term = lambda b, t: 0.5 * max(float(v[b, t] - ret[b, t]) ** 2,  # noqa: E731
                                  (float(v_old[b, t]) + min(max(float(v[b, t] - v_old[b, t]), -0.2), 0.2)
                                   - float(ret[b, t])) ** 2)
    loss, div, m = value_loss(v, v_old, ret, mask, clip_eps=0.2)
    n = max(len(toks), 1)
    assert abs(loss.item() - sum(term(*x) for x in toks) / n) < 1e-12 and div.item() == len(toks)
    assert abs(float(m["value_clipfrac"]) - sum(abs(float(v[x] - v_old[x])) > 0.2 for x in toks) / n) < 1e-12
    assert m["value_tokens"].item() == len(toks) and m["value_n"] == 3.0
