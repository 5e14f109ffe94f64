"""ppo.py. The trainer loop's order with a recording group source and no engine (S11, S13); then
end to end with the real vLLM engine: `torchrun -m minirl.ppo` with one rollout rank and one, two or
six train ranks streaming chunks through the train pump (S3, S11, S21, S22), and colocated full
batch with several policy epochs on one process (S13)."""

import datetime
import json
import math
import os
import re
import signal
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import checkpoint_names, everything, ready_for, run, sigterm_after
from minirl.config_ppo import PPOArgs

def e2e(test):
    """The real engine, end to end: a slow test."""
    return pytest.mark.vllm(pytest.mark.slow(test))


class RecordingSource:
    """A group source without engines: each step's groups are made up on the spot, and every call
    the trainer loop makes lands in `events` (beside the pump's critic training and the log)."""

    t_all_ready = 0.0

    def __init__(self, args, colocated: bool, events: list):
        self.args, self.colocated, self.events = args, colocated, events

    def start(self, step, policy, offload, load=None, say=print, write=None, logged_eval=-1):
        self.events.append("start")

    def chunks(self, step, ready):
        from minirl.batch import as_group
        from minirl.rollout import Samples
        from minirl.sampler import Group
        P, G = self.args.ppo.num_prompts_per_step, self.args.ppo.num_generations_per_prompt
        g = torch.Generator().manual_seed(step)
        comps = [torch.randint(3, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 6, (P * G,), generator=g)]
        s = Samples([0] * P * G, [[5, 6, 7]] * P * G, comps, [[-1.0] * len(c) for c in comps], ["stop"] * P * G)
        rewards = [float(j % 2) for j in range(G)]
        groups = [as_group(s, slice(i * G, (i + 1) * G), rewards, [rewards], step) for i in range(P)]
        ready.claimed.update({i: Group(i, step) for i in range(P)})
        self.events.append("chunk")
        yield P, groups

    def refit(self, version, policy):
        self.events.append("refit")

    def times(self):
        return {}

    def release(self, step):
        self.events.append("release")

    def evals(self, version):
        return {}

    def final_eval(self, steps):
        return {}

    def rollout_memory_gib(self):
        return 0.0

    def save(self, fn):
        self.events.append("save")
        fn()

    def stop(self):
        self.events.append("stop")

    def cleanup(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("colocated", [False, True])
def test_train_loop_releases_logs_and_saves_only_after_both_updates(tiny_path, world, tmp_path, monkeypatch,
                                                                      colocated):
    """Per step: the chunk, then the policy update and refit, the critic epochs (S9: refit first on
    separate rollout ranks; S13: refit after the critic when colocated), and only then the groups'
    release, the step's log record and the checkpoint (S11)."""

    from minirl import ppo
    from minirl.logger import RunLog
    from minirl.stream import TrainPump
    events = []
    critic, write = TrainPump._train_critic, RunLog.write
    monkeypatch.setattr(TrainPump, "_train_critic", lambda self: (events.append("critic"), critic(self))[1])
    monkeypatch.setattr(RunLog, "write", lambda self, r: (events.append("log"), write(self, r))[1])
    args = PPOArgs()
    args.steps, args.ppo.num_prompts_per_step, args.ppo.num_generations_per_prompt = 2, 2, 2
    args.ppo.critic_ppo_epochs, args.checkpoint.every, args.log.run_dir = 1, 1, str(tmp_path)
    ppo.train(ready_for(args, tiny_path), world, RecordingSource(args, colocated, events))
    update = ["critic", "refit"] if colocated else ["refit", "critic"]
    step = ["chunk", *update, "release", "log", "save"]
    assert events == ["start", *step, *step, "stop"], events
    assert checkpoint_names(tmp_path / "checkpoints") == ["step_00000001", "step_00000002"]


class NaNRewards(RecordingSource):
    """Every group's rewards are NaN: every policy and critic update comes out non-finite."""

    def chunks(self, step, ready):
        for taken, groups in super().chunks(step, ready):
            for g in groups:
                g["rewards"] = torch.full_like(g["rewards"], float("nan"))
            yield taken, groups


def small_ppo_args(tmp_path, steps):
    args = PPOArgs()
    args.steps, args.ppo.num_prompts_per_step, args.ppo.num_generations_per_prompt = steps, 2, 2
    args.ppo.critic_ppo_epochs, args.log.run_dir = 1, str(tmp_path)
    return args


def train_in_process(args, tiny_path, world, source, resume=None):

    from minirl import ppo
    ppo.train(ready_for(args, tiny_path, resume), world, source)
    return [json.loads(line) for line in open(args.log.run_dir + "/metrics.jsonl") if "reward_mean" in line]


def test_ppo_stops_after_max_skipped_steps_of_non_finite_updates(tiny_path, world, tmp_path):
    """--ppo.max-skipped-steps 1: the first step without a policy update stops the run (exit 3's
    StalledError), its record logged with the skip counted once, nothing exported."""
    from minirl.accumulator import StalledError
    args = small_ppo_args(tmp_path, steps=5)
    args.ppo.max_skipped_steps = 1
    with pytest.raises(StalledError, match="--ppo.lr"):
        train_in_process(args, tiny_path, world, NaNRewards(args, False, []))
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "reward_mean" in line]
    assert [r["step"] for r in recs] == [0] and recs[0]["skipped_nonfinite"] == 1.0
    assert not (tmp_path / "final").exists()


def test_a_step_whose_later_policy_epoch_is_non_finite_still_took_an_update(tiny_path, world, tmp_path, monkeypatch):
    """Full batch, two policy epochs, the second one's loss non-finite: the first epoch's optimizer step
    happened, so the stall rule does not count the step as one without an update (it counted any skip as
    one), and the skip is in the record."""
    from minirl import stream
    args = small_ppo_args(tmp_path, steps=2)
    args.grid.gpu_placement, args.async_rl.min_groups_for_streaming_train = "colocated", 2
    args.ppo.ppo_epochs, args.ppo.max_skipped_steps = 2, 1
    loss, calls = stream.policy_loss, []

    def second_epoch_nan(*a, **k):  # one chunk, no micro-batches: the calls alternate epoch 1, epoch 2
        calls.append(1)
        out = loss(*a, **k)
        return (out[0] * float("nan"), *out[1:]) if len(calls) % 2 == 0 else out

    monkeypatch.setattr(stream, "policy_loss", second_epoch_nan)
    recs = train_in_process(args, tiny_path, world, RecordingSource(args, True, []))
    assert len(calls) == 4 and [r["step"] for r in recs] == [0, 1]
    assert all(r["skipped_nonfinite"] == 1.0 for r in recs) and (tmp_path / "final").exists()


