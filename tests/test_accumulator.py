"""accumulator.py: spec/batching.md "The hard part", "The poisoned-window countdown", "Metric roll-up".

Tolerance for chunked-vs-unchunked gradients in float32 on CPU: 5e-6 of the largest gradient (5e-8 on
gradients of order 1e-2, the spec's "~5e-8 on a real batch"); summing the chunks in another order moves
each gradient by a few float32 ulps of its size, a wrong normalization by more than 1e-2 of it.
"""

import copy
import math

import pytest
import torch

from conftest import RecordingSGD, toy_lm, toy_logprobs
from minirl.accumulator import Accumulator, roll_up
from minirl.objective import AGG_MODES, policy_loss

V = 11


def make_batch(seed, B=12, T=14):
    """A batch with very unequal completion lengths (so per-chunk token counts differ)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b in range(B):
        n = [1, 12, 3, 7, 2, 10][b % 6]
        mask[b, 1:1 + n] = 1.0
    adv = torch.randn(B, generator=g)
    old = -2.4 + 0.2 * torch.randn(B, T, generator=g)
    return ids, mask, adv, old


def loss_of(model, ids, mask, adv, old, agg="token-mean"):
    return policy_loss(toy_logprobs(model, ids), old, adv, mask, clip_eps=0.2, agg=agg, norm_len=14)


def run_window(model, batch, n_micro, max_norm=0.0, lr=0.1, poison_at=None, agg="token-mean"):
    ids, mask, adv, old = batch
    opt = RecordingSGD(model.parameters(), lr=lr)
    acc = Accumulator(model, opt, n_micro, max_norm)
    size = ids.shape[0] // n_micro
    calls = []
    for k in range(n_micro):
        s = slice(k * size, (k + 1) * size)
        loss, div, m = loss_of(model, ids[s], mask[s], adv[s], old[s], agg)
        if poison_at == k:
            loss = loss * float("nan")
        calls.append(m)
        acc.backward(loss, div)
    return opt, acc, calls


def test_single_chunk_is_the_plain_path_bit_for_bit(world):
    batch = make_batch(0)
    a, b = toy_lm(V), toy_lm(V)
    opt_a, _, _ = run_window(a, batch, n_micro=1, max_norm=0.5)
    # the plain path: forward, backward, clip, step
    opt_b = RecordingSGD(b.parameters(), lr=0.1)
    loss, _, _ = loss_of(b, *batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    opt_b.step()
    for ga, gb in zip(opt_a.seen, opt_b.seen):
        assert torch.equal(ga, gb)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_deferred_normalization_matches_unchunked_on_unequal_chunks(world, agg):
    """Every --rl.loss-agg-mode: the micro-batched step is the whole-batch step."""
    batch = make_batch(1)
    whole, chunked = toy_lm(V), toy_lm(V)
    opt_w, _, _ = run_window(whole, batch, n_micro=1, agg=agg)
    for n_micro in (2, 3, 4, 6):
        model = copy.deepcopy(chunked)
        opt_c, acc, _ = run_window(model, batch, n_micro=n_micro, agg=agg)
        assert acc.steps == 1
        scale = max(g.abs().max().item() for g in opt_w.seen)  # ~1e-2 under a mean, ~0.3 under a token sum
        for gw, gc in zip(opt_w.seen, opt_c.seen):
            assert (gw - gc).abs().max().item() < 5e-6 * scale, n_micro


def test_mean_of_means_would_be_wrong_on_these_chunks(world):
    """Guard the test above: averaging per-chunk normalized losses gives a different gradient."""
    ids, mask, adv, old = make_batch(1)
    m1, m2 = toy_lm(V), toy_lm(V)
    loss, _, _ = loss_of(m1, ids, mask, adv, old)
    loss.backward()
    l_a, _, _ = loss_of(m2, ids[:4], mask[:4], adv[:4], old[:4])
    l_b, _, _ = loss_of(m2, ids[4:], mask[4:], adv[4:], old[4:])
    ((l_a + l_b) / 2).backward()
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(m1.parameters(), m2.parameters()))
    assert diff > 1e-4


def test_scale_then_clip_then_step(world):
    batch = make_batch(2)
    max_norm = 1e-3  # binds: the normalized gradient norm is far above it
    ref = toy_lm(V)
    opt_ref, _, _ = run_window(ref, batch, n_micro=1, max_norm=max_norm)
    model = toy_lm(V)
    opt, _, _ = run_window(model, batch, n_micro=3, max_norm=max_norm)
    for a, b in zip(opt_ref.seen, opt.seen):
        assert (a - b).abs().max().item() < 1e-9
    # the wrong order: clip the un-normalized sum, then scale
    wrong = toy_lm(V)
    ids, mask, adv, old = batch
    total = 0.0
    for k in range(3):
        s = slice(4 * k, 4 * k + 4)
        loss, div, _ = loss_of(wrong, ids[s], mask[s], adv[s], old[s])
        (loss * div).backward()
        total += div.item()
    torch.nn.utils.clip_grad_norm_(wrong.parameters(), max_norm)
    wrong_grads = [p.grad / total for p in wrong.parameters()]
    diff = max((a - b).abs().max().item() for a, b in zip(opt.seen, wrong_grads))
    norm_right = torch.sqrt(sum((g ** 2).sum() for g in opt.seen)).item()
    assert abs(norm_right - max_norm) < 1e-6
    assert diff > 0.5 * max_norm / 10  # measurably different update


def test_all_empty_window_gives_zero_gradient_not_nan(world):
    ids, mask, adv, old = make_batch(3)
    model = toy_lm(V)
    before = [p.detach().clone() for p in model.parameters()]
    opt, acc, calls = run_window(model, (ids, torch.zeros_like(mask), adv, old), n_micro=3)
    assert acc.steps == 1 and acc.skipped == 0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in opt.seen)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert roll_up(calls)["grpo_denom"] == 0


def test_poisoned_window_abandons_its_whole_minibatch(world):
    """A NaN in mini-batch 0 at call k: mini 0's window is dropped whole when it closes (the calls
    after k run and are dropped with it: the flag is read once per window, not per call), and the
    only optimizer step of the two mini-batches equals mini-batch 1 stepped alone."""
    batch0, batch1 = make_batch(4), make_batch(5)
    n_micro = 4
    clean = toy_lm(V)
    opt_clean, _, _ = run_window(clean, batch1, n_micro)
    for k in range(n_micro):
        model = toy_lm(V)
        opt = RecordingSGD(model.parameters(), lr=0.1)
        acc = Accumulator(model, opt, n_micro, 0.0)
        executed = 0
        outs = []
        for mini, (ids, mask, adv, old) in enumerate((batch0, batch1)):
            for micro in range(n_micro):
                executed += 1
                s = slice(3 * micro, 3 * micro + 3)
                loss, div, _ = loss_of(model, ids[s], mask[s], adv[s], old[s])
                if mini == 0 and micro == k:
                    loss = loss * float("nan")
                outs.append(acc.backward(loss, div))
        assert executed == 2 * n_micro, k            # the windows keep their length: nothing misaligns
        assert outs[n_micro - 1] == {"skipped_nonfinite": 1.0} and "grad_norm" in outs[-1], (k, outs)
        assert acc.steps == 1 and acc.skipped == 1 and acc.calls == 0
        for a, b in zip(opt.seen, opt_clean.seen):
            assert torch.equal(a, b), k
        for a, b in zip(model.parameters(), clean.parameters()):
            assert torch.equal(a, b), k


def test_rollup_is_token_weighted_and_counts_sum(world):
    ids, mask, adv, old = make_batch(6)
    model = toy_lm(V)
    whole_loss, whole_div, whole_m = loss_of(model, ids, mask, adv, old)
    calls = [loss_of(model, ids[s], mask[s], adv[s], old[s])[2] for s in (slice(0, 2), slice(2, 5), slice(5, 12))]
    r = roll_up(calls)
    assert abs(r["grpo_loss"] - whole_loss.item()) < 1e-6
    assert abs(r["grpo_clipfrac"] - whole_m["grpo_clipfrac"]) < 1e-6
    assert r["grpo_denom"] == whole_div.item() and r["grpo_n"] == 12 and r["grpo_tokens"] == mask.sum().item()
    plain_mean = sum(c["grpo_loss"] for c in calls) / len(calls)
    assert abs(plain_mean - whole_loss.item()) > 1e-3  # a plain mean is visibly wrong here


def test_a_run_whose_updates_stay_non_finite_stops_after_the_limit():
    from minirl.accumulator import Stall, StalledError
    stall = Stall(3, "a learning rate too high (--rl.lr=1)")
    for step, stepped in enumerate([True, False, False, True, False, False]):
        stall.step(stepped, step)  # never three in a row
    with pytest.raises(StalledError, match=r"step 6: 3 steps in a row \(4-6\) took no optimizer step.*--rl\.lr=1"):
        stall.step(False, 6)


def test_lr_schedule_warms_up_then_holds_or_follows_a_cosine():
    from minirl.accumulator import lr_schedule
    const = lr_schedule(1.0, warmup=4, total=20)
    assert [const(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = lr_schedule(1.0, warmup=1, total=13, kind="cosine", min_ratio=0.1)
    assert cos(0) == 1.0 and abs(cos(1) - 1.0) < 1e-12 and abs(cos(13) - 0.1) < 1e-12 and cos(20) == cos(13)
    assert abs(cos(7) - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))) < 1e-12  # half way: 0.55
    to_zero = lr_schedule(1.0, warmup=0, total=10, kind="cosine")  # HF's: the floor comes after the last step
    assert to_zero(9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.9))) and to_zero(9) > 0.02
    model = toy_lm()
    opt = torch.optim.SGD(model.parameters(), lr=123.0)
    acc = Accumulator(model, opt, 1, schedule=const)
    seen = []
    for _ in range(5):
        loss = toy_logprobs(model, torch.randint(0, 11, (2, 5))).sum() * 0.0
        acc.backward(loss, 1.0)
        seen.append(opt.param_groups[0]["lr"])
    assert seen == [0.25, 0.5, 0.75, 1.0, 1.0]  # set before each step, from the step count


def test_a_poisoned_window_leaves_no_fsdp_root_parameter_gathered(tiny_path, world):
    """A non-finite loss is backpropagated like any other (FSDP2's backward reshards the root its
    forward gathered), and the window that holds it is dropped when it closes, leaving no gradient."""
    from torch.distributed.tensor import DTensor

    from minirl import models
    policy = models.sharded(tiny_path, "policy", world, "float32")
    acc = Accumulator(policy, RecordingSGD(policy.parameters(), lr=0.1), n_micro=2)
    logp = models.token_logprobs(policy, torch.randint(3, 40, (2, 8)))
    assert acc.backward(logp.sum() * float("nan"), 1.0) is None  # the window is open until its last call
    assert [n for n, p in policy.named_parameters() if not isinstance(p, DTensor)] == []
    logp = models.token_logprobs(policy, torch.randint(3, 40, (2, 8)))
    assert acc.backward(logp.sum(), 1.0) == {"skipped_nonfinite": 1.0}
    assert [n for n, p in policy.named_parameters() if not isinstance(p, DTensor)] == []
    assert all(p.grad is None for p in policy.parameters()) and acc.steps == 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_every_rolled_up_metric_of_a_family_is_the_whole_batchs_value(world, agg):
    """B13 for the whole family, not only the loss: chunks of very unequal token counts, rolled up, give
    the whole batch's loss (weighted by the divisor), its per-token rates (clip fraction, KL, entropy:
    weighted by tokens, which under a seq-mean mode is not the divisor), its counts (summed) and max."""
    from minirl.objective import policy_loss
    g = torch.Generator().manual_seed(3)
    ids, mask, adv, old = make_batch(6)
    logp, ref, ent = (old + 0.3 * torch.randn(old.shape, generator=g) for _ in range(3))
    def metrics(s):
        return policy_loss(logp[s], old[s], adv[s], mask[s], clip_eps=0.2, ref_logp=ref[s], kl_coef=0.1,
                           entropy=ent[s].abs(), agg=agg, norm_len=14)[2]
    whole = metrics(slice(0, 12))
    calls = [metrics(s) for s in (slice(0, 2), slice(2, 5), slice(5, 12))]
    rolled = roll_up(calls)
    assert set(rolled) == set(whole) and {"grpo_kl", "grpo_entropy", "grpo_clipfrac"} <= set(whole)
    for k, v in whole.items():
        assert abs(rolled[k] - float(v)) < 1e-6 * max(1.0, abs(float(v))), (agg, k, rolled[k], float(v))


def test_each_optimizer_step_runs_at_its_scheduled_rate_and_a_skipped_window_takes_none(world):
    """S8: the rate the optimizer reads inside `step()`, not the one left after it: a warmup schedule by
    optimizer step, each step at lr(k); a poisoned window takes no step and no rate, so the next step
    is still step k, at lr(k)."""
    from minirl.accumulator import lr_schedule

    class Seen(torch.optim.SGD):
        def step(self, closure=None):
            self.rates.append(self.param_groups[0]["lr"])
            return super().step(closure)

    model = toy_lm(V)
    opt = Seen(model.parameters(), lr=99.0)
    opt.rates = []
    schedule = lr_schedule(0.1, warmup=4, total=10)
    acc = Accumulator(model, opt, n_micro=2, schedule=schedule)
    ids, mask, adv, old = make_batch(1)
    for window in range(4):
        for half in (slice(0, 6), slice(6, 12)):
            loss, div, _ = loss_of(model, ids[half], mask[half], adv[half], old[half])
            if window == 1 and half.start == 6:
                loss = loss * float("nan")  # the second window is poisoned
            acc.backward(loss, div)
    assert opt.rates == [schedule(0), schedule(1), schedule(2)] and acc.steps == 3 and acc.skipped == 1
    assert len(set(opt.rates)) == 3  # warmup: the three rates differ, so a rate read late would show


def test_a_window_whose_loss_is_finite_but_whose_gradient_is_not_takes_no_step(world):
    """B12's other half: sqrt(|w|) at w = 0 is a finite loss with a non-finite gradient; the window is
    dropped (the parameters untouched, the skip counted with the norm), as a non-finite loss's is."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.0, 1.0]]))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), n_micro=1)
    out = acc.backward(model.weight.abs().sqrt().sum(), 1.0)
    assert out["skipped_nonfinite"] == 1.0 and not math.isfinite(out["grad_norm"]) and len(out) == 2
    assert acc.steps == 0 and acc.skipped == 1
    assert torch.equal(model.weight, torch.tensor([[0.0, 1.0]]))


