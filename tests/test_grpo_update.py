"""grpo.update on the real tiny model (FSDP2, world of one), no engine: the frozen pi_old ahead pass
(B17), the store's readers (B18), the determinism probe (B19), token-budgeted micro-batches (X1),
inner epochs (X2) and the determinism mode (B15). Then grpo.main's loop around a scripted engine: its
prompt ids, schedule, syncs, records and stall rule."""

import json
import math

import pytest
import torch

from conftest import RecordingSGD, assert_same_grads
from minirl import dist, grpo
from minirl.accumulator import Accumulator, StalledError
from minirl.batch import RolloutStore, pack, plan_chunks
from minirl.config_grpo import GRPOArgs
from minirl.grpo import Probe, update
from minirl.models import load_policy, token_logprobs
from minirl.rollout import Samples
from minirl.tasks import prompt_id
from test_offload import ScriptedEngine


def synthetic_batch(n=16, seed=0):
    """n rows with very unequal completion lengths and +-1 advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for i in range(n):
        prompts.append(torch.randint(3, 40, (4,), generator=g).tolist())
        comps.append(torch.randint(3, 40, ([1, 9, 3, 6][i % 4],), generator=g).tolist())
    s = Samples(list(range(n)), prompts, comps, [[-1.0] * len(c) for c in comps], ["stop"] * n)
    adv = torch.tensor([1.0, -1.0] * (n // 2))
    return pack(s, adv, pad_id=0)


def grpo_args(**rl):
    a = GRPOArgs()
    a.rl.group_size, a.rl.batch_per_replica = 2, 16
    for k, v in rl.items():
        setattr(a.rl, k, v)
    return a.validate(1)


def train(tiny_path, args, ahead=None, lr=0.05, batch=None, model=None, opt_cls=torch.optim.SGD):
    world = dist.init()
    policy = model or dist.shard(load_policy(tiny_path), world, torch.float32)
    opt = opt_cls(policy.parameters(), lr=lr)
    acc = Accumulator(policy, opt, args.n_micro, 0.0)
    batch = batch or synthetic_batch()
    ahead = args.needs_cached_old_logprobs if ahead is None else ahead
    plan = plan_chunks(batch["lengths"].tolist(), args.n_mini, args.micro_batch, args.rl.max_tokens_per_micro_batch)
    store = RolloutStore(batch, plan, args.rl.mu_iterations + ahead)
    calls, steps = update(policy, None, acc, store, args, Probe(policy), ahead)
    store.close()
    return policy, opt, acc, calls, steps, plan


def test_ahead_pass_makes_the_clip_bind_on_later_minibatches(tiny_path, world):
    args = grpo_args(mini_batch_per_replica=4)
    assert args.n_mini == 4 and args.needs_cached_old_logprobs
    *_, calls, _, _ = train(tiny_path, args, lr=0.5)
    assert calls[0]["grpo_clipfrac"] == 0.0                      # nothing has moved yet
    assert max(c["grpo_clipfrac"] for c in calls[1:]) > 0.0       # later mini-batches are clipped
    *_, calls_off, _, _ = train(tiny_path, args, ahead=False, lr=0.5)
    assert all(c["grpo_clipfrac"] == 0.0 and c["grpo_ratio_max"] == 1.0 for c in calls_off)


def test_no_ahead_pass_at_one_minibatch():
    assert not grpo_args().needs_cached_old_logprobs
    assert not grpo_args(mini_batch_per_replica=4, use_rollout_logprobs_for_loss=True).needs_cached_old_logprobs
    assert grpo_args(mu_iterations=2).needs_cached_old_logprobs


def test_the_engines_logprobs_are_pi_old_under_their_flag(tiny_path, world):
    """--rl.use-rollout-logprobs-for-loss: the ratio's denominator is the engine's logprob of each token
    (here -1 for every one) from the first micro-batch on, where it would otherwise be the trainer's own."""
    batch = synthetic_batch()
    with torch.no_grad():
        logp = token_logprobs(load_policy(tiny_path), batch["input_ids"])  # the weights before the step
    want = torch.exp(logp + 1.0)[batch["mask"] > 0].max().item()
    *_, calls, _, _ = train(tiny_path, grpo_args(use_rollout_logprobs_for_loss=True), batch=batch)
    assert len(calls) == 1 and float(calls[0]["grpo_ratio_max"]) == pytest.approx(want, rel=1e-5)
    *_, own, _, _ = train(tiny_path, grpo_args(), batch=synthetic_batch())
    assert float(own[0]["grpo_ratio_max"]) == 1.0