def test_ppo_learning_rates_follow_their_schedules_after_critic_warmup(tiny_path, world, tmp_path, monkeypatch):
    """Critic warmup 2 and lr warmup 2: the policy's first optimizer step (at step 2) is step 0 of its
    schedule, so it trains at lr / 2 then lr, and the warmup steps, which take no policy step, log no `lr`;
    the critic steps from step 0 (lr / 2, then lr). Both optimizers take --ppo.weight-decay."""
    from minirl import models
    args = small_ppo_args(tmp_path, steps=4)
    args.ppo.critic_warmup_steps, args.ppo.lr_warmup_steps = 2, 2
    args.ppo.lr, args.ppo.value_lr, args.ppo.weight_decay = 1e-4, 2e-4, 0.05
    built, adamw = [], models.adamw
    monkeypatch.setattr(models, "adamw", lambda *a: built.append(a[1:]) or adamw(*a))
    recs = train_in_process(args, tiny_path, world, RecordingSource(args, False, []))
    assert built == [(1e-4, 0.05), (2e-4, 0.05)]
    assert [r["critic_warmup"] for r in recs] == [True, True, False, False]
    assert [r.get("lr") for r in recs[:2]] == [None, None]
    assert [r["lr"] for r in recs[2:]] == pytest.approx([5e-5, 1e-4], rel=1e-9)
    assert [r["value_lr"] for r in recs] == pytest.approx([1e-4, 2e-4, 2e-4, 2e-4], rel=1e-9)


def test_ppo_cosine_schedules_end_at_each_optimizers_own_last_step(tiny_path, world, tmp_path):
    """Cosine, no lr warmup: the policy's schedule spans its own optimizer steps, (steps - critic warmup) x
    ppo_epochs, and the critic's steps x critic_ppo_epochs; each record holds the rate of its step's last
    optimizer step (full batch, 2 policy and 2 critic epochs, critic warmup 2 of 4 steps). Also the
    record's mean prompt length: every made-up prompt is 3 tokens."""
    args = small_ppo_args(tmp_path, steps=4)
    args.ppo.critic_warmup_steps, args.ppo.lr_schedule = 2, "cosine"
    args.ppo.ppo_epochs, args.ppo.critic_ppo_epochs, args.ppo.lr, args.ppo.value_lr = 2, 2, 1e-4, 2e-4
    recs = train_in_process(args, tiny_path, world, RecordingSource(args, False, []))
    cosine = lambda peak, k, total: peak * 0.5 * (1 + math.cos(math.pi * k / total))  # noqa: E731
    assert [r["lr"] for r in recs[2:]] == pytest.approx([cosine(1e-4, k, 4) for k in (1, 3)], rel=1e-9)
    assert [r["value_lr"] for r in recs] == pytest.approx([cosine(2e-4, k, 8) for k in (1, 3, 5, 7)], rel=1e-9)
    assert [r["prompt_len_mean"] for r in recs] == [3.0] * 4


def test_each_step_publishes_and_asks_for_the_evals_of_the_version_after_it(tiny_path, world, tmp_path):
    """The loop's version numbers: step s publishes version s + 1 (with weights, or a bump alone during critic
    warmup, S14) and asks for the held-out scores of version s + 1, after version 0's before the first step;
    each record counts the groups it consumed and the tokens per second of the whole step's rows."""
    args = small_ppo_args(tmp_path, steps=3)
    args.ppo.critic_warmup_steps = 1
    source, published, asked = RecordingSource(args, False, []), [], []
    source.refit = lambda version, policy: published.append((version, policy is not None))
    source.evals = lambda version: asked.append(version) or {}
    recs = train_in_process(args, tiny_path, world, source)
    assert published == [(1, False), (2, True), (3, True)]
    assert asked == [0, 1, 2, 3]
    assert [r["groups_consumed"] for r in recs] == [2, 2, 2]
    for r in recs:  # the step's generated tokens are all P x G rows' (2 x 2), not this rank's or one group's
        assert r["tokens_per_s"] * r["time/step"] == pytest.approx(r["completion_len_mean"] * 4, rel=1e-6)


def test_the_loops_policy_offload_keeps_the_accumulated_gradients_on_the_card(tiny_path, world, tmp_path,
                                                                             monkeypatch):
    """S7 as ppo.train wires it (its own offloaders, handed to every step's pump): after each chunk the
    policy's parameters are off the card for the critic, and its accumulated gradients still on it."""
    from minirl import stream
    seen, chunk = [], stream.TrainPump.chunk

    def checked(pump, c):
        chunk(pump, c)
        local = lambda t: t.to_local().untyped_storage().nbytes()  # noqa: E731  (this rank's FSDP2 shard)
        params = list(pump.policy.parameters())
        seen.append((all(local(q) == 0 for q in params), any(q.grad is not None and local(q.grad) > 0 for q in params)))
    monkeypatch.setattr(stream.TrainPump, "chunk", checked)
    args = small_ppo_args(tmp_path, steps=2)
    train_in_process(args, tiny_path, world, RecordingSource(args, False, []))
    assert seen == [(True, True)] * 2


def test_the_records_carry_the_rollout_memory_the_rows_asked_for_and_the_last_versions_late_eval(tiny_path, world,
                                                                                              tmp_path):
    """Each record takes the rollout side's memory peak (a source that measures none logs none); with
    --log.train-samples at all P x G rows every row goes to samples.jsonl; after the last step, the eval of
    the last version, when it came late, is logged at step `steps`."""
    args = small_ppo_args(tmp_path, steps=2)
    args.log.train_samples = 4
    source = RecordingSource(args, False, [])
    source.rollout_memory_gib = lambda: 1.5
    source.final_eval = lambda steps: {"eval_accuracy": 0.25, "eval_version": steps}
    recs = train_in_process(args, tiny_path, world, source)
    assert [r["rollout_memory_peak_gib"] for r in recs] == [1.5, 1.5]
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert {k: lines[-1][k] for k in ("step", "eval_accuracy", "eval_version")} == {"step": 2, "eval_accuracy": 0.25,
                                                                                   "eval_version": 2}
    shown = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [(s["step"], s["reward"]) for s in shown] == [(step, r) for step in (0, 1) for r in (0.0, 1.0, 0.0, 1.0)]