def test_the_default_window_does_not_clip_and_times_only_its_steps(world):
    """No --rl.max-grad-norm, no clip: a gradient of norm 50 steps whole. The profile's timer counts the
    optimizer steps taken after it was made, in seconds of this process."""
    import time
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), n_micro=1)
    acc.backward((50.0 * model.weight).sum(), 1.0)  # d/dw = 50
    assert model.weight.item() == 1.0 - 50.0
    timer, t0 = acc.timer(), time.perf_counter()
    assert timer() == {"optimizer_s": 0.0}
    acc.backward((model.weight * 1.0).sum(), 1.0)
    assert 0.0 < timer()["optimizer_s"] <= time.perf_counter() - t0


def test_a_run_that_starts_without_an_update_stops_at_the_limit_not_before():
    from minirl.accumulator import Stall, StalledError
    stall = Stall(3, "x")
    stall.step(False, 0)
    stall.step(False, 1)
    with pytest.raises(StalledError, match=r"step 2: 3 steps in a row \(0-2\)"):
        stall.step(False, 2)


def test_across_ranks_in_a_world_of_one_keeps_every_value(world):
    from minirl.accumulator import across_ranks
    metrics = {"grpo_loss": 0.25, "grpo_denom": 7.0, "grpo_tokens": 7.0, "grpo_ratio_max": 1.5,
               "skipped_nonfinite": 1.0, "entropy": 2.0}
    assert across_ranks(metrics) == metrics and across_ranks({}) == {}


