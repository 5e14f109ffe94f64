"""PPO with a critic, streamed over completed rollout chunks (spec/ppo-streaming.md).

    torchrun --nproc-per-node 2 -m minirl.ppo --steps 40          # CPU: one rollout rank, one train rank
    python -m minirl.ppo --grid.gpu-placement colocated \
        --async-rl.min-groups-for-streaming-train 16 --ppo.ppo-epochs 2   # full batch on one process

One trainer loop (`train`) runs every step the same way: take chunks of completed groups, feed
each to `stream.TrainPump` (value forward first, policy forward, GAE, policy backward, S5),
close the step (one policy step per epoch, refit, critic epochs, S8-S10), release the groups,
then log and maybe checkpoint (never inside the update, S11). Where the groups come from is the
only thing the placement changes:

- disaggregated (`StoreGroups`, streaming or full batch): ranks [0, R) only generate; ranks
  [R, N) only train. Rollout rank r generates the step's groups i with i % R == r, a few groups
  per vLLM call, so groups finish in waves; each finished group (token ids, engine logprobs,
  rewards, the policy version that sampled it) goes to a TCPStore at once. Before sampling step s
  it waits for policy version >= s - max_lookahead_versions (S23) and loads those weights. The
  controller (train rank 0) polls for ready groups, asks the sampler for the next chunk
  (tail-aware selection, S16) and tells the other train ranks which groups it took.
- colocated (`EngineGroups`, full batch only): every rank generates its share of the step's
  groups with its own engine, which then sleeps through the whole update; the refit after
  critic training wakes it (S13).

Weights and groups cross the store as safetensors bytes: nothing is unpickled. On GPUs this
transfer should move to NCCL (ENV-NOTES.md); the store keeps the CPU path simple and real.
Shapes: P prompts, G samples per prompt, rows = groups x G.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import tyro
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from minirl import checkpoint, dist, models
from minirl.accumulator import Accumulator, across_ranks
from minirl.batch import pack
from minirl.config import ConfigError, PPOArgs
from minirl.logger import RunLog
from minirl.offload import HandOff, TrainerOffload
from minirl.rollout import Engine, Samples, check_model
from minirl.sampler import Group, ReadyGroups
from minirl.stream import PumpConfig, TrainPump
from minirl.tasks import encode_prompt, held_out_accuracy, make_task, prompt_id

POLL_S = 0.005


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(PPOArgs, args=argv, description=__doc__)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.validate(world_size)
    path = models.resolve_path(args.model)
    max_model_len = args.rollout.max_prompt_tokens + args.rollout.max_tokens
    check_model(path, args.rollout, max_model_len, head_dim_flag="--model.tiny.num-heads")
    resume = checkpoint.find(args.checkpoint.resume, args.checkpoint_dir)  # a bad checkpoint fails here, early
    if args.grid.gpu_placement == "colocated":
        world = dist.init()
        dist.seed_everything(args.seed)
        train(args, path, world, EngineGroups(args, path, world, max_model_len), resume)
        return
    roles, world, store = dist.init_disaggregated(args.grid.rollout_ranks)
    dist.seed_everything(args.seed)
    if roles.generates:
        rollout_rank(args, path, roles, store, max_model_len)
    else:
        train(args, path, world, StoreGroups(args, store, world), resume)


# ---- the trainer loop (every train rank, either placement) ----

def train(args: PPOArgs, path: str, world: dist.World, source, resume: str | None) -> None:
    p, a = args.ppo, args.async_rl
    P = p.num_prompts_per_step
    start = checkpoint.steps_done(resume) if resume else 0
    log = RunLog(args.log.run_dir, enabled=world.is_main, every=args.log.every, start_step=start,
                 tensorboard=args.log.tensorboard, wandb_project=args.log.wandb_project, config=args.to_dict())
    mode = f"streaming, min {a.min_groups_for_streaming_train} groups" if args.streaming else "full batch"
    log.info(f"minirl.ppo: {args.grid.gpu_placement}, {world.world_size} train rank(s) on {world.device}; {mode}; "
             f"model {path}")
    log.info("config: " + json.dumps(args.to_dict(), separators=(",", ":")))
    if world.is_main:
        with open(os.path.join(args.log.run_dir, "config.json"), "w") as f:
            json.dump(args.to_dict(), f, indent=2)
    if args.streaming and p.adv_estimator.normalize_advantages:
        log.info("warning: --ppo.adv-estimator.normalize-advantages under streaming whitens advantages within "
                 "each chunk, so chunk boundaries change the policy gradient (critic returns are unaffected)")
    dtype = models.DTYPES[args.model.dtype]
    with log.phase("build_trainer", announce="loading the policy and the value model (FSDP2)"):
        policy = dist.shard(models.load_policy(path, args.model.dtype), world, dtype)
        value = dist.shard(models.load_value(path, args.model.dtype), world, dtype)
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=p.lr)
    value_opt = torch.optim.AdamW(value.parameters(), lr=p.value_lr)
    parts = {"policy": (policy, policy_opt), "value": (value, value_opt)}
    offload = TrainerOffload(policy, policy_opt, keep_grads=True), TrainerOffload(value, value_opt)  # S7
    tok = models.load_tokenizer(path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if resume:
        checkpoint.load(resume, parts)
        log.info(f"resumed from {resume} at step {start}")

    def save() -> None:  # between steps only: the counters advanced, both models are resident (S11)
        for o in offload:
            o.onload()
        checkpoint.save(args.checkpoint_dir, step + 1, parts, {}, args.checkpoint.keep)

    try:
        source.start(start, policy, offload)
        first = source.evals(start)
        if first:
            log.write({"step": start, **first})
        for step in range(start, args.steps):
            t0, warmup = time.perf_counter(), step < p.critic_warmup_steps
            cfg = PumpConfig(gamma=p.adv_estimator.gamma, lam=p.adv_estimator.lam, clip_eps=p.clip_eps,
                             value_clip_eps=p.clip_eps, normalize_advantages=p.adv_estimator.normalize_advantages,
                             critic_ppo_epochs=p.critic_ppo_epochs, critic_warmup=warmup, ppo_epochs=p.ppo_epochs,
                             refit_after_critic=source.colocated)
            acc = Accumulator(policy, policy_opt, n_micro=None, max_grad_norm=p.max_grad_norm)
            pump = TrainPump(policy, value, acc, value_opt, cfg, step, refit=lambda: source.refit(step + 1, policy),
                             log=log.info, policy_off=offload[0], value_off=offload[1])  # value model ready (S12)
            ready = ReadyGroups(P, a.min_groups_for_streaming_train, a.sampler.name,
                                a.sampler.max_lookahead_versions, align=world.world_size)
            rewards, lengths, prompt_tokens, t_first_chunk = [], [], 0, None
            for taken, groups in source.chunks(step, ready):
                t_first_chunk = t_first_chunk or time.perf_counter()
                rewards += [g["rewards"] for g in groups]
                lengths += [g["lengths"] for g in groups]
                prompt_tokens += sum(g["prompt"].numel() * g["lengths"].numel() for g in groups)
                pump.chunk({**_rows(groups, pad_id), "groups": taken})
            out = pump.close()
            t_closed = time.perf_counter()
            if warmup:
                source.refit(step + 1, None)  # a version bump without new weights (S14)
            ready.release()
            source.release(step)  # only after both updates (S11)
            r, n = torch.cat(rewards), torch.cat(lengths)
            totals = dist.all_reduce(torch.tensor([r.sum().item(), float(r.numel()), n.sum().item(), prompt_tokens]))
            dt = time.perf_counter() - t0
            record = {"step": step, "reward_mean": (totals[0] / totals[1]).item(),
                      "completion_len_mean": (totals[2] / totals[1]).item(),
                      "prompt_len_mean": (totals[3] / totals[1]).item(), **across_ranks(out),
                      "critic_warmup": warmup, "time/step": dt, "tokens_per_s": totals[2].item() / dt,
                      "time/wait_first_chunk": (t_first_chunk or t0) - t0, **source.evals(step + 1)}
            if source.t_all_ready:  # streaming's tail: last group ready -> update done (bench/streaming.py)
                record["time/tail"] = t_closed - source.t_all_ready
            log.write(record)
            if args.checkpoint.every and (step + 1) % args.checkpoint.every == 0:
                source.save(save)
            target = args.log.target_eval_accuracy
            reached = target and record.get("eval_accuracy", 0.0) >= target
            if dist.all_reduce(torch.tensor([float(bool(reached))]), "max").item():  # every train rank stops
                log.info(f"eval_accuracy reached --log.target-eval-accuracy={args.log.target_eval_accuracy}; stopping")
                break
        else:
            final = source.final_eval(args.steps)
            if final:
                log.write({"step": args.steps, **final})
        source.stop()
        offload[1].offload()
        offload[0].onload()
        checkpoint.export_hf(policy, path, os.path.join(args.log.run_dir, "final"), world.is_main)
    except BaseException:
        source.cleanup()
        raise
    finally:
        source.close()
        log.close()


# ---- disaggregated: groups and weights cross a TCPStore ----

class StoreGroups:
    """The train side of disaggregated placement. Keys: `start` (the step a run begins at),
    `version/{v}` (policy weights, safetensors; empty = unchanged), `group/{s}/{i}` (one group's
    samples), `loaded/{r}` (the version rollout rank r holds), `eval/{v}`, `stop`. Blobs are
    stored in parts (`_put`); versions every rollout rank has moved past are dropped."""

    colocated = False

    def __init__(self, args: PPOArgs, store, world: dist.World):
        self.args, self.store, self.world = args, store, world
        self.next_eval = 0
        self.t_all_ready = 0.0  # controller: when the step's last group became ready
        self.published: list[int] = []  # policy versions still in the store

    def start(self, step: int, policy, offload) -> None:
        if step:  # resumed: the rollout ranks start from the restored weights
            self.refit(step, policy)
        if self.world.is_main:
            self.store.set("start", str(step))
        every = self.args.log.eval_every
        self.next_eval = math.ceil(step / every) * every if every else 0

    def chunks(self, step: int, ready: ReadyGroups):
        waiting, dp = set(range(ready.num_prompts)), self.world.world_size
        self.t_all_ready = 0.0
        while ready.remaining:
            taken = _next_chunk(self.store, ready, waiting, step, self.world)  # (groups,) on every rank
            if not waiting and not self.t_all_ready:
                self.t_all_ready = time.perf_counter()
            if not taken:
                time.sleep(POLL_S)  # the value model stays resident across empty selections (S12)
                continue
            yield len(taken), [st_load(_take(self.store, f"group/{step}/{i}")) for i in taken[self.world.rank::dp]]

    def refit(self, version: int, policy) -> None:
        """Gather the full policy (a collective over the train ranks) and hand it to the rollout ranks."""
        state = {n: t.to("cpu").contiguous() for n, t in dist.full_parameters(policy)} if policy is not None else None
        if not self.world.is_main:
            return
        _put(self.store, f"version/{version}", st_save(state) if state is not None else b"")
        self.published.append(version)
        # Drop the versions every rollout rank has moved past: the store must not grow with the run.
        loaded = [int(self.store.get(k)) if self.store.check([k]) else 0
                  for k in (f"loaded/{r}" for r in range(self.args.grid.rollout_ranks))]
        while self.published and self.published[0] < min(loaded):
            _drop(self.store, f"version/{self.published.pop(0)}")

    def release(self, step: int) -> None:
        if self.world.is_main:
            for i in range(self.args.ppo.num_prompts_per_step):
                _drop(self.store, f"group/{step}/{i}")

    def evals(self, version: int) -> dict:
        """The newest held-out accuracy the rollout side has posted (it scores versions asynchronously)."""
        out = {}
        while self.world.is_main and self.args.log.eval_every and self.store.check([f"eval/{self.next_eval}"]):
            out = {"eval_accuracy": float(self.store.get(f"eval/{self.next_eval}")), "eval_version": self.next_eval}
            self.next_eval += self.args.log.eval_every
        return out

    def final_eval(self, steps: int) -> dict:
        if not (self.world.is_main and self.args.log.eval_every):
            return {}
        self.store.wait([f"eval/{steps}"])
        return {"eval_accuracy": float(self.store.get(f"eval/{steps}")), "eval_version": steps}

    def save(self, fn) -> None:
        fn()

    def stop(self) -> None:
        if self.world.is_main:
            self.store.set("stop", b"1")  # lets the rollout ranks leave their waits

    def cleanup(self) -> None:
        pass

    def close(self) -> None:
        pass


def rollout_rank(args: PPOArgs, path: str, roles: dist.Roles, store, max_model_len: int) -> None:
    P, G, R = args.ppo.num_prompts_per_step, args.ppo.num_generations_per_prompt, args.grid.rollout_ranks
    task = make_task(args.task, args.seed)
    tok = models.load_tokenizer(path)
    engine = Engine(path, args.rollout, max_model_len, dtype=args.model.dtype, seed=args.seed, private=True)
    limit, every = args.rollout.max_prompt_tokens, args.log.eval_every
    try:
        start = int(store.get("start"))  # waits for the trainer to build (and maybe restore) its models
        version = max(start - 1, 0)      # a resumed run's weights arrive as version/{start}
        for step in range(start, args.steps):
            version = _catch_up(engine, store, version, step - args.async_rl.sampler.max_lookahead_versions, roles)
            if version is None:
                return  # the trainer stopped early (--log.target-eval-accuracy)
            if roles.global_rank == 0 and every and version % every == 0 and not store.check([f"eval/{version}"]):
                store.set(f"eval/{version}", str(held_out_accuracy(engine, task, tok, limit)))
            mine = [i for i in range(P) if i % R == roles.global_rank]
            k = args.async_rl.rollout_groups_per_call
            for first in range(0, len(mine), k):
                for i, group in _generate(engine, task, tok, mine[first:first + k], step, args, version):
                    _put(store, f"group/{step}/{i}", st_save(group))
        if _catch_up(engine, store, version, args.steps, roles) is None:  # the last refit, then the final eval
            return
        if roles.global_rank == 0 and every:
            store.set(f"eval/{args.steps}", str(held_out_accuracy(engine, task, tok, limit)))
        store.wait(["stop"])  # global rank 0 hosts the store: it must outlive the trainer's last use of it
    finally:
        engine.close()


def _catch_up(engine: Engine, store, version: int, need: int, roles: dist.Roles) -> int | None:
    """Wait until policy version >= `need` is published, then load the newest one (a version
    published during critic warmup carries no weights: the newest one that does is loaded).
    Returns the version now in the engine, or None once the trainer stopped."""
    while True:
        latest = version
        while store.check([f"version/{latest + 1}"]):
            latest += 1
        if latest >= need:
            break
        if store.check(["stop"]):
            return None
        time.sleep(POLL_S)
    for v in range(latest, version, -1):
        blob = _take(store, f"version/{v}")
        if blob:
            engine.load_weights(st_load(blob).items())
            break
    if latest > version:
        store.set(f"loaded/{roles.global_rank}", str(latest))  # the trainer may now drop older versions
    return latest


# The libuv TCPStore refuses values over 8 MiB: blobs go in parts, the part count written last.
PART_BYTES = 4 << 20


def _put(store, key: str, blob: bytes) -> None:
    parts = [blob[i:i + PART_BYTES] for i in range(0, len(blob), PART_BYTES)]
    for k, part in enumerate(parts):
        store.set(f"{key}/{k}", part)
    store.set(key, str(len(parts)))  # present = complete


def _take(store, key: str) -> bytes:
    return b"".join(store.get(f"{key}/{k}") for k in range(int(store.get(key))))


def _drop(store, key: str) -> None:
    n = int(store.get(key))
    store.delete_key(key)
    for k in range(n):
        store.delete_key(f"{key}/{k}")


def _next_chunk(store, ready: ReadyGroups, waiting: set, step: int, world: dist.World) -> list[int]:
    """Controller: poll the store and ask the sampler; every train rank gets the same answer."""
    taken = torch.full((ready.num_prompts,), -1, dtype=torch.long)
    if world.is_main:
        for i in sorted(waiting):
            key = f"group/{step}/{i}"
            if store.check([key]):
                version = int(st_load(_take(store, key))["version"])
                if not ready.add(Group(i, version), step):
                    raise RuntimeError(f"group {i} of step {step} was sampled by version {version}: too stale")
                waiting.discard(i)
        chunk = [g.index for g in ready.take()]
        taken[:len(chunk)] = torch.tensor(chunk, dtype=torch.long)
    if world.world_size > 1:
        torch.distributed.broadcast(taken, src=0)
        if not world.is_main:  # mirror the controller's bookkeeping
            for i in taken[taken >= 0].tolist():
                ready.claimed[i] = Group(i, -1)
    return taken[taken >= 0].tolist()


# ---- colocated full batch: every rank's own engine, asleep through the update ----

class EngineGroups:
    """Colocated placement (full batch only, config.PPOArgs.validate): each rank generates groups
    i with i % dp == rank, then its engine sleeps (`HandOff.to_trainer`) until the refit that
    follows critic training (`TrainPump` with refit_after_critic, S13)."""

    colocated = True
    t_all_ready = 0.0  # every group is ready before the update starts: no tail to measure

    def __init__(self, args: PPOArgs, path: str, world: dist.World, max_model_len: int):
        self.args, self.world = args, world
        self.task = make_task(args.task, args.seed)
        self.tok = models.load_tokenizer(path)
        self.engine = Engine(path, args.rollout, max_model_len, dtype=args.model.dtype, seed=args.seed,
                             sleep_mode=args.ppo.colocated_offload)
        self.handoff = None

    def start(self, step: int, policy, offload) -> None:
        policy_off = offload[0]
        both = SimpleNamespace(offload=lambda: [o.offload() for o in offload],
                               onload=lambda: [o.onload() for o in offload])
        weights = lambda: (policy_off.onload(), dist.full_parameters(policy))[1]  # noqa: E731
        self.handoff = HandOff(self.engine, both, weights, enabled=self.args.ppo.colocated_offload,
                               sleep_level=self.args.rollout.sleep_level)
        if step:
            self.handoff.before_restore()
            self.handoff.publish()  # the restored policy, before the first draw
        else:
            self.handoff.start_fresh()

    def chunks(self, step: int, ready: ReadyGroups):
        mine = [i for i in range(ready.num_prompts) if i % self.world.world_size == self.world.rank]
        groups = [g for _, g in _generate(self.engine, self.task, self.tok, mine, step, self.args, step)]
        self.handoff.to_trainer()  # generation pauses through both updates (S13)
        ready.claimed.update({i: Group(i, step) for i in range(ready.num_prompts)})
        yield ready.num_prompts, groups

    def refit(self, version: int, policy) -> None:
        self.handoff.publish()  # wakes the engine with the stepped policy (unchanged during critic warmup)

    def release(self, step: int) -> None:
        pass

    def evals(self, version: int) -> dict:
        """Held-out accuracy of `version` when it is due (a collective over the ranks)."""
        every = self.args.log.eval_every
        if not every or (version % every and version != self.args.steps):
            return {}
        acc = held_out_accuracy(self.engine, self.task, self.tok, self.args.rollout.max_prompt_tokens,
                                self.world.rank, self.world.world_size)
        return {"eval_accuracy": acc, "eval_version": version}

    def final_eval(self, steps: int) -> dict:
        return {}  # `evals` scored the last version already

    def save(self, fn) -> None:
        self.handoff.save_after_publication(fn)

    def stop(self) -> None:
        self.handoff.to_trainer()

    def cleanup(self) -> None:
        if self.handoff is not None:
            self.handoff.cleanup()

    def close(self) -> None:
        self.engine.close()


# ---- shared by both placements ----

def _generate(engine: Engine, task, tok, indices: list[int], step: int, args: PPOArgs, version: int):
    """Sample G completions for the step's groups `indices`; yield (index, group tensors)."""
    P, G = args.ppo.num_prompts_per_step, args.ppo.num_generations_per_prompt
    pids = [prompt_id(0, step * P + i) for i in indices]
    problems = [task.train_problem(pid) for pid in pids]
    prompts = [encode_prompt(tok, q.prompt, args.rollout.max_prompt_tokens) for q in problems]
    s = engine.generate(prompts, pids, G)
    texts = tok.batch_decode(s.completion_tokens, skip_special_tokens=True)
    for j, i in enumerate(indices):
        rows = slice(j * G, (j + 1) * G)
        rewards = [task.reward(t, problems[j].answer) for t in texts[rows]]
        yield i, _group(s, rows, rewards, version)