def test_store_readers_follow_the_ahead_pass_predicate(tiny_path, world):
    args = grpo_args(mini_batch_per_replica=8)
    policy = dist.shard(load_policy(tiny_path), world, torch.float32)
    acc = Accumulator(policy, torch.optim.SGD(policy.parameters(), lr=0.1), args.n_micro)
    batch = synthetic_batch()
    plan = plan_chunks(batch["lengths"].tolist(), args.n_mini, args.micro_batch)
    with pytest.raises(KeyError, match="released"):       # pass runs, readers not raised
        update(policy, None, acc, RolloutStore(batch, plan, 1), args, Probe(policy), ahead=True)
    store = RolloutStore(batch, plan, 2)                    # readers raised, pass skipped
    update(policy, None, acc, store, args, Probe(policy), ahead=False)
    with pytest.raises(RuntimeError, match="leaked"):
        store.close()


def test_probe_runs_once_and_fails_on_a_stochastic_forward(tiny_path, world):
    args = grpo_args(mini_batch_per_replica=8)
    model = dist.shard(load_policy(tiny_path), world, torch.float32)
    train(tiny_path, args, model=model)
    noisy = load_policy(tiny_path)
    for layer in noisy.model.layers:
        layer.self_attn.attention_dropout = 0.5  # a stochastic layer that fires in train() only
    noisy = dist.shard(noisy, world, torch.float32)
    with pytest.raises(RuntimeError, match="determinism probe"):
        train(tiny_path, args, model=noisy)
    noisy.config.minirl_forward_noise = {"tolerance": 1.0}  # declared: any share may move; the share is measured
    ids, mask = torch.arange(5, 21)[None], torch.ones(1, 16)
    declared = Probe(noisy)
    declared({"input_ids": ids, "mask": mask, "lengths": torch.tensor([16])}, token_logprobs(noisy.eval(), ids))
    assert 0 < declared.fraction <= 1, declared.fraction  # the moved tokens' share of the 16
    probe = Probe(model)  # the deterministic model passes, and says by how much
    ids = torch.tensor([[5, 6, 7, 8]])
    probe({"input_ids": ids, "mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]]), "lengths": torch.tensor([4])},
          token_logprobs(model.eval(), ids))
    assert probe.done and probe.fraction == 0.0


def test_token_budget_micro_batches_equal_the_unchunked_step(tiny_path, world):
    whole = train(tiny_path, grpo_args(), opt_cls=RecordingSGD)
    budget = 40
    args = grpo_args(max_tokens_per_micro_batch=budget)
    policy, opt, acc, calls, steps, plan = train(tiny_path, args, opt_cls=RecordingSGD)
    lengths = synthetic_batch()["lengths"].tolist()
    assert len(plan[0]) > 1 and sorted(r for b in plan[0] for r in b) == list(range(16))
    assert all(len(b) * max(lengths[r] for r in b) <= budget for b in plan[0])
    assert acc.steps == 1
    # float32: within a few ulps of the largest gradient (measured 3.6e-7 on grads up to 1.19)
    assert_same_grads(opt.seen, whole[1].seen)


def test_mu_iterations_step_per_epoch_against_the_frozen_pi_old(tiny_path, world):
    args = grpo_args(mu_iterations=3)
    _, _, acc, calls, steps, _ = train(tiny_path, args, lr=0.5)
    assert acc.steps == 3 and len(calls) == 3
    assert len(steps) == 3 and all(s["grad_norm"] > 0 for s in steps)  # one record per optimizer step
    assert calls[0]["grpo_ratio_max"] == 1.0
    assert calls[1]["grpo_ratio_max"] != 1.0 and calls[2]["grpo_ratio_max"] != 1.0


def test_deterministic_mode_raises_when_cuda_is_up_without_cublas_config(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.raises(RuntimeError, match="CUBLAS_WORKSPACE_CONFIG"):
        dist.set_deterministic()


def test_deterministic_mode_sets_the_knobs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        dist.set_deterministic()
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


def test_update_moves_every_chunk_to_the_trainers_device(tiny_path, world, monkeypatch):
    """The trainer on `meta` (a card's stand-in), the collected batch on the host: the GRPO update,
    with the ahead pass, the probe and the reference, never mixes devices in one op (as CUDA refuses)."""
    from conftest import OneDevice
    args = grpo_args(mini_batch_per_replica=8, micro_batch_per_replica=4, kl_coef=0.1)
    meta = torch.device("meta")
    policy, ref = load_policy(tiny_path).to(meta), load_policy(tiny_path).to(meta).requires_grad_(False)
    policy.config.minirl_forward_noise = {"tolerance": 2.0}  # meta values are fake: let the probe's numbers pass
    acc = Accumulator(policy, torch.optim.SGD(policy.parameters(), lr=0.1), args.n_micro, 1.0)
    batch = synthetic_batch()
    plan = plan_chunks(batch["lengths"].tolist(), args.n_mini, args.micro_batch)
    store = RolloutStore(batch, plan, args.rl.mu_iterations + 1, device=meta)
    with OneDevice(monkeypatch):
        calls, steps = update(policy, ref, acc, store, args, Probe(policy), ahead=True)
    store.close()
    assert acc.steps == 2 and len(calls) == 4
    assert all(p.device == meta for p in policy.parameters())


def test_reference_scores_a_chunk_before_the_policy(tiny_path, world):
    """The reference's forward runs (and frees its activations) before the policy's graph exists."""
    args = grpo_args(micro_batch_per_replica=8, kl_coef=0.1)
    policy, ref = load_policy(tiny_path), load_policy(tiny_path).requires_grad_(False)
    order = []
    policy.register_forward_pre_hook(lambda *_: order.append("policy"))
    ref.register_forward_pre_hook(lambda *_: order.append("ref"))
    acc = Accumulator(policy, torch.optim.SGD(policy.parameters(), lr=0.1), args.n_micro)
    batch = synthetic_batch()
    store = RolloutStore(batch, plan_chunks(batch["lengths"].tolist(), 1, args.micro_batch), 1)
    update(policy, ref, acc, store, args, Probe(policy), ahead=False)
    assert order == ["ref", "policy"] * 2


def test_logprob_gap_is_reported_against_the_engines_logprobs(tiny_path, world):
    """pi_old is the trainer's own by default; the engine's logprobs only feed the drift metric."""
    _, _, _, calls, _, _ = train(tiny_path, grpo_args(), lr=0.0)
    # synthetic_batch's engine logprob is -1.0 on every token: the gap is the mean |logp + 1|
    assert all(c["grpo_logprob_gap"] > 0.1 for c in calls)
    assert calls[0]["grpo_ratio_max"] == 1.0  # ratio against the trainer's own pi_old, not exp(logp + 1)


def test_ahead_pass_scores_in_eval_mode_without_grad_and_pairs_chunks_by_call_order(tiny_path, world):
    """B17: the ahead pass runs in eval() under no_grad(), the training calls in train() with grad;
    and at learning rate 0 every call's ratio is exactly 1, which holds only if each call is scored
    against its own chunk's record (2 mini-batches x 2 micro-batches of different rows and lengths)."""
    args = grpo_args(mini_batch_per_replica=8, micro_batch_per_replica=4)
    policy = dist.shard(load_policy(tiny_path), world, torch.float32)
    modes = []
    policy.register_forward_pre_hook(lambda m, a: modes.append((m.training, torch.is_grad_enabled())))
    *_, calls, _, plan = train(tiny_path, args, lr=0.0, model=policy)
    assert len(plan) == 2 and all(len(m) == 2 for m in plan)
    # the ahead pass's 4 chunks in eval() without grad; the probe re-scores the first in train(); then training
    assert modes == [(False, False), (True, False), *[(False, False)] * 3, *[(True, True)] * 4]
    assert all(c["grpo_ratio_max"] == 1.0 and c["grpo_clipfrac"] == 0.0 for c in calls)


def test_probe_defaults_are_strict_and_it_runs_once_per_run(tiny_path, world, monkeypatch):
    """B19: a model that declares no forward noise gets 0.05 nats on any token (tolerance 0), a
    declared one gets its own; the probe scores the first ahead chunk of the run and never again."""
    model = dist.shard(load_policy(tiny_path), world, torch.float32)
    probe = Probe(model)
    assert (probe.nats, probe.tolerance) == (0.05, 0.0)
    model.config.minirl_forward_noise = {"nats": 0.2, "tolerance": 0.01}
    assert (Probe(model).nats, Probe(model).tolerance) == (0.2, 0.01)
    del model.config.minirl_forward_noise
    runs = []
    real = Probe.__call__
    monkeypatch.setattr(Probe, "__call__", lambda self, *a: (runs.append(1), real(self, *a))[1])
    args = grpo_args(mini_batch_per_replica=8)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.01), args.n_micro)
    for _ in range(2):  # two collected batches, one probe
        batch = synthetic_batch()
        store = RolloutStore(batch, plan_chunks(batch["lengths"].tolist(), args.n_mini, args.micro_batch), 2)
        update(model, None, acc, store, args, probe, ahead=True)
        store.close()
    assert runs == [1] and probe.done and probe.fraction == 0.0


