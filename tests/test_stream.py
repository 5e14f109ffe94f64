"""stream.py: the streamed PPO update lifecycle on the real tiny model (S5-S10, S12, S14, S15, S19, S22)."""

import copy

import pytest
import torch

from conftest import RecordingSGD, assert_same_grads
from minirl.accumulator import Accumulator
from minirl.models import load_policy, load_value
from minirl.stream import PumpConfig, TrainPump


def make_chunk(seed, rows, lengths, masked=False):
    g = torch.Generator().manual_seed(seed)
    T = 3 + max(lengths)
    ids = torch.randint(3, 40, (rows, T), generator=g)
    mask = torch.zeros(rows, T)
    rewards = torch.zeros(rows, T)
    for i in range(rows):
        n = lengths[i % len(lengths)]
        if not masked:
            mask[i, 3:3 + n] = 1.0
        rewards[i, 3 + n - 1] = float(torch.randint(0, 2, (1,), generator=g))
    return {"input_ids": ids, "mask": mask, "rewards": rewards, "groups": rows // 2}


def merged(chunks):
    T = max(c["input_ids"].shape[1] for c in chunks)
    pad = lambda t: torch.nn.functional.pad(t, (0, T - t.shape[1]))  # noqa: E731
    return {k: torch.cat([pad(c[k]) for c in chunks]) for k in ("input_ids", "mask", "rewards")}


@pytest.fixture(scope="module")
def models(tiny_path):
    return load_policy(tiny_path), load_value(tiny_path)


def pump(models, cfg, refit=None, log=None, skipped=0):
    policy, value = copy.deepcopy(models[0]), copy.deepcopy(models[1])
    with torch.no_grad():  # a critic that predicts something, so GAE and clipping are not trivial
        value.score.weight.copy_(0.1 * torch.randn(value.score.weight.shape, generator=torch.Generator().manual_seed(0)))
    acc = Accumulator(policy, RecordingSGD(policy.parameters(), lr=0.1), n_micro=None)
    acc.skipped = skipped  # windows skipped in the run's earlier steps
    lines = [] if log is None else log
    return TrainPump(policy, value, acc, RecordingSGD(value.parameters(), lr=0.1), cfg, step=3, refit=refit,
                     log=lines.append)


CHUNKS = [(1, 4, [1, 7]), (2, 6, [3, 2, 9]), (3, 2, [5])]


def run(models, chunks, **cfg):
    p = pump(models, PumpConfig(**cfg))
    for c in chunks:
        p.chunk(c)
    return p, p.close()


def test_streamed_policy_gradient_equals_full_batch_without_normalization(models, world):
    chunks = [make_chunk(*c) for c in CHUNKS]
    streamed, ms = run(models, chunks, normalize_advantages=False)
    full, mf = run(models, [merged(chunks)], normalize_advantages=False)
    g_s, g_f = streamed.policy_acc.optimizer.seen, full.policy_acc.optimizer.seen
    assert_same_grads(g_s, g_f)
    assert ms["ppo_chunks"] == 3 and mf["ppo_chunks"] == 1


def test_per_chunk_normalization_changes_the_policy_gradient_but_not_critic_returns(models, world):
    chunks = [make_chunk(*c) for c in CHUNKS]
    on, _ = run(models, chunks, normalize_advantages=True)
    full, _ = run(models, [merged(chunks)], normalize_advantages=True)
    diff = max((a - b).abs().max().item() for a, b in zip(on.policy_acc.optimizer.seen, full.policy_acc.optimizer.seen))
    assert diff > 1e-6
    off, _ = run(models, chunks, normalize_advantages=False)
    assert all(torch.equal(a["returns"], b["returns"]) for a, b in zip(on.chunks, off.chunks))


def test_both_modes_train_the_critic_on_every_sample_each_epoch(models, world):
    chunks = [make_chunk(*c) for c in CHUNKS]
    for batch in (chunks, [merged(chunks)]):
        _, m = run(models, batch, critic_ppo_epochs=3, critic_micro_rows=5)
        assert m["value_epoch_n"] == 12


def test_order_of_work_per_chunk_and_at_close(models, world):
    refits = []
    p = pump(models, PumpConfig(critic_ppo_epochs=2), refit=lambda: refits.append(p.events[-1]))
    for c in CHUNKS[:2]:
        p.chunk(make_chunk(*c))
    p.close()
    per_chunk = ["value.forward", "policy.ready", "policy.forward", "policy.backward", "value.ready"]
    assert p.events == ["value.ready", *per_chunk, *per_chunk,
                        "policy.ready", "policy.step", "refit", "value.ready", "critic.epoch", "critic.epoch"]
    assert p.policy_acc.steps == 1 and refits == ["refit"]


def test_policy_gradients_stay_resident_while_its_parameters_are_offloaded(models, world):
    p = pump(models, PumpConfig())
    p.chunk(make_chunk(*CHUNKS[0]))
    assert all(q.untyped_storage().nbytes() == 0 for q in p.policy.parameters())
    assert any(q.grad is not None and q.grad.untyped_storage().nbytes() > 0 for q in p.policy.parameters())
    assert all(q.untyped_storage().nbytes() > 0 for q in p.value.parameters())  # value model ready (S12)
    p.close()


def test_old_values_come_from_the_unchanged_critic_and_stay_frozen(models, world):
    chunks = [make_chunk(*c) for c in CHUNKS]
    p = pump(models, PumpConfig(critic_ppo_epochs=3))
    critic_before = copy.deepcopy(p.value)
    p.policy_off.onload()
    for c in chunks:
        p.chunk(c)
    p.close()
    with torch.no_grad():
        for c in p.chunks:
            assert torch.equal(c["old_values"], critic_before(c["input_ids"]) * c["mask"])
    assert any((a - b).abs().max() > 0 for a, b in zip(critic_before.parameters(), p.value.parameters()))


def test_later_critic_epochs_clip_around_the_old_values_of_the_first(models, world):
    """S6 seen from the loss: old values are taken once, before any critic update. Over one epoch no
    value has moved from its old value (clip fraction 0); over two, the second epoch's values have
    moved from those same old values past a small clip range (clip fraction > 0). Old values taken
    afresh each epoch would read 0 in both."""
    fracs = []
    for epochs in (1, 2):
        _, out = run(models, [make_chunk(*c) for c in CHUNKS], critic_ppo_epochs=epochs, value_clip_eps=1e-4)
        fracs.append(out["value_clipfrac"])
    assert fracs[0] == 0.0 and fracs[1] > 0.0, fracs


def test_critic_warmup_skips_policy_backward_step_and_refit(models, world):
    refits = []
    p = pump(models, PumpConfig(critic_warmup=True), refit=lambda: refits.append(1))
    before = [q.detach().clone() for q in models[0].parameters()]
    p.chunk(make_chunk(*CHUNKS[0]))
    p.close()
    p.policy_off.onload()
    assert "policy.backward" not in p.events and "policy.step" not in p.events and not refits
    assert all(torch.equal(a, b) for a, b in zip(before, p.policy.parameters()))


def test_masked_chunk_adds_no_gradient_and_a_fully_masked_step_fails_first(models, world):
    a, _ = run(models, [make_chunk(*CHUNKS[0])], normalize_advantages=False)
    b, _ = run(models, [make_chunk(*CHUNKS[0]), make_chunk(9, 4, [3], masked=True)], normalize_advantages=False)
    assert all(torch.equal(x, y) for x, y in zip(a.policy_acc.optimizer.seen, b.policy_acc.optimizer.seen))
    p = pump(models, PumpConfig())
    p.chunk(make_chunk(9, 4, [3], masked=True))
    value_before = [q.detach().clone() for q in p.value.parameters()]
    with pytest.raises(RuntimeError, match="masked"):
        p.close()
    assert p.policy_acc.steps == 0
    assert all(torch.equal(x, y) for x, y in zip(value_before, p.value.parameters()))


def test_train_pump_logs_show_the_chunking(models, world):
    lines = []
    p = pump(models, PumpConfig(), log=lines)
    for c in CHUNKS:
        p.chunk(make_chunk(*c))
    p.close()
    assert lines[:3] == ["train_pump: step 3 chunk 0 groups=2 rows=4 tokens=16",
                         "train_pump: step 3 chunk 1 groups=3 rows=6 tokens=28",
                         "train_pump: step 3 chunk 2 groups=1 rows=2 tokens=10"]
    assert lines[-1] == "train_pump: step 3 closing on 3 chunk(s)"


def test_consecutive_steps_share_the_offload_state(models, world):
    """A run hands the same offloaders to every step's pump: what step 1 offloaded, step 2 can restore."""
    p1 = pump(models, PumpConfig())
    p1.chunk(make_chunk(*CHUNKS[0]))
    p1.close()
    p2 = TrainPump(p1.policy, p1.value, Accumulator(p1.policy, p1.policy_acc.optimizer, n_micro=None), p1.value_opt,
                   PumpConfig(), step=4, log=lambda _: None, policy_off=p1.policy_off, value_off=p1.value_off)
    p2.chunk(make_chunk(*CHUNKS[1]))
    out = p2.close()
    assert p2.policy_acc.steps == 1 and out["grad_norm"] > 0


def test_value_of_a_token_never_sees_that_token(models, world):
    """Column t is V(prefix before token t): changing token t leaves columns <= t alone."""
    value = copy.deepcopy(models[1])
    with torch.no_grad():
        value.score.weight.copy_(torch.randn(value.score.weight.shape, generator=torch.Generator().manual_seed(1)))
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        other = ids.clone()
        other[0, 3] = 20
        a, b = value(ids), value(other)
    assert torch.equal(a[:, :4], b[:, :4]) and not torch.equal(a[:, 4:], b[:, 4:])
    assert a[0, 0] == 0


def test_full_batch_policy_epochs_reuse_the_frozen_pi_old_and_advantages(models, world):
    """ppo_epochs=2 (full batch): one step per epoch; epoch 2 scores the stepped policy against the
    pi_old and advantages frozen at the chunk, then refit, then the critic (S1, S13)."""
    from minirl.models import token_logprobs
    from minirl.objective import policy_loss

    c = merged([make_chunk(*x) for x in CHUNKS])
    one, _ = run(models, [c], ppo_epochs=1)
    two, _ = run(models, [c], ppo_epochs=2)
    assert two.policy_acc.steps == 2
    assert two.events[-6:] == ["policy.ready", "policy.step", "policy.backward", "policy.step", "value.ready",
                               "critic.epoch"]
    one.policy_off.onload()  # the policy after epoch 1, as epoch 2 of `two` saw it
    frozen = one.chunks[0]
    check = Accumulator(one.policy, RecordingSGD(one.policy.parameters(), lr=0.1), n_micro=None)
    loss, divisor, _ = policy_loss(token_logprobs(one.policy, c["input_ids"]), frozen["old_logp"], frozen["adv"],
                                   c["mask"], 0.2, prefix="ppo")
    check.backward(loss, divisor)
    check.finish()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(check.optimizer.seen, two.policy_acc.optimizer.seen))


