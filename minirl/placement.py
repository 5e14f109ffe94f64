"""Where PPO's groups come from: the two placements behind `ppo.train` (S13, S23; the walk-through is
docs/guide-streaming.md). Both are group sources with the same few calls: `start`, `chunks(step, ready)`
(yields the groups taken and this rank's group tensors), `refit`, `times`, `release`, `evals`,
`final_eval`, `save`, `rollout_memory_gib`, `stop`, `cleanup`, `close`.

- disaggregated: `StoreGroups` on the train ranks, `rollout_rank` on ranks [0, R). Rollout rank r
  generates the step's groups i with i % R == r, a few per vLLM call, and puts each finished group on
  the run's TCPStore; before every call it takes the versions the trainer announced, in order, and
  waits for version >= s - max_lookahead_versions (S23). Train rank 0 polls (each group's version from the
  note beside it, never the group), asks the sampler for the next chunk (S16) and tells the other train
  ranks which groups it took. Weights go over the refit group (refit.py); the store only announces them.
- colocated (`EngineGroups`, full batch only): every rank generates its share with its own engine,
  which sleeps through the whole update until the refit after critic training (S13).

Groups cross the store as safetensors bytes (`refit.put`, `refit.take`): nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from minirl import dist, models, refit
from minirl.batch import as_group
from minirl.config_ppo import PPOArgs
from minirl.logger import engine_log, memory_peak_gib
from minirl.offload import HandOff, Together
from minirl.refit import drop, noted, put, take
from minirl.rollout import Engine
from minirl.sampler import Group, ReadyGroups
from minirl.tasks import held_out, prompt_id, scored

POLL_S = 0.005


# ---- disaggregated: groups cross a TCPStore, weights the refit group ----

class StoreGroups:
    """The train side of disaggregated placement. Store keys: `weights/manifest`, `start`, `version/{v}`
    ("1": weights follow on the refit group), `group/{s}/{i}`, `loaded/{r}`, `eval/{v}`, `stop`."""

    colocated = False

    def __init__(self, args: PPOArgs, store, world: dist.World):
        self.args, self.store, self.world = args, store, world
        self.dtype = models.DTYPES[args.model.dtype]  # the engine's dtype; the masters are float32
        self.next_eval, self.last_eval, self.start_step = 0, -1, 0
        self.t = {}  # this step's moments: its start, its first chunk, its last group ready (the controller's)
        self.published: list[int] = []  # version keys still in the store
        self.group, self.buckets, self.say, self.write = None, [], print, None

    def start(self, step: int, policy, offload, load=None, say=print, write=None, logged_eval=-1) -> None:
        """`logged_eval`: a resumed run's newest eval version in its history; the rollout side scores the
        resumed version again (its eval may have come after the checkpoint), logged only if it is newer."""
        self.say, self.write, self.start_step = say, write, step
        if load is not None:  # a resumed run: no engine shares this card
            load()
        say("waiting for the rollout ranks to build their engines ...")
        if self.world.is_main:  # the refit group's rendezvous waits for the rollout ranks' engines
            self.buckets = refit.manifest(policy, self.dtype)
            self.store.set("weights/manifest", json.dumps(self.buckets))
            addr = refit.host_address(self.store.underlying_store.host)  # named by a rollout rank that loses it
            self.store.set("trainer/addr", addr)
            threading.Thread(target=_heartbeat, args=(refit.store_client(self.store),), daemon=True).start()
            self.group = refit.refit_group(self.store, 0, self.args.grid.rollout_ranks + 1, self.world.device)
            self.store.set("start", str(step))
        if step:  # resumed: the rollout ranks start from the restored weights
            self.refit(step, policy)
        self.last_eval, self.next_eval = logged_eval, self._due(max(step, logged_eval + 1))

    def chunks(self, step: int, ready: ReadyGroups):
        waiting, dp = set(range(ready.num_prompts)), self.world.world_size
        self.t = {"start": time.perf_counter()}
        if step == self.start_step:
            self.say(f"step {step}: waiting for the first completed groups from the rollout ranks ...")
        while ready.remaining:
            taken = _next_chunk(self.store, ready, waiting, step, self.world)  # (groups,) on every rank
            if not waiting:
                self.t.setdefault("all_ready", time.perf_counter())
            if not taken:
                time.sleep(POLL_S)  # the value model stays resident across empty selections (S12)
                continue
            self.t.setdefault("first", time.perf_counter())
            yield len(taken), [st_load(take(self.store, f"group/{step}/{i}")) for i in taken[self.world.rank::dp]]

    def times(self) -> dict:
        """The step's wait for its first chunk, and its tail (its last group ready to now, the update done;
        bench/streaming.py). Only the controller, which polls, has a tail."""
        now = time.perf_counter()
        out = {"time/wait_first_chunk": self.t.get("first", now) - self.t.get("start", now)}
        if "all_ready" in self.t:
            out["time/tail"] = now - self.t["all_ready"]
        return out

    def refit(self, version: int, policy) -> None:
        """Announce `version`; gather the full policy (a collective over the train ranks) and send it
        to every rollout rank over the refit group. `policy=None` (critic warmup): a version bump only."""
        if self.world.is_main:
            self.store.set(f"version/{version}", "0" if policy is None else "1")  # rollout ranks join the broadcast
            self.published.append(version)
        if policy is not None:
            named = dist.full_parameters(policy, self.dtype)  # every train rank takes part in the gather
            if self.world.is_main:
                refit.send(self.group, self.buckets, named)
            else:
                for _ in named:
                    pass
        if self.world.is_main:  # drop the announcements every rollout rank has taken
            loaded = [int(self.store.get(k)) if self.store.check([k]) else 0
                      for k in (f"loaded/{r}" for r in range(self.args.grid.rollout_ranks))]
            while self.published and self.published[0] <= min(loaded):
                self.store.delete_key(f"version/{self.published.pop(0)}")

    def release(self, step: int) -> None:
        if self.world.is_main:
            for i in range(self.args.ppo.num_prompts_per_step):
                drop(self.store, f"group/{step}/{i}")

    def evals(self, version: int) -> dict:
        """The held-out scores the rollout side has posted since the last call (it scores versions
        asynchronously), in order: the newest for the step's record, an older one a record of its own."""
        out = {}
        while self.world.is_main and self.next_eval <= self.args.steps and self.store.check([f"eval/{self.next_eval}"]):
            if out:
                self.write(out["eval_version"], out)
            out = self._eval(self.next_eval)
            self.next_eval = self._due(self.next_eval + 1)
        return out

    def final_eval(self, steps: int) -> dict:
        if not (self.world.is_main and self.args.log.eval_every) or self.last_eval == steps:  # logged already
            return {}
        self.store.wait([f"eval/{steps}"])  # posted in order: every due version before it is there too
        return self.evals(steps)

    def _due(self, first: int) -> int:
        """The first version from `first` on that is scored (`LogConfig.evaluates`), else steps + 1."""
        steps = self.args.steps
        return next((v for v in range(first, steps + 1) if self.args.log.evaluates(v, steps)), steps + 1)

    def _eval(self, version: int) -> dict:
        scored = json.loads(take(self.store, f"eval/{version}"))
        drop(self.store, f"eval/{version}")
        self.last_eval = version
        return {**scored, "eval_version": version}

    def save(self, fn) -> None:
        fn()

    def rollout_memory_gib(self) -> float:
        """The largest memory peak the rollout ranks have posted (`memory/{r}`; controller only)."""
        keys = [f"memory/{r}" for r in range(self.args.grid.rollout_ranks)]
        return max([float(self.store.get(k)) for k in keys if self.world.is_main and self.store.check([k])] or [0.0])

    def stop(self) -> None:
        if self.world.is_main:
            self.store.set("stop", b"1")  # lets the rollout ranks leave their waits

    def cleanup(self) -> None:
        """The trainer failed: let the rollout ranks leave their waits now rather than at a timeout."""
        with contextlib.suppress(Exception):  # the store may be gone; never mask the real error
            self.stop()

    def close(self) -> None:
        pass