def test_clip_higher_reaches_the_update(tiny_path, world):
    """--rl.clip-eps-high widens only the upper clip of a real update: with four mini-batches at a
    large lr the ratios move, and a far upper bound clips fewer tokens than the default."""
    clipped = []
    for high in (0.0, 1000.0):
        *_, calls, _, _ = train(tiny_path, grpo_args(mini_batch_per_replica=4, clip_eps_high=high), lr=0.5)
        clipped.append(sum(c["grpo_clipfrac"] for c in calls))
    assert clipped[0] > 0 and clipped[1] < clipped[0], clipped


def test_logged_entropy_is_the_mean_over_completion_tokens(tiny_path, world):
    """The step's entropy is the token-weighted mean over masked completion tokens only, from the
    forward the update trains on (not over prompt or pad positions)."""
    from minirl.accumulator import roll_up
    policy = dist.shard(load_policy(tiny_path), world, torch.float32)
    batch = synthetic_batch()
    with torch.no_grad():
        _, ent = token_logprobs(policy, batch["input_ids"], entropy=True)
    mask = batch["mask"]
    expected = ((ent * mask).sum() / mask.sum()).item()
    everywhere = ent[:, 1:].mean().item()
    assert abs(expected - everywhere) > 1e-3  # the two differ on this batch, so the test can tell them apart
    *_, calls, _, _ = train(tiny_path, grpo_args(micro_batch_per_replica=4), model=policy)
    assert abs(roll_up(calls)["grpo_entropy"] - expected) < 1e-5