def test_full_batch_policy_epochs_all_carry_the_entropy_bonus(models, world):
    """--ppo.entropy-coef with ppo_epochs=2: epoch 2's loss has the entropy bonus, with its gradient, as
    epoch 1's has (epoch 2 once scored the policy without its entropy and failed on the bonus)."""
    from minirl.models import token_logprobs
    from minirl.objective import policy_loss

    c = merged([make_chunk(*x) for x in CHUNKS])
    bonus = {"entropy_coef": 0.5}
    one, _ = run(models, [c], ppo_epochs=1, loss=bonus)
    two, out = run(models, [c], ppo_epochs=2, loss=bonus)
    assert two.policy_acc.steps == 2 and "ppo_entropy" in out
    one.policy_off.onload()  # the policy after epoch 1, as epoch 2 of `two` saw it
    frozen = one.chunks[0]
    logp, entropy = token_logprobs(one.policy, c["input_ids"], entropy="grad")
    check = Accumulator(one.policy, RecordingSGD(one.policy.parameters(), lr=0.0), n_micro=None)  # records only
    loss, divisor, _ = policy_loss(logp, frozen["old_logp"], frozen["adv"], c["mask"], 0.2, prefix="ppo",
                                   entropy=entropy, entropy_coef=0.5)
    check.backward(loss, divisor)
    check.finish()
    assert_same_grads(two.policy_acc.optimizer.seen, check.optimizer.seen)
    without = Accumulator(one.policy, RecordingSGD(one.policy.parameters(), lr=0.0), n_micro=None)
    loss, divisor, _ = policy_loss(token_logprobs(one.policy, c["input_ids"]), frozen["old_logp"], frozen["adv"],
                                   c["mask"], 0.2, prefix="ppo")
    without.backward(loss, divisor)
    without.finish()  # the bonus moves the gradient: the check above is not blind to it
    assert max((a - b).abs().max().item() for a, b in zip(without.optimizer.seen, check.optimizer.seen)) > 1e-4