def rollout_rank(ready, roles: refit.Roles, store) -> None:
    """A rollout rank's whole run: each step's groups as the trainer's versions allow (S23), every refit,
    the due evals (global rank 0), until the trainer stops. No collective: its default group is its
    engine's world of one."""
    args, task, tok = ready.args, ready.task, ready.tok
    P, R = args.ppo.num_prompts_per_step, args.grid.rollout_ranks
    term = _Term(store, roles.global_rank)
    engine = Engine(ready.path, args.rollout, args.rollout.max_model_len, roles.devices.engine,
                    dtype=args.model.dtype, seed=args.seed, private=True,
                    log_file=engine_log(args.log, roles.global_rank, R > 1))
    try:
        group = refit.refit_group(store, roles.global_rank + 1, R + 1, roles.devices.engine)
        buckets = json.loads(store.get("weights/manifest"))
        limit = args.rollout.max_prompt_tokens

        def evaluate(version: int) -> None:  # global rank 0 scores the run's eval versions, each as it arrives
            if roles.global_rank == 0 and args.log.evaluates(version, args.steps):
                scores = held_out(engine, task, tok, limit, version=version)
                put(store, f"eval/{version}", json.dumps(scores).encode())  # never unpickled

        if not term.wait("start"):  # the trainer builds (and maybe restores) its models first
            return
        start = int(store.get("start"))
        version = max(start - 1, 0)      # a resumed run's weights arrive as version/{start}
        if start == 0:
            evaluate(0)                  # the starting weights
        mine = [i for i in range(P) if i % R == roles.global_rank]
        k, peak = args.async_rl.rollout_groups_per_call, 0.0
        for step in range(start, args.steps):
            for first in range(0, len(mine), k):
                need = step - args.async_rl.sampler.max_lookahead_versions  # S23
                version = _catch_up(engine, store, group, buckets, version, need, roles, evaluate, term)
                if version is None:
                    return  # the trainer stopped: --log.target-eval-accuracy, SIGTERM, a failure
                for i, g in _generate(engine, task, tok, mine[first:first + k], step, args, version):
                    put(store, f"group/{step}/{i}", st_save(g), note=str(version))  # the controller reads the note
                peak = max(peak, memory_peak_gib(roles.devices.engine, over_ranks=False))  # the trainer takes the max
                store.set(f"memory/{roles.global_rank}", str(peak))
        version = _catch_up(engine, store, group, buckets, version, args.steps, roles, evaluate, term)  # the last refit
        if version is None:
            return
        term.wait("stop")  # outside torchrun global rank 0 hosts the store: it must outlive the trainer's last use
    finally:
        engine.close()
        print(f"rollout rank {roles.global_rank}: engine closed", flush=True)