@pytest.mark.parametrize("streaming", [True, False])
def test_whitened_advantages_are_warned_of_under_streaming_only(tiny_path, world, tmp_path, capsys, streaming):
    """Whitening within each chunk makes the chunk boundaries change the gradient: said when streaming,
    not in full batch (one chunk, the whole batch)."""
    args = small_ppo_args(tmp_path, steps=1)
    args.async_rl.min_groups_for_streaming_train = 1 if streaming else 2
    train_in_process(args, tiny_path, world, RecordingSource(args, False, []))
    assert ("whitens advantages within each chunk" in capsys.readouterr().out) == streaming


def test_a_resumed_run_reports_each_optimizers_next_rate_from_its_own_schedule(tiny_path, world, tmp_path, capsys):
    """Critic warmup 1, 2 policy and 2 critic epochs a step, a 10-step linear warmup of both rates: resumed
    at step 1 the policy has taken no step (its next is its schedule's step 0) and the critic 2; at step 2,
    2 and 4. Each checkpoint's optimizer holds another rate, so each resume says the next one."""
    from minirl import checkpoint
    from minirl.accumulator import lr_schedule
    resumed = []
    for steps in (1, 2, 3):
        args = small_ppo_args(tmp_path, steps=steps)
        args.ppo.critic_warmup_steps, args.ppo.lr_warmup_steps, args.checkpoint.every = 1, 10, 1
        args.ppo.ppo_epochs = args.ppo.critic_ppo_epochs = 2
        args.ppo.lr, args.ppo.value_lr = 1e-4, 2e-4
        resume = checkpoint.find("auto", args.checkpoint_dir) if steps > 1 else None
        train_in_process(args, tiny_path, world, RecordingSource(args, False, []), resume)
        out = capsys.readouterr().out
        resumed += re.findall(r"(--ppo\.(?:value-)?lr): the checkpoint's optimizer was at lr \S+; the schedule of "
                              r"the flags sets the rate, (\S+) at the next step", out)
    policy, value = lr_schedule(1e-4, 10, 10), lr_schedule(2e-4, 10, 10)
    assert resumed == [("--ppo.lr", f"{policy(0):g}"), ("--ppo.value-lr", f"{value(2):g}"),
                       ("--ppo.lr", f"{policy(2):g}"), ("--ppo.value-lr", f"{value(4):g}")]


