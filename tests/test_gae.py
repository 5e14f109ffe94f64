"""gae.py against plain per-row reference loops on fresh random inputs."""

import torch

from minirl.gae import compute_gae, group_advantages, masked_whiten


def reference_gae(rewards, values, mask, gamma, lam):
    """One row at a time: drop the masked positions, run textbook GAE, scatter back."""
    adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t] > 0]
        last_adv, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last_adv = delta + gamma * lam * last_adv
            adv[b, t] = last_adv
            ret[b, t] = last_adv + values[b, t].item()
            next_v = values[b, t].item()
    return adv, ret


def random_mask(B, T, g):
    m = (torch.rand(B, T, generator=g) > 0.3).float()   # holes anywhere
    m[0] = 0.0                                            # an all-masked row
    m[1] = 1.0                                            # a full row
    return m


def test_gae_matches_reverse_loop_with_holes_and_empty_rows():
    g = torch.Generator().manual_seed(1)
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)]:
        B, T = 7, 13
        r, v = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
        m = random_mask(B, T, g)
        adv, ret = compute_gae(r, v, m, gamma, lam)
        radv, rret = reference_gae(r, v, m, gamma, lam)
        torch.testing.assert_close(adv, radv, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, rret, rtol=0, atol=1e-12)
        assert (adv[0] == 0).all() and (ret[0] == 0).all()


def test_gae_masked_values_and_rewards_never_leak():
    g = torch.Generator().manual_seed(2)
    B, T = 5, 9
    r, v, m = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g), random_mask(B, T, g)
    adv, ret = compute_gae(r, v, m, 0.99, 0.95)
    poisoned_v = torch.where(m.bool(), v, torch.full_like(v, float("nan")))
    poisoned_r = torch.where(m.bool(), r, torch.full_like(r, 1e6))
    adv2, ret2 = compute_gae(poisoned_r, poisoned_v, m, 0.99, 0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_masked_whiten_uses_valid_entries_only():
    g = torch.Generator().manual_seed(3)
    x, m = torch.randn(6, 10, generator=g, dtype=torch.float64), random_mask(6, 10, g)
    w = masked_whiten(x, m)
    vals = x[m.bool()]
    expected = (vals - vals.mean()) / (vals.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(w[m.bool()], expected)
    assert (w[~m.bool()] == 0).all()
    assert torch.equal(masked_whiten(x, torch.zeros_like(m)), torch.zeros_like(x))


def test_group_advantages_per_group_with_zero_std_guard():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    adv = group_advantages(r, 4, scale_by_std=True)
    for gi in range(3):
        grp = r[gi * 4:(gi + 1) * 4]
        std = grp.std()
        exp = (grp - grp.mean()) / std if std > 0 else torch.zeros(4)
        torch.testing.assert_close(adv[gi * 4:(gi + 1) * 4], exp)
    assert (adv[4:8] == 0).all() and torch.isfinite(adv).all()
    torch.testing.assert_close(group_advantages(r, 4, scale_by_std=False)[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]))


def test_whitening_of_one_or_two_valid_entries():
    """One valid entry has no spread: it is centred only, to 0. Two (5 and 9: centred to -2 and +2) are
    whitened to -1 and +1."""
    x = torch.tensor([[5.0, 9.0, 11.0]], dtype=torch.float64)
    one = masked_whiten(x, torch.tensor([[0.0, 1.0, 0.0]]))
    assert torch.equal(one, torch.zeros_like(x))
    two = masked_whiten(x, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(two, torch.tensor([[-1.0, 1.0, 0.0]], dtype=torch.float64))


def test_group_advantages_scale_by_std_by_default_at_any_group_size():
    """The GRPO paper's advantage, (r - mean) / std, unless told otherwise; a group of two is scaled as
    any other; a spread below eps counts as none (0, not a huge ratio of two tiny numbers)."""
    r = torch.tensor([1.0, 0.0, 3.0, 1.0])
    torch.testing.assert_close(group_advantages(r, 4), group_advantages(r, 4, scale_by_std=True))
    assert not torch.equal(group_advantages(r, 4), group_advantages(r, 4, scale_by_std=False))
    s = 2 ** -0.5  # the unbiased std of a pair {0, 1}
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0.0]), 2), torch.tensor([0.5 / s, -0.5 / s]))
    tiny = group_advantages(torch.tensor([1.0, 1.0 + 1e-7, 0.0, 1.0]), 2)
    assert torch.equal(tiny[:2], torch.zeros(2)) and tiny[2] < 0 < tiny[3]