@pytest.mark.parametrize("as_tensor", [True, False])
def test_a_window_of_one_token_in_all_is_divided_by_one(world, as_tensor):
    """B8's max(sum, 1) only floors an empty window: a window whose chunks hold one token in all steps
    exactly as that token's single call would (divided by 1, not by the floor)."""
    def weights_after(n_micro):
        model = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(0.5)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), n_micro=n_micro)
        x = torch.tensor([[1.0, 2.0]])
        for k in range(n_micro):
            tokens = 1.0 if k == 0 else 0.0
            divisor = torch.tensor(tokens) if as_tensor else tokens
            acc.backward(model(x).sum() * tokens / max(tokens, 1.0), divisor)
        return model.weight.detach().clone()
    assert torch.equal(weights_after(2), weights_after(1))


def test_a_family_weighted_by_a_fractional_divisor_is_still_its_weighted_mean():
    """A divisor is a DP mean, so it can be below 1 (one token on one of two ranks: 0.5); an empty call
    (divisor 0) adds nothing to the roll-up, however small the other calls' weight."""
    rolled = roll_up([{"grpo_loss": 0.8, "grpo_denom": 0.5}, {"grpo_loss": 0.0, "grpo_denom": 0.0}])
    assert rolled["grpo_loss"] == pytest.approx(0.8) and rolled["grpo_denom"] == 0.5