HEARTBEAT_S = 1.0
PEER_TIMEOUT_S = 30.0  # a trainer unheard of for this long is gone: its process, or its whole node


def _heartbeat(client) -> None:
    """Train rank 0 says it is alive every second, on a store client of its own (a daemon thread).
    It counts beats rather than sending its clock: the hosts' clocks need not agree."""
    beat = 0
    while True:
        beat += 1
        client.set("trainer/alive", str(beat))
        time.sleep(HEARTBEAT_S)


class _Term:
    """When a rollout rank stops serving. On SIGTERM it serves on while the trainer saves and sets `stop`;
    it leaves within seconds once the trainer sets `stop` or its heartbeat stops, and raises PeerLost
    (exit 4) after PEER_TIMEOUT_S without a beat from a trainer on another node."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank
        self.at = None                       # when SIGTERM came (monotonic)
        self.beat, self.heard = None, None   # the last beat seen, and when it changed (this host's clock)
        self.next_look = 0.0
        for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C reaches every rank: serve on while the trainer saves
            signal.signal(sig, lambda *_: setattr(self, "at", self.at or time.monotonic()))

    def trainer_gone(self) -> bool:
        if self.store.check(["stop"]):
            return True
        now = time.monotonic()
        if now >= self.next_look and self.store.check(["trainer/alive"]):
            self.next_look = now + HEARTBEAT_S
            beat = self.store.get("trainer/alive")
            if beat != self.beat:
                self.beat, self.heard = beat, now
        if self.at is not None:  # SIGTERM: the trainer is gone once it has been silent for a few beats
            return now - max(self.heard or self.at, self.at) > 5 * HEARTBEAT_S
        if self.heard is not None and now - self.heard > PEER_TIMEOUT_S:
            addr = self.store.get("trainer/addr").decode() if self.store.check(["trainer/addr"]) else "?"
            raise dist.PeerLost(f"rollout rank {self.rank} lost train rank 0 at {addr}: no heartbeat for "
                                f"{now - self.heard:.0f} s (its process is gone or stopped, or its node unreachable)")
        return False

    def wait(self, key: str) -> bool:
        """Wait for `key`; False if the trainer is gone first (`stop` itself counts as there)."""
        while not self.store.check([key]):
            if self.trainer_gone():
                return key == "stop"
            time.sleep(POLL_S * 10)
        return True


def _catch_up(engine: Engine, store, group, buckets, version: int, need: int, roles: refit.Roles,
              evaluate, term: _Term) -> int | None:
    """Take every announced version since `version` in order (a weighted one is a broadcast straight into
    the engine), then wait for version >= `need`. The version now in the engine, or None once the
    trainer stopped."""
    while True:
        while store.check([f"version/{version + 1}"]):
            version += 1
            if store.get(f"version/{version}") == b"1":
                engine.load_weights(refit.receive(group, buckets))
                print(f"rollout rank {roles.global_rank}: loaded policy version {version}", flush=True)
            store.set(f"loaded/{roles.global_rank}", str(version))  # the trainer may drop the announcement
            evaluate(version)
        if term.trainer_gone():
            return None
        if version >= need:
            return version
        time.sleep(POLL_S)


def _next_chunk(store, ready: ReadyGroups, waiting: set, step: int, world: dist.World) -> list[int]:
    """Controller: poll the store and ask the sampler; every train rank gets the same answer."""
    taken = torch.full((ready.num_prompts,), -1, dtype=torch.long)
    if world.is_main:
        for i in sorted(waiting):
            key = f"group/{step}/{i}"
            if store.check([key]):
                version = int(noted(store, key))  # not the group itself: a train rank reads its own share
                if not ready.add(Group(i, version), step):
                    raise RuntimeError(f"group {i} of step {step} was sampled by version {version}: too stale")
                waiting.discard(i)
        chunk = [g.index for g in ready.take()]
        taken[:len(chunk)] = torch.tensor(chunk, dtype=torch.long)
    if world.world_size > 1:
        dist.broadcast(taken, src=0)
        if not world.is_main:  # mirror the controller's bookkeeping
            for i in taken[taken >= 0].tolist():
                ready.claimed[i] = Group(i, -1)
    return taken[taken >= 0].tolist()


# ---- colocated full batch: every rank's own engine, asleep through the update ----

class EngineGroups:
    """Colocated placement (full batch only): each rank generates groups i % dp == rank with its own
    engine, which sleeps until the refit after critic training (S13)."""

    colocated = True

    def __init__(self, args: PPOArgs, world: dist.World, build_engine, task, tok):
        self.args, self.world, self.build_engine, self.task, self.tok = args, world, build_engine, task, tok
        self.engine = self.handoff = None

    def start(self, step: int, policy, offload, load=None, say=print, write=None, logged_eval=-1) -> None:
        say("building the vLLM engine ...")  # after the trainer's models, as in GRPO (models._pretrained: why)
        self.engine = self.build_engine()
        policy_off = offload[0]
        everything = Together(*offload)  # policy, critic, and the reference if there is one
        dtype = models.DTYPES[self.args.model.dtype]
        weights = lambda: (policy_off.onload(), dist.full_parameters(policy, dtype))[1]  # noqa: E731
        self.handoff = HandOff(self.engine, everything, weights, enabled=self.args.ppo.colocated_offload,
                               sleep_level=self.args.rollout.sleep_level)
        if load is not None:
            self.handoff.restore(load)  # the engine sleeps through the load; the restored policy is published first
        else:
            self.handoff.start_fresh()

    def chunks(self, step: int, ready: ReadyGroups):
        mine = [i for i in range(ready.num_prompts) if i % self.world.world_size == self.world.rank]
        groups = [g for _, g in _generate(self.engine, self.task, self.tok, mine, step, self.args, step)]
        self.handoff.to_trainer()  # generation pauses through both updates (S13)
        ready.claimed.update({i: Group(i, step) for i in range(ready.num_prompts)})
        yield ready.num_prompts, groups

    def times(self) -> dict:
        return {}  # every group is ready before the update starts: no wait or tail to measure

    def refit(self, version: int, policy) -> None:
        self.handoff.publish()  # wakes the engine with the stepped policy (unchanged during critic warmup)

    def release(self, step: int) -> None:
        pass

    def evals(self, version: int) -> dict:
        """Held-out accuracy of `version` when it is due (a collective over the ranks)."""
        if not self.args.log.evaluates(version, self.args.steps):
            return {}
        return {**held_out(self.engine, self.task, self.tok, self.args.rollout.max_prompt_tokens, self.world.rank,
                           self.world.world_size, version), "eval_version": version}

    def final_eval(self, steps: int) -> dict:
        return {}  # `evals` scored the last version already

    def rollout_memory_gib(self) -> float:
        return 0.0  # each rank's engine is in its own process's peak

    def save(self, fn) -> None:
        self.handoff.save_after_publication(fn)

    def stop(self) -> None:
        self.handoff.to_trainer()

    def cleanup(self) -> None:
        if self.handoff is not None:
            self.handoff.cleanup()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


# ---- shared by both placements ----

def _generate(engine: Engine, task, tok, indices: list[int], step: int, args: PPOArgs, version: int):
    """Sample G completions for the step's groups `indices` and score them (tasks.scored); yield
    (index, group tensors)."""
    P, G = args.ppo.num_prompts_per_step, args.ppo.num_generations_per_prompt
    pids = [prompt_id(0, step * P + i) for i in indices]
    s, rewards, parts = scored(engine, task, tok, [task.train_problem(p) for p in pids], pids, G,
                               args.rollout.max_prompt_tokens, step=step)
    for j, i in enumerate(indices):
        rows = slice(j * G, (j + 1) * G)
        yield i, as_group(s, rows, rewards[rows], [p[rows] for p in parts], version)