def test_the_loop_samples_each_steps_prompts_in_order_and_reports_the_whole_batch(world, tmp_path, monkeypatch):
    """grpo.main around a scripted engine (no vLLM): step s samples prompt ids s*P .. s*P + P - 1 (B14); the
    run's optimizer steps, steps x n_mini x mu_iterations, follow one cosine schedule; one weight sync per
    collected batch (B4); tokens per second counts the whole batch; an eval scores the policy after its step."""
    built = []
    monkeypatch.setattr(grpo, "Engine", lambda *a, **k: built.append(ScriptedEngine(*a, **k)) or built[-1])
    grpo.main(["--steps", "3", "--rl.batch-per-replica", "8", "--rl.group-size", "2", "--rl.mini-batch-per-replica",
               "4", "--rl.mu-iterations", "2", "--rl.lr-schedule", "cosine", "--log.eval-every", "2",
               "--task.eval-prompts", "4", "--log.run-dir", str(tmp_path)])
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if "reward_mean" in r]
    assert built[0].sampled == [[prompt_id(0, s * 4 + i) for i in range(4)] for s in range(3)]  # P = 8 / 2
    assert [r["optimizer_steps"] for r in steps] == [4, 8, 12] and [r["weight_syncs"] for r in steps] == [1, 1, 1]
    cosine = lambda k: 1e-4 * 0.5 * (1 + math.cos(math.pi * k / 12))  # noqa: E731  (12 steps in the run)
    assert [r["lr"] for r in steps] == pytest.approx([cosine(3), cosine(7), cosine(11)], rel=1e-9)
    for r in steps:
        assert r["tokens_per_s"] * r["time/step"] == pytest.approx(r["completion_len_mean"] * 8, rel=1e-6)
    assert [(r["step"], r["eval_version"]) for r in records if "eval_version" in r] == [(0, 0), (1, 2), (2, 3)]
    assert not list((tmp_path / "checkpoints").glob("step_*"))  # no --checkpoint.every: no step saves