def test_colocated_full_batch_refits_after_critic_training(models, world):
    refits = []
    p = pump(models, PumpConfig(critic_ppo_epochs=2, refit_after_critic=True), refit=lambda: refits.append(1))
    p.chunk(make_chunk(*CHUNKS[0]))
    p.close()
    assert p.events[-4:] == ["value.ready", "critic.epoch", "critic.epoch", "refit"] and refits == [1]


def test_pump_moves_every_chunk_to_the_trainers_device(tiny_path, world, monkeypatch):
    """Policy and critic on `meta` (a card's stand-in), chunks arriving on the host: value forward,
    policy forward, GAE, whitening, backward, the step and the critic epochs never mix devices."""
    from conftest import OneDevice
    meta = torch.device("meta")
    policy, value = load_policy(tiny_path).to(meta), load_value(tiny_path).to(meta)
    acc = Accumulator(policy, torch.optim.SGD(policy.parameters(), lr=0.1), n_micro=None, max_grad_norm=1.0)
    with OneDevice(monkeypatch):
        p = TrainPump(policy, value, acc, torch.optim.SGD(value.parameters(), lr=0.1),
                      PumpConfig(offload=False, critic_micro_rows=3, critic_ppo_epochs=2), step=0,
                      log=lambda _: None, device=meta)
        for c in CHUNKS:
            chunk = make_chunk(*c)
            p.chunk({**chunk, "rollout_logp": -torch.ones_like(chunk["mask"])})
        out = p.close()
    assert p.policy_acc.steps == 1 and out["value_epoch_n"] == 12
    assert all(c["returns"].device == meta for c in p.chunks)