def test_a_rollout_rank_serves_until_stop_or_a_silent_trainer_and_names_one_lost(monkeypatch):
    """The rollout rank's watch of the trainer (placement._Term), on a store and a clock of the test's: no
    verdict before the first heartbeat; a trainer silent for more than PEER_TIMEOUT_S is lost, named by rank
    and address (exit 4's PeerLost); after SIGTERM five silent beats are enough to leave (it serves on while
    the trainer saves); `stop` ends it at once, and a wait for a key returns False once the trainer is gone."""
    from minirl import placement
    from minirl.dist import PeerLost
    store, now, handlers = torch.distributed.HashStore(), [100.0], {}
    store.set_timeout(datetime.timedelta(seconds=5))  # a read of a key that is not there fails, never hangs
    monkeypatch.setattr(placement.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(placement.signal, "signal", lambda sig, handler: handlers.__setitem__(sig, handler))
    term = placement._Term(store, 1)
    assert not term.trainer_gone()                        # no beat yet: the trainer may still be building
    store.set("trainer/alive", "1")
    store.set("trainer/addr", "10.0.0.5")
    assert not term.trainer_gone()                        # heard at 100
    now[0] = 130.0
    assert not term.trainer_gone()                        # 30 s of silence is not yet more than PEER_TIMEOUT_S
    now[0] = 130.5
    with pytest.raises(PeerLost, match=r"rollout rank 1 lost train rank 0 at 10\.0\.0\.5: no heartbeat for 30 s"):
        term.trainer_gone()
    store.set("trainer/alive", "2")
    now[0] = 131.0                                        # the store is read once a heartbeat period
    assert not term.trainer_gone()                        # a new beat: heard at 131
    handlers[signal.SIGTERM](signal.SIGTERM, None)
    now[0] = 136.0
    assert not term.trainer_gone()                        # SIGTERM 5 s ago: the trainer may be saving
    now[0] = 136.5
    assert term.trainer_gone()                            # five beats without one: it is gone
    assert term.wait("trainer/addr") and not term.wait("group/0/0")
    calm = placement._Term(store, 1)
    store.set("stop", b"1")
    assert calm.trainer_gone() and calm.wait("stop") and not calm.wait("group/0/0")


def test_a_rollout_rank_reads_the_trainers_heartbeat_once_a_period(monkeypatch):
    """The watch runs at every poll (milliseconds apart), the store is read once a heartbeat period: many
    rollout ranks never load the store with reads of a key that changes once a second."""
    from minirl import placement

    class Counting:
        def __init__(self):
            self.store, self.reads = torch.distributed.HashStore(), 0

        def check(self, keys):
            return self.store.check(keys)

        def get(self, key):
            self.reads += key == "trainer/alive"
            return self.store.get(key)

    store, now = Counting(), [100.0]
    store.store.set("trainer/alive", "1")
    monkeypatch.setattr(placement.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(placement.signal, "signal", lambda *a: None)
    term, reads = placement._Term(store, 1), []
    for t in (100.0, 100.5, 100.99, 101.0, 101.5, 102.0):
        now[0] = t
        term.trainer_gone()
        reads.append(store.reads)
    assert reads == [1, 1, 1, 2, 2, 3]


def test_the_trainers_heartbeat_counts_up_once_a_period(monkeypatch):
    """Train rank 0's heartbeat (its own store client, a daemon thread): beats 1, 2, 3, ... a heartbeat
    period apart; a count, not a clock (the hosts' clocks need not agree)."""
    from minirl import placement

    class Enough(Exception):
        pass

    beats, slept = [], []

    class Client:
        def set(self, key, value):
            beats.append((key, value))
            if len(beats) == 3:
                raise Enough

    monkeypatch.setattr(placement.time, "sleep", slept.append)
    with pytest.raises(Enough):
        placement._heartbeat(Client())
    assert beats == [("trainer/alive", str(n)) for n in (1, 2, 3)] and slept == [placement.HEARTBEAT_S] * 2


def test_disaggregated_placement_in_one_process_serves_every_group_once_and_every_version(tiny_path, world, tmp_path,
                                                                                          monkeypatch, capfd):
    """The disaggregated protocol without processes or vLLM: the train side (StoreGroups, a world of one) in
    this thread, one rollout rank (rollout_rank, a scripted engine) in another, over a real TCPStore and a
    real gloo refit group. Streaming (a chunk from one ready group): each step consumes its 4 groups once,
    every version reaches the engine as weights, the due evals come back in order, the store holds no
    group after its step, and the rollout rank serves until the trainer says stop."""
    import faulthandler
    import threading

    from minirl import dist, placement, refit
    from minirl.tasks import prompt_id
    from test_offload import ScriptedEngine
    args = small_ppo_args(tmp_path, steps=3)
    args.ppo.num_prompts_per_step, args.async_rl.min_groups_for_streaming_train = 4, 1
    args.log.eval_every, args.task.eval_prompts = 2, 4
    engines = []
    monkeypatch.setattr(placement, "Engine", lambda *a, **k: engines.append(ScriptedEngine(*a, **k)) or engines[-1])
    monkeypatch.setattr(placement.signal, "signal", lambda *a: None)  # the rollout rank is a thread here
    beating = []  # the heartbeat's thread: a daemon, which never keeps a finished trainer alive
    monkeypatch.setattr(placement, "_heartbeat", lambda client: beating.append(threading.current_thread().daemon))
    host = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    store = refit.run_store("127.0.0.1", host.port)  # each side a client of its own, as each rank has
    roles = refit.Roles(0, 2, 1, dist.Devices(trainer=None, engine=torch.device("cpu")))
    rollout = threading.Thread(target=placement.rollout_rank, daemon=True,  # a failed test never keeps pytest alive
                               args=(ready_for(args, tiny_path), roles, refit.run_store("127.0.0.1", host.port)))
    rollout.start()
    source, serving_at_stop = placement.StoreGroups(args, store, world), []
    stop = source.stop
    source.stop = lambda: (serving_at_stop.append((rollout.join(1), rollout.is_alive())[1]), stop())
    faulthandler.dump_traceback_later(180, exit=True)  # a protocol that deadlocks fails the suite, never hangs it
    try:
        recs = train_in_process(args, tiny_path, world, source)
    finally:
        store.set("stop", b"1")
        rollout.join(60)
        faulthandler.cancel_dump_traceback_later()
    assert beating == [True] and not rollout.is_alive()
    assert serving_at_stop == [True]  # the rollout rank outlives the trainer's last use of the store
    sampled = [i for call in engines[0].sampled for i in call]
    assert sampled == [prompt_id(0, k) for k in range(12)]  # step s's groups are prompts 4s .. 4s + 3 (B14)
    rows = re.findall(r"train_pump: step \d+ chunk \d+ groups=\d+ rows=(\d+)", capfd.readouterr().out)
    assert sum(map(int, rows)) == 3 * 4 * 2  # every step's P x G rows, each group's G once
    assert [r["groups_consumed"] for r in recs] == [4, 4, 4]
    assert all(0 <= r["time/wait_first_chunk"] < 60 and 0 <= r["time/tail"] < 60 for r in recs)  # seconds, measured
    assert engines[0].loads == 3  # versions 1, 2 and 3, each as weights
    assert (engines[0].private, engines[0].log_file) == (True, str(tmp_path / "engine.log"))  # a world of its own
    assert all(r["rollout_memory_peak_gib"] > 0 for r in recs)  # the rollout rank's peak, posted in the store
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["eval_version"] for r in records if "eval_version" in r] == [0, 2, 3]
    assert not [k for s in range(3) for k in (f"group/{s}/{i}" for i in range(4)) if store.check([k])]
    assert not [v for v in range(4) if store.check([f"eval/{v}"])]  # only the due versions were scored, each taken


def colocated_source(args, world, monkeypatch):
    """The real `EngineGroups` and hand-off around a recording engine (no vLLM): its generate makes
    the step's groups and refuses unless the engine is awake with fresh weights."""
    from minirl import placement
    from minirl.batch import as_group
    from minirl.rollout import Samples
    from test_offload import RecordingEngine
    args.grid.gpu_placement, args.async_rl.min_groups_for_streaming_train = "colocated", args.ppo.num_prompts_per_step
    args.log.eval_every = 0
    engine = RecordingEngine("unused", args.rollout, 64, world.device, sleep_mode=True)
    engine.close, engine.asked = lambda: None, []  # no vLLM behind it; the groups each generate was asked for
    source = placement.EngineGroups(args, world, lambda: engine, None, None)  # the stand-in generate makes the groups
    G = args.ppo.num_generations_per_prompt

    def generate(engine, task, tok, indices, step, args, version):
        engine.generate()
        engine.asked.append(list(indices))
        comps = [[5 + j, 6] for j in range(G)]
        s = Samples([0] * G, [[3, 4]] * G, comps, [[-1.0, -1.0]] * G, ["stop"] * G)
        for i in indices:
            rewards = [float(j % 2) for j in range(G)]
            yield i, as_group(s, slice(0, G), rewards, [rewards], version)

    monkeypatch.setattr(placement, "_generate", generate)
    return source, engine


def test_every_eval_the_rollout_side_posts_is_logged_however_many_arrive_between_two_steps(world):
    """Disaggregated evals arrive asynchronously through the store: the newest goes into the step's record
    and each older one (the baseline, with --log.eval-every 1) is a record of its own at its version; at
    the end, a due version posted after the last step's record is logged before the last one. (Every
    eval but the newest was dropped once.)"""
    from minirl.placement import StoreGroups
    from minirl.refit import put

    store, written = torch.distributed.HashStore(), []
    post = lambda *versions: [put(store, f"eval/{v}", json.dumps({"eval_accuracy": v / 10}).encode())  # noqa: E731
                              for v in versions]
    args = PPOArgs(steps=3)
    args.log.eval_every = 1
    source = StoreGroups(args, store, world)
    source.write = lambda step, record: written.append((step, record["eval_version"], record["eval_accuracy"]))
    post(0, 1)  # the baseline and version 1, both before step 0's record
    assert source.evals(1) == {"eval_accuracy": 0.1, "eval_version": 1} and written == [(0, 0, 0.0)]
    assert source.evals(2) == {}  # nothing new
    post(2, 3)
    assert source.evals(3)["eval_version"] == 3 and written[-1] == (2, 2, 0.2)
    assert source.final_eval(3) == {}  # the last version is logged already

    args = PPOArgs(steps=3)
    args.log.eval_every, written[:] = 2, []
    source = StoreGroups(args, store, world)
    source.write = lambda step, record: written.append((step, record["eval_version"]))
    post(0, 2, 3)  # due: 0, 2 (the interval) and 3 (the last); all three after the last step's record
    assert source.final_eval(3)["eval_version"] == 3 and written == [(0, 0), (2, 2)]
    args.log.eval_every = 0
    store.set_timeout(datetime.timedelta(seconds=2))  # a wait for an eval that never comes fails, never hangs
    assert StoreGroups(args, store, world).final_eval(3) == {}  # evaluation off: nothing to wait for
    assert source.rollout_memory_gib() == 0.0  # none posted yet: the record logs none
    store.set("memory/0", "2.5")
    assert source.rollout_memory_gib() == 2.5


STEP_CYCLE = ["generate", "sleep:1", "wake:weights", "load_weights", "wake:kv_cache"]


def test_colocated_engine_sleeps_from_the_chunk_until_the_refit_after_the_critic(tiny_path, world, tmp_path,
                                                                                   monkeypatch):
    """Colocated full batch (S13): the engine generates awake, then sleeps through the policy chunk and
    the critic epochs, and wakes only for the refit that follows critic training; every step the same."""
    from minirl.stream import TrainPump
    args = small_ppo_args(tmp_path, steps=2)
    source, engine = colocated_source(args, world, monkeypatch)
    seen = []
    chunk, critic = TrainPump.chunk, TrainPump._train_critic
    monkeypatch.setattr(TrainPump, "chunk", lambda self, c: (seen.append(("chunk", engine.state)), chunk(self, c))[1])
    monkeypatch.setattr(TrainPump, "_train_critic",
                        lambda self: (seen.append(("critic", engine.state)), critic(self))[1])
    recs = train_in_process(args, tiny_path, world, source)
    assert seen == [("chunk", "asleep"), ("critic", "asleep")] * 2
    assert engine.log == STEP_CYCLE * 2 + ["sleep:1"]  # the run's end hands the card to the export
    assert engine.asked == [list(range(args.ppo.num_prompts_per_step))] * 2  # one rank: every group of the step
    assert not [r for r in recs if "rollout_memory_peak_gib" in r]  # each engine is in its own rank's peak


def test_a_failing_colocated_run_puts_its_engine_to_sleep_closes_it_and_raises_its_own_error(tiny_path, world,
                                                                                            tmp_path, monkeypatch):
    """B24 in PPO's colocated placement: a failure while the engine is awake (step 1's sampling) sends it to
    sleep and closes it, and the error raised is the one that stopped the run."""
    args = small_ppo_args(tmp_path, steps=2)
    source, engine = colocated_source(args, world, monkeypatch)
    calls, closed, generate = [], [], engine.generate

    def failing_at_step_1(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("sampling failed")
        return generate(*a, **k)

    engine.generate, engine.close = failing_at_step_1, lambda: closed.append(1)
    with pytest.raises(RuntimeError, match="sampling failed"):
        train_in_process(args, tiny_path, world, source)
    assert engine.log[-2:] == ["wake:kv_cache", "sleep:1"] and engine.state == "asleep" and closed == [1]


def test_a_colocated_engine_that_fails_to_build_after_the_trainer_raises_its_own_error(tiny_path, world, tmp_path,
                                                                                       monkeypatch, capsys):
    """B24 at start-up: colocated PPO builds its engine after the trainer's models (as GRPO does); when that
    build fails (vLLM's memory check, say), the build's error is raised, and the clean-up, with no engine to
    sleep or close, reports no failure of its own."""
    args = small_ppo_args(tmp_path, steps=2)
    source, _ = colocated_source(args, world, monkeypatch)

    def out_of_memory():
        raise ValueError("Free memory on device is less than desired GPU memory utilization")

    source.build_engine = out_of_memory
    with pytest.raises(ValueError, match="Free memory on device"):
        train_in_process(args, tiny_path, world, source)
    assert source.engine is None and "also failed" not in capsys.readouterr().err


def test_a_resumed_colocated_run_sleeps_the_engine_loads_then_publishes_before_sampling(tiny_path, world, tmp_path,
                                                                                       monkeypatch):
    """B25 in PPO's colocated placement: the engine sleeps before the checkpoint is loaded, and the
    restored policy is published (weights woken, loaded, KV cache woken) before the first generate."""
    from minirl import checkpoint, models
    parts = {k: (m, models.adamw(m, 1e-4, 0.01)) for k in ("policy", "value")
             for m in [models.sharded(tiny_path, k, world, "float32")]}
    ckpt = checkpoint.save(str(tmp_path / "ckpt"), 1, parts, {}, keep=2)
    args = small_ppo_args(tmp_path / "run", steps=2)
    source, engine = colocated_source(args, world, monkeypatch)
    load = checkpoint.load
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: (engine.log.append("load"), load(*a, **k))[1])
    train_in_process(args, tiny_path, world, source, resume=ckpt)
    assert engine.log[:6] == ["sleep:1", "load", "wake:weights", "load_weights", "wake:kv_cache", "generate"]


def slow_count(tmp_path, seconds: float) -> str:
    """A --task.reward: the built-in reward (its metric still `reward/count`), slowed by `seconds` a completion
    as a judge is, so a step's groups arrive over time whatever the machine's load."""
    (tmp_path / "slow.py").write_text("import time\nfrom minirl import rewards\n\n"
                                      "def count(completion, answer):\n"
                                      f"    time.sleep({seconds})\n    return rewards.count(completion, answer)\n")
    return f"{tmp_path}/slow.py:count"


@e2e
def test_streamed_run_trains_on_several_chunks_per_step(tmp_path):
    """Also the guard of the rollout rank's device rule: its engine's default group is made to report
    NCCL, as vLLM's CUDA worker leaves it, and refuses every collective (tests/dist/ppo_on_nccl_rollout.py),
    so a collective minirl runs on a rollout rank (sampling, evals, memory, refits, the stop) fails it.
    The reward is the built-in one, slowed (as a judge is) so a call's 2 groups are ready 0.4 s after the
    call's before them whatever the machine's load (two test files at a time once met one chunk)."""
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "tests/dist/ppo_on_nccl_rollout.py", "--task.reward", slow_count(tmp_path, 0.05),
             "--steps", "3", "--ppo.num-prompts-per-step", "8", "--ppo.num-generations-per-prompt", "4",
             "--async-rl.min-groups-for-streaming-train", "2", "--async-rl.rollout-groups-per-call", "2",
             "--async-rl.sampler.max-lookahead-versions", "0", "--ppo.critic-ppo-epochs", "2",
             "--log.eval-every", "2", "--log.train-samples", "2", "--log.run-dir", str(tmp_path)])
    assert p.returncode == 0
    chunk_lines = [line for line in p.stdout.splitlines() if line.startswith("train_pump: step 0 chunk")]
    assert len(chunk_lines) > 1  # lookahead 0: step 0's groups arrive in waves, and training starts on the first
    assert "train_pump: step 0 closing on" in p.stdout
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in recs if "reward_mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["value_epoch_n"] == 8 * 4  # the critic sees every sample once per epoch (S3)
        assert r["ppo_chunks"] >= 1 and "ppo_loss" in r and "value_loss" in r
        for key in ("reward_std", "frac_reward_zero_std", "completion_len_min", "completion_clip_ratio", "entropy",
                    "lr", "logprob_gap", "memory_peak_gib", "value_grad_norm", "value_explained_var",
                    "advantages_mean", "returns_mean", "values_mean"):
            assert key in r, key
    assert all(r["reward/count"] == pytest.approx(r["reward_mean"]) for r in steps)
    evals = [r for r in recs if "eval_accuracy" in r]  # scored on the rollout rank, sent through the store
    assert [r["eval_version"] for r in evals] == [0, 2, 3]
    rows = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    trained = [r for r in rows if r.get("split") == "train"]  # --log.train-samples 2, from the trainer's groups
    assert [r["step"] for r in trained] == [0, 0, 1, 1, 2, 2]
    assert all(r["prompt"].endswith("#a=") and r["reward"] == r["rewards"]["count"] for r in trained)
    rows = [r for r in rows if "split" not in r]
    assert [r["eval_version"] for r in rows[::128]] == [0, 2, 3] and len(rows) == 3 * 128
    assert evals[-1]["eval_accuracy"] == pytest.approx(sum(r["reward"] for r in rows[-128:]) / 128)
    assert sum(line.startswith("  sample (version") for line in p.stdout.splitlines()) == 2 * 3
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert all(r["memory_peak_gib"] >= r["rollout_memory_peak_gib"] > 0.1 for r in steps)  # the engines' too