def test_the_loop_plans_a_token_budget_by_the_tokens_its_policy_computes(world, tmp_path, monkeypatch):
    """X1 through grpo.main: under --rl.max-tokens-per-micro-batch each step's micro-batches are planned by the
    policy's own count of computed tokens (packed lanes here: rows of 5, 3 and 1 tokens cost 2 lanes x 5, not
    3 rows x 5 padded nor 9 in one lane), and each fits the budget or holds one row."""
    plan_chunks, costs = grpo.plan_chunks, []

    def planned(lengths, n_mini, micro_rows, max_tokens, cost):
        plan = plan_chunks(lengths, n_mini, micro_rows, max_tokens, cost)
        costs.append([(cost([lengths[r] for r in micro]), len(micro)) for mini in plan for micro in mini])
        assert cost([5, 3, 1]) == 10
        return plan

    monkeypatch.setattr(grpo, "plan_chunks", planned)
    monkeypatch.setattr(grpo, "Engine", ScriptedEngine)
    grpo.main(["--steps", "2", "--rl.batch-per-replica", "8", "--rl.group-size", "2", "--log.eval-every", "0",
               "--rl.max-tokens-per-micro-batch", "64", "--log.run-dir", str(tmp_path)])
    assert len(costs) == 2 and all(len(step) > 1 for step in costs)
    assert all(tokens <= 64 or rows == 1 for step in costs for tokens, rows in step)


def test_the_loop_stops_after_its_limit_of_batches_that_took_no_update(world, tmp_path, monkeypatch):
    """Rewards NaN from step 1 on (the tests' fault): every window of those batches is skipped, so with
    --rl.max-skipped-steps 2 the run stops at step 2 (exit 3's StalledError), nothing saved after a step
    without an update and nothing exported."""
    monkeypatch.setattr(grpo, "Engine", ScriptedEngine)
    monkeypatch.setenv("MINIRL_FAULT", "nan_rewards:1")
    with pytest.raises(StalledError, match=r"step 2: 2 steps in a row \(1-2\)"):
        grpo.main(["--steps", "5", "--rl.batch-per-replica", "4", "--rl.group-size", "2", "--log.eval-every", "0",
                   "--rl.max-skipped-steps", "2", "--checkpoint.every", "1", "--log.run-dir", str(tmp_path)])
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r.get("skipped_nonfinite", 0) for r in records] == [0, 1, 1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000001"]
    assert not (tmp_path / "final").exists()