def test_pi_old_is_the_trainers_own_logprob_unless_the_engines_is_asked_for(models, world):
    """On GPUs the engine's bf16 logprobs differ from the trainer's: by default the ratio starts at
    exactly 1 against the trainer's own pi_old, and `ppo_logprob_gap` shows the engine's drift."""
    chunk = make_chunk(*CHUNKS[0])
    chunk["rollout_logp"] = (torch.full_like(chunk["mask"], -1.0)) * chunk["mask"]
    p, m = run(models, [chunk])
    assert m["ppo_ratio_max"] == 1.0 and m["ppo_logprob_gap"] > 0.1
    assert not torch.equal(p.chunks[0]["old_logp"], chunk["rollout_logp"])
    q, m = run(models, [chunk], use_rollout_logprobs=True)
    assert torch.equal(q.chunks[0]["old_logp"], chunk["rollout_logp"]) and m["ppo_ratio_max"] != 1.0


def test_critic_micro_batches_equal_the_whole_batch_step(models, world):
    """--ppo.critic-micro-batch-rows: the critic's step is the same at any micro-batch size (the
    deferred divisor), on rows of unequal lengths."""
    chunks = [make_chunk(*c) for c in CHUNKS]
    whole, _ = run(models, chunks, critic_micro_rows=0)
    split, _ = run(models, chunks, critic_micro_rows=5)
    g_w, g_s = whole.value_opt.seen, split.value_opt.seen
    assert_same_grads(g_s, g_w)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_policy_micro_batches_equal_the_whole_chunk_step(models, world, agg):
    """--ppo.policy-micro-batch-rows: each chunk's policy forward/backward in micro-batches (a ragged
    last one included) gives the same step, and the same frozen pi_old, as whole chunks, under each
    --ppo.loss-agg-mode."""
    chunks = [make_chunk(*c) for c in CHUNKS]
    whole, _ = run(models, chunks, normalize_advantages=False, loss={"agg": agg, "norm_len": 8})
    split, _ = run(models, chunks, normalize_advantages=False, policy_micro_rows=3, loss={"agg": agg, "norm_len": 8})
    assert split.events.count("policy.backward") == 2 + 2 + 1
    g_w, g_s = whole.policy_acc.optimizer.seen, split.policy_acc.optimizer.seen
    assert_same_grads(g_s, g_w)
    assert all(torch.allclose(a["old_logp"], b["old_logp"], atol=1e-6) for a, b in zip(whole.chunks, split.chunks))