@e2e
@pytest.mark.dist
def test_eight_ranks_two_rollout_six_train_consume_every_group_once_in_aligned_chunks(tmp_path):
    """The world users launch: torchrun --nproc-per-node 8 with 2 rollout ranks and 6 train ranks
    (one thread each). Chunks are whole multiples of the 6 train ranks, each step consumes its 12
    groups exactly once, some step streams in more than one chunk, and both rollout ranks take
    every policy version over the refit group. The reward is slow (as a judge or a sandbox is), so
    a step's groups arrive over seconds whatever the machine's load: the trainer, polling every few
    milliseconds, meets the first 6 before the last."""
    P, G, dp = 12, 2, 6
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m", "minirl.ppo",
             "--task.reward", slow_count(tmp_path, 0.25),
             "--grid.rollout-ranks", "2", "--steps", "3", "--ppo.num-prompts-per-step", str(P),
             "--ppo.num-generations-per-prompt", str(G), "--async-rl.min-groups-for-streaming-train", "6",
             "--async-rl.rollout-groups-per-call", "1", "--async-rl.sampler.max-lookahead-versions", "0",
             "--log.eval-every", "0", "--log.run-dir", str(tmp_path)], timeout=900)
    assert p.returncode == 0
    chunks = [tuple(map(int, c)) for c in re.findall(r"train_pump: step (\d+) chunk \d+ groups=(\d+) rows=(\d+)",
                                                     p.stdout)]
    for step in range(3):
        mine = [(groups, rows) for s, groups, rows in chunks if s == step]
        assert sum(groups for groups, _ in mine) == P
        assert all(groups % dp == 0 and rows == groups * G // dp for groups, rows in mine)
    assert max(sum(1 for s, _, _ in chunks if s == step) for step in range(3)) > 1
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "reward_mean" in line]
    assert [r["groups_consumed"] for r in recs] == [P] * 3
    for rank in (0, 1):
        loaded = re.findall(rf"rollout rank {rank}: loaded policy version (\d+)", p.stdout)
        assert loaded == ["1", "2", "3"], loaded


