"""PPO with a critic, streamed over completed rollout chunks (spec/ppo-streaming.md).

    torchrun --nproc-per-node 2 -m minirl.ppo --steps 40          # CPU: one rollout rank, one train rank

Ranks [0, R) only generate; ranks [R, N) only train (grid.gpu_placement=disaggregated). The two
sides meet in a TCPStore (dist.init_disaggregated):

- rollout rank r generates the step's groups i with i % R == r, a few groups per vLLM call, so
  groups finish in waves; each finished group (token ids, engine logprobs, rewards, the policy
  version that sampled it) is written to the store at once. Before sampling step s it waits for
  policy version >= s - max_lookahead_versions (S23), and loads those weights.
- the controller (train rank 0) polls for ready groups, asks the sampler for the next chunk
  (tail-aware selection, S16) and tells the other train ranks which groups it took; every train
  rank trains on its share of the chunk through `stream.TrainPump` (value forward first, policy
  forward, GAE, policy backward, S5) while later groups are still generating. After the last
  chunk: one policy step, refit (the new weights go to the store), critic epochs (S8-S10); then
  the step's groups are released and the step counter advances (S11).

Weights and groups cross the store as safetensors bytes: nothing is unpickled. On GPUs this
transfer should move to NCCL (ENV-NOTES.md); the store keeps the CPU path simple and real.
Shapes: P prompts, G samples per prompt, rows = groups x G.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import tyro
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from minirl import dist, models
from minirl.accumulator import Accumulator, across_ranks
from minirl.batch import pack
from minirl.checkpoint import export_hf
from minirl.config import ConfigError, PPOArgs
from minirl.logger import RunLog
from minirl.offload import TrainerOffload
from minirl.rollout import Engine, Samples, check_model
from minirl.sampler import Group, ReadyGroups
from minirl.stream import PumpConfig, TrainPump
from minirl.tasks import encode_prompt, held_out_hits, make_task, prompt_id

POLL_S = 0.005


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(PPOArgs, args=argv, description=__doc__)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.validate(world_size)
    path = models.resolve_path(args.model)
    max_model_len = args.rollout.max_prompt_tokens + args.rollout.max_tokens
    check_model(path, args.rollout, max_model_len, head_dim_flag="--model.tiny.num-heads")
    roles, world, store = dist.init_disaggregated(args.grid.rollout_ranks)
    dist.seed_everything(args.seed)
    if roles.generates:
        rollout_rank(args, path, roles, store, max_model_len)
    else:
        train_rank(args, path, world, store)


# ---- rollout ranks ----

def rollout_rank(args: PPOArgs, path: str, roles: dist.Roles, store, max_model_len: int) -> None:
    P, G, R = args.ppo.num_prompts_per_step, args.ppo.num_generations_per_prompt, args.grid.rollout_ranks
    task = make_task(args.task, args.seed)
    tok = models.load_tokenizer(path)
    engine = Engine(path, args.rollout, max_model_len, dtype=args.model.dtype, seed=args.seed, private=True)
    version = 0
    try:
        for step in range(args.steps):
            version = _catch_up(engine, store, version, need=step - args.async_rl.sampler.max_lookahead_versions)
            if version is None:
                return  # the trainer stopped early (--log.target-eval-accuracy)
            if roles.global_rank == 0 and args.log.eval_every and version % args.log.eval_every == 0 \
                    and not store.check([f"eval/{version}"]):
                store.set(f"eval/{version}", str(_evaluate(engine, task, tok, args.rollout.max_prompt_tokens)))
            mine = [i for i in range(P) if i % R == roles.global_rank]
            k = args.async_rl.rollout_groups_per_call
            for start in range(0, len(mine), k):
                idx = mine[start:start + k]
                pids = [prompt_id(0, step * P + i) for i in idx]
                problems = [task.train_problem(pid) for pid in pids]
                prompts = [encode_prompt(tok, p.prompt, args.rollout.max_prompt_tokens) for p in problems]
                s = engine.generate(prompts, pids, G)
                texts = tok.batch_decode(s.completion_tokens, skip_special_tokens=True)
                for j, i in enumerate(idx):
                    rows = slice(j * G, (j + 1) * G)
                    rewards = [task.reward(t, problems[j].answer) for t in texts[rows]]
                    store.set(f"group/{step}/{i}", _encode_group(s, rows, rewards, version))
        if _catch_up(engine, store, version, need=args.steps) is None:  # the last refit, then the final eval
            return
        if roles.global_rank == 0 and args.log.eval_every:
            store.set(f"eval/{args.steps}", str(_evaluate(engine, task, tok, args.rollout.max_prompt_tokens)))
    finally:
        engine.close()


def _catch_up(engine: Engine, store, version: int, need: int) -> int | None:
    """Load every published policy version up to at least `need` (waits for it); None once the trainer stopped."""
    while version < need or store.check([f"version/{version + 1}"]):
        if not store.check([f"version/{version + 1}"]):
            if store.check(["stop"]):
                return None
            time.sleep(POLL_S)
            continue
        version += 1
        blob = store.get(f"version/{version}")
        if blob:  # empty during critic warmup: the policy did not change (S14)
            engine.load_weights(st_load(blob).items())
    return version


def _encode_group(s: Samples, rows: slice, rewards: list[float], version: int) -> bytes:
    comps = s.completion_tokens[rows]
    T = max(map(len, comps))
    pad = lambda xs, v: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
    return st_save({
        "prompt": torch.tensor(s.prompt_tokens[rows.start]),
        "completions": torch.tensor(pad(comps, 0)),
        "lengths": torch.tensor([len(c) for c in comps]),
        "logprobs": torch.tensor(pad(s.logprobs[rows], 0.0)),
        "rewards": torch.tensor(rewards),
        "version": torch.tensor(version)})


def _evaluate(engine: Engine, task, tok, limit: int) -> float:
    hits, n = held_out_hits(engine, task, tok, limit)
    return hits / max(n, 1)


# ---- train ranks ----

def train_rank(args: PPOArgs, path: str, world: dist.World, store) -> None:
    p, a = args.ppo, args.async_rl
    P, G, dp = p.num_prompts_per_step, p.num_generations_per_prompt, world.world_size
    log = RunLog(args.log.run_dir, enabled=world.is_main, every=args.log.every)
    log.info(f"minirl.ppo: {args.grid.rollout_ranks} rollout rank(s), {dp} train rank(s); "
             f"{'streaming, min ' + str(a.min_groups_for_streaming_train) if args.streaming else 'full batch'}")
    log.info("config: " + json.dumps(args.to_dict(), separators=(",", ":")))
    if args.streaming and p.adv_estimator.normalize_advantages:
        log.info("warning: --ppo.adv-estimator.normalize-advantages under streaming whitens advantages within "
                 "each chunk, so chunk boundaries change the policy gradient (critic returns are unaffected)")
    dtype = models.DTYPES[args.model.dtype]
    policy = dist.shard(models.load_policy(path, args.model.dtype), world, dtype)
    value = dist.shard(models.load_value(path, args.model.dtype), world, dtype)
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=p.lr)
    value_opt = torch.optim.AdamW(value.parameters(), lr=p.value_lr)
    offload = TrainerOffload(policy, policy_opt, keep_grads=True), TrainerOffload(value, value_opt)  # S7
    tok = models.load_tokenizer(path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    next_eval = 0  # the next policy version whose held-out accuracy the rollout side will post
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            warmup = step < p.critic_warmup_steps
            acc = Accumulator(policy, policy_opt, n_micro=None, max_grad_norm=p.max_grad_norm)
            cfg = PumpConfig(gamma=p.adv_estimator.gamma, lam=p.adv_estimator.lam, clip_eps=p.clip_eps,
                             value_clip_eps=p.clip_eps, normalize_advantages=p.adv_estimator.normalize_advantages,
                             critic_ppo_epochs=p.critic_ppo_epochs, critic_warmup=warmup)
            refit = lambda: _publish(store, policy, step + 1, world)  # noqa: E731
            pump = TrainPump(policy, value, acc, value_opt, cfg, step, refit=refit, log=log.info,
                             policy_off=offload[0], value_off=offload[1])
            ready = ReadyGroups(P, a.min_groups_for_streaming_train, a.sampler.name,
                                a.sampler.max_lookahead_versions, align=dp)
            waiting, rewards, t_first_chunk = set(range(P)), [], None
            while ready.remaining:
                taken = _next_chunk(store, ready, waiting, step, world)              # (groups,) on every rank
                if not taken:
                    time.sleep(POLL_S)  # the value model stays resident across empty selections (S12)
                    continue
                t_first_chunk = t_first_chunk or time.perf_counter()
                groups = [st_load(store.get(f"group/{step}/{i}")) for i in taken[world.rank::dp]]
                rewards += [g["rewards"] for g in groups]
                pump.chunk({**_rows(groups, pad_id), "groups": len(taken)})
            out = pump.close()
            if warmup:
                _publish(store, None, step + 1, world)  # a version bump without new weights
            for i in range(P):  # release the consumed groups only after both updates (S11)
                if world.is_main:
                    store.delete_key(f"group/{step}/{i}")
            r = torch.cat(rewards)
            totals = dist.all_reduce(torch.tensor([r.sum().item(), float(r.numel())]))
            record = {"step": step, "reward_mean": (totals[0] / totals[1]).item(), **across_ranks(out),
                      "critic_warmup": warmup, "time/step": time.perf_counter() - t0,
                      "time/wait_first_chunk": (t_first_chunk or t0) - t0}
            while world.is_main and args.log.eval_every and store.check([f"eval/{next_eval}"]):
                record.update(eval_accuracy=float(store.get(f"eval/{next_eval}")), eval_version=next_eval)
                next_eval += args.log.eval_every
            log.write(record)
            reached = args.log.target_eval_accuracy and record.get("eval_accuracy", 0.0) >= args.log.target_eval_accuracy
            if dist.all_reduce(torch.tensor([float(bool(reached))]), "max").item():  # every train rank stops
                log.info(f"eval_accuracy reached --log.target-eval-accuracy={args.log.target_eval_accuracy}; stopping")
                break
        else:
            if world.is_main and args.log.eval_every:
                store.wait([f"eval/{args.steps}"])
                log.write({"step": args.steps, "eval_accuracy": float(store.get(f"eval/{args.steps}"))})
        if world.is_main:
            store.set("stop", b"1")  # lets the rollout ranks leave their waits
        offload[1].offload()
        offload[0].onload()
        export_hf(policy, path, os.path.join(args.log.run_dir, "final"), world.is_main)
    finally:
        log.close()


def _next_chunk(store, ready: ReadyGroups, waiting: set, step: int, world: dist.World) -> list[int]:
    """Controller: poll the store and ask the sampler; every train rank gets the same answer."""
    taken = torch.full((ready.num_prompts,), -1, dtype=torch.long)
    if world.is_main:
        for i in sorted(waiting):
            key = f"group/{step}/{i}"
            if store.check([key]):
                version = int(st_load(store.get(key))["version"])
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


def _publish(store, policy, version: int, world: dist.World) -> None:
    """Refit: gather the full policy (a collective over the train ranks) and hand it to the rollout ranks."""
    state = {n: t.to("cpu").contiguous() for n, t in dist.full_parameters(policy)} if policy is not None else None
    if world.is_main:
        store.set(f"version/{version}", st_save(state) if state is not None else b"")


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        print(f"minirl.ppo: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        dist.shutdown()