def test_later_policy_epochs_take_the_same_micro_batches_as_the_first(models, world):
    """Full batch, --ppo.ppo-epochs 2, --ppo.policy-micro-batch-rows 2 on a 4-row chunk: two backwards an
    epoch, and each epoch's step as with the whole chunk at once. In float64: the second epoch starts from
    weights the first epoch's step moved, and in float32 that step's rounding, which the machine's thread
    count changes, parted the second epoch's gradients by 2.4e-6 of the largest on 16 cores."""
    wide = tuple(copy.deepcopy(m).double() for m in models)
    c = make_chunk(*CHUNKS[0])  # 4 rows, 10 columns
    c.update(mask=c["mask"].double(), rewards=c["rewards"].double())
    whole, _ = run(wide, [c], ppo_epochs=2, normalize_advantages=False)
    split, _ = run(wide, [c], ppo_epochs=2, normalize_advantages=False, policy_micro_rows=2)
    assert split.events.count("policy.backward") == 2 * 2 and split.policy_acc.steps == 2
    g_w, g_s = whole.policy_acc.optimizer.seen, split.policy_acc.optimizer.seen  # the second epoch's gradients
    assert g_s[-1].dtype == torch.float64
    assert_same_grads(g_s, g_w, tol=1e-10)


@pytest.mark.dist
def test_two_train_ranks_whiten_over_both_shards_and_agree_on_masked_steps(tiny_path):
    from conftest import torchrun
    p = torchrun("tests/dist/pump_two_ranks.py", tiny_path)
    assert p.returncode == 0
    assert p.stdout.count("whitening over both shards OK") == 2 and p.stdout.count("masked shares OK") == 2


def test_a_non_finite_first_epoch_runs_no_later_epoch(models, world):
    """Full batch, ppo_epochs=2, a NaN reward: the first epoch's window is dropped (B12), and the second
    epoch never runs on it; the step goes on to the refit and the critic."""
    c = merged([make_chunk(*x) for x in CHUNKS])
    c["rewards"][0] = float("nan")
    p, out = run(models, [c], ppo_epochs=2)
    assert p.policy_acc.steps == 0 and out["skipped_nonfinite"] == 1.0
    assert p.events.count("policy.backward") == 1 and p.events.count("policy.step") == 1
    assert p.events[-2:] == ["value.ready", "critic.epoch"]