def test_store_blobs_over_the_8_mib_store_limit_go_in_parts_and_are_dropped_whole():
    from minirl.refit import PART_BYTES, drop, put, take
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, use_libuv=True)  # port 0: any free one
    blob = bytes(range(256)) * (9 * 2**20 // 256 + 7)  # 9 MiB: one set() of it is refused by the store
    put(store, "version/3", blob)
    assert int(store.get("version/3")) == -(-len(blob) // PART_BYTES) and take(store, "version/3") == blob
    drop(store, "version/3")
    assert not store.check(["version/3"]) and not store.check(["version/3/0"])
    put(store, "version/4", b"")  # critic warmup: a version without weights
    assert take(store, "version/4") == b""


def test_the_controller_reads_a_groups_version_from_its_note_never_the_group():
    """Train rank 0 polls every finished group for its version: a few bytes, not the group (a 1 MiB group read
    twice, once here and once by the rank that trains on it); it reads only its own share."""
    from minirl.dist import World
    from minirl.placement import _next_chunk
    from minirl.refit import noted, put
    from minirl.sampler import ReadyGroups
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, use_libuv=True)
    put(store, "group/3/0", b"not a group: never read here", note="2")
    put(store, "group/3/1", b"", note="1")  # version 1 at step 3: too stale
    assert noted(store, "group/3/0") == "2"
    ready, waiting = ReadyGroups(num_prompts=2, min_groups=1), {0}
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert _next_chunk(store, ready, waiting, 3, world) == [0] and waiting == set()
    with pytest.raises(RuntimeError, match="group 1 of step 3 was sampled by version 1: too stale"):
        _next_chunk(store, ready, {1}, 3, world)


def test_one_process_is_refused_naming_the_launch(tmp_path):
    p = run([sys.executable, "-m", "minirl.ppo", "--log.run-dir", str(tmp_path)], timeout=120)
    assert p.returncode == 2 and "--nproc-per-node" in p.stderr


SMALL = ["--ppo.num-prompts-per-step", "8", "--ppo.num-generations-per-prompt", "4", "--log.eval-every", "0"]


def ppo(nproc, run_dir, *flags, env=None):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run([*(launch if nproc > 1 else [sys.executable]), "-m", "minirl.ppo", *SMALL, "--log.run-dir",
                str(run_dir), *flags], env=env)


def steps_logged(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "reward_mean" in line]


@e2e
def test_two_train_ranks_stream_checkpoint_between_steps_and_resume(tmp_path):
    """1 rollout + 2 train ranks: chunks stay aligned to the DP size, the critic sees P x G samples,
    checkpoints land only between steps (counters already advanced) and a resume continues (S11, S21).
    The first launch starts over an old run (--log.overwrite) and claims the run directory late
    (tests/dist/ppo_late_claim.py): train rank 0 claims it, the rollout rank waits for the claim before it
    writes its engine log, and each checkpoint carries the run's identity."""
    flags = ["--async-rl.min-groups-for-streaming-train", "2", "--async-rl.sampler.max-lookahead-versions", "0",
             "--checkpoint.every", "1"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n')
    (tmp_path / "run.json").write_text('{"run": "old", "line": "old", "from": 0}')
    (tmp_path / "engine.log").write_text("the old run's engine\n")
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
             "tests/dist/ppo_late_claim.py", *SMALL, "--log.run-dir", str(tmp_path), "--steps", "2", *flags,
             "--log.overwrite"])
    assert p.returncode == 0
    owner = json.loads((tmp_path / "run.json").read_text())
    assert owner["run"] != "old" and [r["step"] for r in steps_logged(tmp_path)] == [0, 1]
    engine_log = (tmp_path / "engine.log").read_text()  # removed with the old run's, had it been opened first
    assert "the old run's" not in engine_log and "vLLM" in engine_log
    for step in (1, 2):
        state = json.loads((tmp_path / "checkpoints" / f"step_{step:08d}" / "loop_state.json").read_text())
        assert (state["run"], state["line"], state["run_dir"]) == (owner["run"], owner["line"], str(tmp_path))
    chunks = [line for line in p.stdout.splitlines() if line.startswith("train_pump: step 0 chunk")]
    assert chunks and all(int(line.split("groups=")[1].split()[0]) % 2 == 0 for line in chunks)
    ckpts = tmp_path / "checkpoints"
    assert checkpoint_names(ckpts) == ["step_00000001", "step_00000002"]
    assert all((ckpts / d / "COMPLETE").exists() for d in checkpoint_names(ckpts))
    p = ppo(3, tmp_path, "--steps", "3", *flags, "--checkpoint.resume", "auto")
    assert p.returncode == 0 and "resumed from" in p.stdout and "step_00000002" in p.stdout
    recs = steps_logged(tmp_path)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert all(r["value_epoch_n"] == 8 * 4 for r in recs)