def _group(s: Samples, rows: slice, rewards: list[float], version: int) -> dict[str, torch.Tensor]:
    comps = s.completion_tokens[rows]
    T = max(map(len, comps))
    pad = lambda xs, v: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
    return {"prompt": torch.tensor(s.prompt_tokens[rows.start]),
            "completions": torch.tensor(pad(comps, 0)),
            "lengths": torch.tensor([len(c) for c in comps]),
            "logprobs": torch.tensor(pad(s.logprobs[rows], 0.0)),
            "rewards": torch.tensor(rewards, dtype=torch.float32),
            "version": torch.tensor(version)}


def _rows(groups: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """This rank's groups -> one chunk: packed rows plus the sequence reward on each last token."""
    prompts, comps, lps, rewards = [], [], [], []
    for g in groups:
        for j, n in enumerate(g["lengths"].tolist()):
            prompts.append(g["prompt"].tolist())
            comps.append(g["completions"][j, :n].tolist())
            lps.append(g["logprobs"][j, :n].tolist())
            rewards.append(float(g["rewards"][j]))
    b = pack(Samples([0] * len(comps), prompts, comps, lps, ["stop"] * len(comps)), torch.zeros(len(comps)), pad_id)
    seq_rewards = torch.zeros_like(b["mask"])
    seq_rewards[torch.arange(len(comps)), b["lengths"] - 1] = torch.tensor(rewards)
    return {"input_ids": b["input_ids"], "mask": b["mask"], "rewards": seq_rewards, "rollout_logp": b["rollout_logp"]}


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, checkpoint.CheckpointError) as e:  # bad flag or checkpoint: say which, no traceback
        print(f"minirl.ppo: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        dist.shutdown()