@pytest.mark.parametrize("bad_at", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_non_finite_chunk_abandons_the_step_and_leaves_no_gradient_behind(models, world, bad_at):
    """A NaN reward in one of three chunks (the first, the middle or the last, so earlier chunks'
    gradients are already accumulated): no policy step (B12: the open window is dropped when the step
    closes; the later chunks run into it and are dropped with it), the skip in the step's metrics once,
    no gradient left, the critic's skip reported too; and the next step's gradient is exactly what a
    clean step from the same weights gives."""
    chunks = [make_chunk(*c) for c in CHUNKS]
    chunks[bad_at]["rewards"][0] = float("nan")
    clean = make_chunk(*CHUNKS[1])
    p = pump(models, PumpConfig())
    for c in chunks:
        p.chunk(c)
    out = p.close()
    assert p.policy_acc.steps == 0 and out["skipped_nonfinite"] == 1.0
    assert p.events.count("policy.backward") == len(CHUNKS) and "policy.step" in p.events
    assert out["value_skipped_nonfinite"] == 1.0
    p.policy_off.onload()
    assert all(q.grad is None for q in p.policy.parameters())
    after = TrainPump(p.policy, p.value, Accumulator(p.policy, p.policy_acc.optimizer, n_micro=None), p.value_opt,
                      PumpConfig(), step=4, log=lambda _: None, policy_off=p.policy_off, value_off=p.value_off)
    after.chunk(clean)
    after.close()
    fresh, _ = run(models, [clean])
    g_a, g_f = after.policy_acc.optimizer.seen, fresh.policy_acc.optimizer.seen
    assert_same_grads(g_a, g_f)


def test_each_critic_epoch_sees_every_row_once_with_frozen_old_values_and_returns(models, world, monkeypatch):
    """What the value loss receives, epoch by epoch (S6, S10, S21): every original row exactly once
    (no row dropped, none duplicated), old values from the critic before any update, returns as
    they were computed at chunk time, the same in every epoch."""
    import minirl.stream as stream
    seen = []
    real = stream.value_loss
    monkeypatch.setattr(stream, "value_loss", lambda v, old, ret, mask, eps: (
        seen.append((old.detach().clone(), ret.detach().clone(), mask.clone())), real(v, old, ret, mask, eps))[1])
    ids_seen = []
    chunks = [make_chunk(*c) for c in CHUNKS]
    p = pump(models, PumpConfig(critic_ppo_epochs=3, critic_micro_rows=5))
    critic_before = copy.deepcopy(p.value)
    value_forward = p.value.forward
    p.value.forward = lambda ids, lengths=None: (ids_seen.append(ids.clone()), value_forward(ids, lengths))[1]
    p.policy_off.onload()
    for c in chunks:
        p.chunk(c)
    n_chunk_forwards = len(ids_seen)
    p.close()
    rows = sum(c["input_ids"].shape[0] for c in chunks)
    per_epoch = [list(range(i, i + 3)) for i in range(0, 9, 3)]  # 12 rows in calls of 5, 5, 2
    assert len(seen) == 9 and len(ids_seen) == n_chunk_forwards + 9

    def key(ids, mask):  # a row is its (unique, random) tokens up to its last trained token
        return tuple(ids[: int(mask.nonzero().max()) + 1].tolist()) if mask.any() else tuple(ids.tolist())

    want = {}
    for k, c in enumerate(chunks):
        with torch.no_grad():
            before = critic_before(c["input_ids"]) * c["mask"]
        for i in range(c["input_ids"].shape[0]):
            want[key(c["input_ids"][i], c["mask"][i])] = (before[i], p.chunks[k]["returns"][i], c["mask"][i])
    for epoch in per_epoch:
        got = {}
        for call in epoch:
            old, ret, mask = seen[call]
            ids = ids_seen[n_chunk_forwards + call]
            for i in range(ids.shape[0]):
                k = key(ids[i], mask[i])
                assert k not in got, "a row twice in one epoch"
                got[k] = (old[i], ret[i], mask[i])
        assert set(got) == set(want) and len(got) == rows
        for k, (old, ret, mask) in got.items():
            w_old, w_ret, w_mask = want[k]
            n = w_mask.shape[0]
            assert torch.equal(mask[:n], w_mask) and not mask[n:].any()
            assert torch.allclose(old[:n], w_old, atol=1e-6)    # the critic before any update (S6)
            assert torch.equal(ret[:n], w_ret)                  # returns frozen at chunk time (S10)


def test_kl_penalty_to_a_frozen_reference_scored_before_the_policy(models, world):
    """--ppo.kl-coef: the reference scores each micro-batch before the policy's forward, the k3 KL
    enters the loss (0 while the policy equals the reference, > 0 after it moved) and is logged."""
    chunks = [make_chunk(*c) for c in CHUNKS[:2]]
    p = pump(models, PumpConfig(loss={"kl_coef": 0.1}))
    p.ref = copy.deepcopy(models[0]).requires_grad_(False)
    for c in chunks:
        p.chunk(c)
    out = p.close()
    assert p.events.count("reference.forward") == 2
    assert all(p.events[i + 1] == "policy.forward" for i, e in enumerate(p.events) if e == "reference.forward")
    assert out["ppo_kl"] == 0.0  # the policy has not moved from the reference yet
    p.policy_off.onload()
    later = TrainPump(p.policy, p.value, Accumulator(p.policy, p.policy_acc.optimizer, n_micro=None), p.value_opt,
                      PumpConfig(loss={"kl_coef": 0.1}), step=4, ref=p.ref, log=lambda _: None, policy_off=p.policy_off,
                      value_off=p.value_off)
    later.chunk(chunks[0])
    assert later.close()["ppo_kl"] > 0


def test_a_critic_warmup_chunk_leaves_no_policy_root_parameter_gathered(tiny_path, world):
    """In critic warmup the policy's forward only gives pi_old and no backward follows: it runs without
    autograd, so FSDP2's root is resharded after it, and the offload that follows moves the float32
    shards, not gathered copies beside resident masters."""
    from torch.distributed.tensor import DTensor

    from minirl import models as m
    policy, value = m.sharded(tiny_path, "policy", world, "float32"), m.sharded(tiny_path, "value", world, "float32")
    acc = Accumulator(policy, RecordingSGD(policy.parameters(), lr=0.1), n_micro=None)
    p = TrainPump(policy, value, acc, RecordingSGD(value.parameters(), lr=0.1), PumpConfig(critic_warmup=True),
                  step=0, log=lambda line: None)
    p.chunk(make_chunk(*CHUNKS[0]))
    p.policy_off.onload()
    assert [n for n, q in policy.named_parameters() if not isinstance(q, DTensor)] == []


def test_a_pump_made_without_options_runs_as_the_ppo_command_does_by_default():
    """PumpConfig's defaults are what `minirl.ppo` passes for its default flags (disaggregated, after any
    critic warmup), so every test of a default pump tests the command's step; the policy loss's options
    are the one exception (the objective's own tests cover them)."""
    import dataclasses
    from minirl.config_ppo import PPOArgs
    from minirl.ppo import pump_config
    command = dataclasses.asdict(pump_config(PPOArgs(), step=0, colocated=False))
    default = dataclasses.asdict(PumpConfig())
    assert {k: v for k, v in command.items() if k != "loss"} == {k: v for k, v in default.items() if k != "loss"}


@pytest.mark.parametrize("cfg, gamma, lam, whiten", [({}, 1.0, 0.95, True),
                                                   ({"gamma": 0.9, "lam": 0.5, "normalize_advantages": False},
                                                    0.9, 0.5, False)])
def test_each_chunks_advantages_are_gae_of_its_rewards_and_old_values_whitened_within_the_chunk(models, world, cfg,
                                                                                                gamma, lam, whiten):
    from minirl.gae import compute_gae, masked_whiten
    p, _ = run(models, [make_chunk(*c) for c in CHUNKS], **cfg)
    for c in p.chunks:
        adv, returns = compute_gae(c["rewards"], c["old_values"], c["mask"], gamma, lam)
        assert torch.allclose(c["raw_adv"], adv) and torch.allclose(c["returns"], returns)
        assert torch.allclose(c["adv"], masked_whiten(adv, c["mask"]) if whiten else adv)


def test_the_reference_scores_a_chunk_only_when_the_kl_penalty_is_on(models, world):
    for kl, forwards in ((0.0, 0), (0.1, 1)):
        p = pump(models, PumpConfig(loss={"kl_coef": kl}))
        p.ref = copy.deepcopy(models[0]).eval()
        p.chunk(make_chunk(*CHUNKS[0]))
        p.close()
        assert p.events.count("reference.forward") == forwards


def test_a_step_counts_only_its_own_skipped_windows_and_times_its_chunks_and_close(models, world):
    """The accumulator's skips of earlier steps are not this step's: a clean step reports none and runs its
    policy step. `time/last_chunk` and `time/close` are wall times within the step's own."""
    import time
    p = pump(models, PumpConfig(), skipped=2)
    t0 = time.perf_counter()
    p.chunk(make_chunk(*CHUNKS[0]))
    m = p.close()
    elapsed = time.perf_counter() - t0
    assert p.skipped == 0 and "skipped_nonfinite" not in m and p.events.count("policy.step") == 1
    assert 0 < m["time/last_chunk"] < elapsed and 0 < m["time/close"] < elapsed
    assert m["time/last_chunk"] + m["time/close"] < elapsed


@pytest.mark.parametrize("chunks", [CHUNKS, [(4, 1, [1])]])
def test_the_steps_value_metrics_are_the_hand_computed_ones_over_every_chunk(models, world, chunks):
    """advantages_mean, returns_mean and values_mean over the step's valid tokens (the advantages before
    whitening; a step of one token too), and the critic's explained variance 1 - Var(R - V) / Var(R)."""
    p, m = run(models, [make_chunk(*c) for c in chunks])
    mask = torch.cat([c["mask"].flatten() for c in p.chunks]).double().bool()
    adv, ret, val = (torch.cat([c[k].flatten() for c in p.chunks]).double()[mask]
                     for k in ("raw_adv", "returns", "old_values"))
    assert m["advantages_mean"] == pytest.approx(adv.mean().item(), abs=1e-9)
    assert (m["returns_mean"], m["values_mean"]) == pytest.approx((ret.mean().item(), val.mean().item()), abs=1e-9)
    if len(ret) > 1:
        explained = 1 - (ret - val).var(unbiased=False) / ret.var(unbiased=False)
        assert m["value_explained_var"] == pytest.approx(explained.item(), abs=1e-9) and ret.var() > 0


def test_a_critic_warmup_step_logs_the_mean_logprob_gap_of_its_micro_batches(models, world):
    chunk = make_chunk(*CHUNKS[0])
    chunk["rollout_logp"] = -torch.rand(chunk["mask"].shape, generator=torch.Generator().manual_seed(1))
    p, m = run(models, [chunk], critic_warmup=True, policy_micro_rows=2)
    from minirl.objective import logprob_gap
    c = p.chunks[0]
    gaps = [logprob_gap(c["old_logp"][r], chunk["rollout_logp"][r], chunk["mask"][r]) for r in (slice(0, 2), slice(2, 4))]
    assert gaps[0] != gaps[1] and m["ppo_logprob_gap"] == pytest.approx(((gaps[0] + gaps[1]) / 2).item())