@e2e
def test_a_run_stopped_after_its_last_step_resumes_to_finish_it_logging_each_eval_once(tmp_path):
    """A SIGTERM in the last step: the emergency save holds every step, and the run ends without its export.
    A resume with the same --steps trains nothing and finishes the run: final/ is written (the resume was
    refused, "nothing is left to train"). The rollout side scores the resumed version again; a version the
    kept history logged already is not logged twice."""
    flags = ["--steps", "2", "--log.eval-every", "1", "--task.eval-prompts", "4",
             "--async-rl.min-groups-for-streaming-train", "2"]
    p = ppo(2, tmp_path, *flags, env={"MINIRL_FAULT": "sigterm:1"})
    assert p.returncode == 0 and "SIGTERM: saved" in p.stdout and not (tmp_path / "final").exists()
    p = ppo(2, tmp_path, *flags, "--checkpoint.resume", "auto")
    assert p.returncode == 0 and "--steps=2: every step is done; finishing the run" in p.stdout
    assert (tmp_path / "final" / "model.safetensors").exists() and len(steps_logged(tmp_path)) == 2
    card = (tmp_path / "final" / "README.md").read_text()  # the last eval, from the history the resume kept
    assert re.search(r"\| held-out accuracy \(greedy, last evaluation\) \| \d\.\d{4} \|", card)
    versions = [json.loads(line)["eval_version"] for line in open(tmp_path / "metrics.jsonl") if "eval_version" in line]
    assert versions == [0, 1, 2]


COLOCATED = ["--grid.gpu-placement", "colocated", "--async-rl.min-groups-for-streaming-train", "8",
             "--ppo.ppo-epochs", "2", "--ppo.critic-ppo-epochs", "2", "--checkpoint.every", "1", "--steps", "3",
             "--log.eval-every", "2", "--task.eval-prompts", "16"]


def strip(r):
    return {k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s", "memory"))}


def final_weights(d):
    return load_file(d / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def colocated_straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("colocated_straight")
    assert ppo(1, d, *COLOCATED).returncode == 0
    return d


@e2e
def test_colocated_full_batch_with_two_policy_epochs_resumes_exactly(colocated_straight, tmp_path):
    """One process generates and trains; the engine sleeps through both updates and wakes at the
    refit after critic training. Resuming from the step-2 checkpoint reproduces step 2 and the final policy.
    The one engine's own output is in engine.log (per-rank names are for several engines)."""
    straight = colocated_straight
    assert (straight / "engine.log").stat().st_size > 0 and not list(straight.glob("engine_rank*.log"))
    p = ppo(1, tmp_path, *COLOCATED, "--checkpoint.resume", str(straight / "checkpoints" / "step_00000002"))
    assert p.returncode == 0
    a, b = steps_logged(straight), steps_logged(tmp_path)
    assert [r["step"] for r in a] == [0, 1, 2] and [r["step"] for r in b] == [2]
    assert strip(a[2]) == strip(b[0])
    wa, wb = final_weights(straight), final_weights(tmp_path)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@e2e
def test_two_colocated_ranks_match_one(colocated_straight, tmp_path):
    """torchrun --nproc-per-node 2 --grid.gpu-placement colocated: an engine and an FSDP2 shard of policy and
    critic on each rank, each rank generating its half of the groups, reach what one process reaches: the
    rewards, the losses, the per-token rates weighted by each rank's tokens (B13), the final weights."""
    p = ppo(2, tmp_path, *COLOCATED)
    assert p.returncode == 0, p.stderr[-3000:]
    one, two = steps_logged(colocated_straight), steps_logged(tmp_path)
    assert [r["reward_mean"] for r in one] == [r["reward_mean"] for r in two]
    for key in ("ppo_loss", "value_loss", "ppo_clipfrac", "value_clipfrac", "entropy"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-4, abs=1e-6), key
    assert {f.name for f in tmp_path.glob("engine*.log")} == {"engine_rank0.log", "engine_rank1.log"}
    a, b = final_weights(colocated_straight), final_weights(tmp_path)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@e2e
@pytest.mark.parametrize("point", ["kill_mid_file", "kill_in_save", "sigterm"])
def test_kill_during_a_save_resumes_from_the_newest_complete_checkpoint(colocated_straight, tmp_path, point):
    """kill -9 while step 2's checkpoint is written (a data file cut short; the data complete, no
    marker), or a SIGTERM in step 1 (its emergency save): the resume takes step 1's, and the run ends
    exactly as the uninterrupted one: every metric (the eval schedule after the resume among them),
    samples.jsonl, the final weights, the last checkpoint's loop and RNG state."""
    import signal
    p = ppo(1, tmp_path, *COLOCATED, env={"MINIRL_FAULT": f"{point}:{1 if point == 'sigterm' else 2}"})
    if point == "sigterm":
        assert p.returncode == 0 and "SIGTERM: saved" in p.stdout
        assert checkpoint_names(tmp_path / "checkpoints") == ["step_00000001", "step_00000002"]
    else:
        assert p.returncode == -signal.SIGKILL
        assert checkpoint_names(tmp_path / "checkpoints") == ["step_00000001", "step_00000002.tmp"]
    p = ppo(1, tmp_path, *COLOCATED, "--checkpoint.resume", "auto")
    assert p.returncode == 0 and f"step_0000000{2 if point == 'sigterm' else 1}" in p.stdout
    assert [strip(r) for r in steps_logged(colocated_straight)] == [strip(r) for r in steps_logged(tmp_path)]
    assert everything(tmp_path) == everything(colocated_straight)


@e2e
def test_colocated_ppo_trains_a_family_vllm_serves_by_rewriting_its_classes(neox_path, tmp_path):
    """vLLM serves GPT-NeoX through its Transformers backend, which rewrites the model's transformers classes in
    the engine's process as the engine is built. Colocated PPO built its engine first, and its trainer's first
    load then failed in vLLM's config assertion; the trainer is built first now, as in GRPO, and the engine's
    logprobs stay the trainer's pi_old to float32 rounding after an update."""
    reward = tmp_path / "distinct.py"
    reward.write_text("def distinct(completion, answer):\n    return len(set(completion)) / 8\n")  # differs by row
    p = ppo(1, tmp_path / "run", "--model.path", neox_path, "--task.reward", f"{reward}:distinct", "--steps", "2",
            "--grid.gpu-placement", "colocated", "--async-rl.min-groups-for-streaming-train", "8", "--ppo.lr", "1e-2")
    assert p.returncode == 0, p.stderr[-2000:]
    first, second = steps_logged(tmp_path / "run")
    assert first["grad_norm"] > 0 and first["logprob_gap"] < 1e-5 and second["logprob_gap"] < 1e-5


@e2e
@pytest.mark.serial  # a bound on the wall clock: it runs with no other test beside it
def test_when_a_train_rank_dies_the_rollout_rank_leaves_within_seconds(tmp_path):
    """kill -9 of train rank 0 (the controller, the heartbeat's owner) at step 1: torchrun SIGTERMs the
    other ranks; the rollout rank sees the trainer gone, closes its engine and leaves, the other
    train rank's collectives fail; everything is down well before torchrun's 30 s SIGKILL."""
    import subprocess
    import time
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "-m", "minirl.ppo",
           *SMALL, "--steps", "50", "--log.run-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, env={**base, "MINIRL_FAULT": "kill_train_rank0:1", "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and "reward_mean" in metrics.read_text()):
        time.sleep(0.2)
    t_step0 = time.time()
    out, err = proc.communicate(timeout=120)
    took = time.time() - t_step0
    assert proc.returncode != 0 and "rollout rank 0: engine closed" in out
    assert "closing signal SIGKILL" not in err, err[-3000:]  # torchrun never had to escalate
    assert took < 20, f"{took:.1f} s from step 0's record to the last rank's exit"


@e2e
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_sigterm_saves_between_steps_and_every_rank_exits(tmp_path, placement):
    """SIGTERM (to torchrun, which passes it on, or to the one colocated process): a rollout rank
    keeps serving, the trainer finishes its step, saves a complete checkpoint of the steps done
    (S11) and every rank exits."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
              if placement == "disaggregated" else [sys.executable])
    mode = (["--async-rl.min-groups-for-streaming-train", "2"] if placement == "disaggregated" else
            ["--grid.gpu-placement", "colocated", "--async-rl.min-groups-for-streaming-train", "8"])
    code, err = sigterm_after([*launch, "-m", "minirl.ppo", *SMALL, "--steps", "500", *mode, "--log.run-dir",
                               str(tmp_path)], str(tmp_path / "metrics.jsonl"), records=2)
    assert "SIGTERM: saved" in err, err[-3000:]
    last = steps_logged(tmp_path)[-1]["step"]
    ckpt = tmp_path / "checkpoints" / f"step_{last + 1:08d}"
    assert checkpoint_names(tmp_path / "checkpoints") == [ckpt.name] and (ckpt / "COMPLETE").exists()
    assert "SIGKILL" not in err  # nobody had to be killed: the rollout rank left at the trainer's stop
    if placement == "colocated":
        assert code == 0


def test_colocated_critic_and_reference_are_off_the_card_whenever_the_engine_is_awake(tiny_path, world, tmp_path,
                                                                                     monkeypatch):
    """Colocated PPO with a KL reference: policy, critic (with their optimizers) and reference are all
    off the card from the moment the engine generates until it sleeps. The old pump onloaded the critic
    when it was built, before the step's generate, and the reference never left."""
    from test_offload import on_card_while_awake, record_residency
    args = small_ppo_args(tmp_path, steps=2)
    args.ppo.kl_coef = 0.1
    source, engine = colocated_source(args, world, monkeypatch)
    record_residency(monkeypatch, engine.log)
    train_in_process(args, tiny_path, world, source)
    assert on_card_while_awake(engine.log, {"policy", "value", "ref"}) == []
    assert engine.log.count("generate") == 2 and engine.log.count("onload:value") >= 2


def test_a_trainer_that_fails_lets_the_rollout_ranks_leave_at_once_and_keeps_its_own_error(world):
    """`StoreGroups.cleanup`, which `Run.guard` calls when the trainer raises (not dies): `stop` is set, so the
    rollout ranks leave their waits now rather than when the trainer's heartbeat falls silent; a store that is
    gone already never replaces the trainer's own error."""
    from minirl.placement import StoreGroups, _Term

    store = torch.distributed.HashStore()
    StoreGroups(PPOArgs(), store, world).cleanup()
    assert store.check(["stop"]) and store.get("stop") == b"1" and _Term(store, 1).trainer_gone()

    class Gone:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")
    StoreGroups(PPOArgs(), Gone(), world).cleanup()  # nothing raised
