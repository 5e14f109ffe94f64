"""PPO with a critic, streamed over completed rollout chunks (docs/guide-streaming.md).

    torchrun --nproc-per-node 2 -m minirl.ppo --steps 40          # CPU: one rollout rank, one train rank
    python -m minirl.ppo --grid.gpu-placement colocated \
        --async-rl.min-groups-for-streaming-train 16 --ppo.ppo-epochs 2   # full batch on one process

One trainer loop (`train`) runs every step the same way: take chunks of completed groups, feed
each to `stream.TrainPump` (value forward first, policy forward, GAE, policy backward, S5),
close the step (one policy step per epoch, refit, critic epochs, S8-S10), release the groups,
then log and maybe checkpoint (never inside the update, S11). Where the groups come from is the
only thing the placement changes (`placement.py`): separate rollout ranks that hand groups and
weights over a TCPStore (`StoreGroups`, `rollout_rank`), or every rank's own engine, asleep
through the update (`EngineGroups`, colocated full batch).
"""

from __future__ import annotations

import json
import os
import time

import torch

from minirl import checkpoint, dist, launch, models, plan, rundir
from minirl.accumulator import Accumulator, Stall, across_ranks, lr_schedule
from minirl.batch import pack
from minirl.config_ppo import PPOArgs
from minirl.logger import RunLog, memory_peak_gib, sample_metrics
from minirl.offload import TrainerOffload
from minirl.placement import EngineGroups, StoreGroups, rollout_rank
from minirl.rewards import scorer
from minirl.rollout import Samples, check_model
from minirl.sampler import ReadyGroups
from minirl.stream import PumpConfig, TrainPump
from minirl.tasks import make_task


def main(argv: list[str] | None = None) -> None:
    args = launch.parse(PPOArgs, argv, __doc__)
    if args.dry_run:  # the plan for the world the flags describe; nothing is loaded or built
        plan.dry_run(args, argv)
        return
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.validate(world_size)
    path = models.resolve_path(args.model)
    max_model_len = args.rollout.max_prompt_tokens + args.rollout.max_tokens
    check_model(path, args.rollout, max_model_len, head_dim_flag="--model.tiny.num-heads")
    make_task(args.task, args.seed, models.load_tokenizer(path), args.rollout.max_prompt_tokens,
              evaluates=bool(args.log.eval_every))  # every prompt checked now, before any build
    train_ranks = world_size - (args.grid.rollout_ranks if args.grid.gpu_placement == "disaggregated" else 0)
    resume = checkpoint.find(args.checkpoint.resume, args.checkpoint_dir, "ppo", train_ranks, args.steps)  # checked here, early
    rundir.claim(args, resume)  # this run owns the run dir; --log.overwrite clears the old run's
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
    P, reward_names = p.num_prompts_per_step, scorer(args.task).names  # reward/<name> in the metrics
    start = checkpoint.steps_done(resume) if resume else 0
    log = RunLog(args.log.run_dir, enabled=world.is_main, every=args.log.every, start_step=start,
                 tensorboard=args.log.tensorboard, wandb_project=args.log.wandb_project, config=args.to_dict(),
                 total_steps=args.steps, samples=args.log.samples)
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
    with log.phase("build_trainer", announce="loading the policy and the value model (FSDP2)"):
        policy = models.sharded(path, "policy", world, args.model.dtype, args.model.packing,
                                checkpointing=args.model.activation_checkpointing)  # float32 masters
        value = models.sharded(path, "value", world, args.model.dtype, args.model.packing,
                               checkpointing=args.model.activation_checkpointing)
        ref = models.sharded(path, "reference", world, args.model.dtype, like=policy) if p.kl_coef else None
    log.info(models.load_report(args.model.packing, policy))
    policy_opt, value_opt = models.adamw(policy, p.lr), models.adamw(value, p.value_lr)
    parts = {"policy": (policy, policy_opt), "value": (value, value_opt)}
    offload, resident = offloaders(policy, policy_opt, value, value_opt, ref)
    tok = models.load_tokenizer(path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    # learning rates by optimizer step: the policy steps ppo_epochs times a step after critic warmup,
    # the critic critic_ppo_epochs times every step; a resumed run recomputes both from its step
    policy_lr = lr_schedule(p.lr, p.lr_warmup_steps, (args.steps - p.critic_warmup_steps) * p.ppo_epochs,
                            p.lr_schedule, p.min_lr_ratio)
    value_lr = lr_schedule(p.value_lr, p.lr_warmup_steps, args.steps * p.critic_ppo_epochs, p.lr_schedule,
                           p.min_lr_ratio)

    def save() -> None:  # between steps only: the counters advanced, both models are resident (S11)
        for o in offload:
            o.onload()
        checkpoint.save(args.checkpoint_dir, step + 1, parts, {"loop": "ppo"}, args.checkpoint.keep)

    stop, terminate = dist.sigterm_flag(), False
    stall = Stall(p.max_skipped_steps, f"a learning rate too high for this model (--ppo.lr={p.lr}) or non-finite "
                                       "rewards")
    try:
        if not source.colocated:
            log.info("waiting for the rollout ranks to build their engines ...")
        source.start(start, policy, resident, load=(lambda: checkpoint.load(resume, parts)) if resume else None)
        if resume:
            checkpoint.report_lr(policy_opt, policy_lr(max(0, start - p.critic_warmup_steps) * p.ppo_epochs),
                                 "--ppo.lr", log.info)
            checkpoint.report_lr(value_opt, value_lr(start * p.critic_ppo_epochs), "--ppo.value-lr", log.info)
            log.info(f"resumed from {resume} at step {start}")
        elif args.checkpoint.resume == "auto":
            log.info(f"--checkpoint.resume auto: no complete checkpoint in {args.checkpoint_dir}; starting fresh")
        first = source.evals(start)
        if first:
            log.write({"step": start, **first})
        record: dict = {}
        step = start - 1  # the last step done, should the loop have none left
        for step in range(start, args.steps):
            dist.fault(f"kill_train_rank{world.rank}", step)  # tests: a train rank dies (kill -9)
            t0, warmup = time.perf_counter(), step < p.critic_warmup_steps
            cfg = pump_config(args, step, source.colocated)
            first_policy_step = (step - p.critic_warmup_steps) * p.ppo_epochs
            acc = Accumulator(policy, policy_opt, n_micro=None, max_grad_norm=p.max_grad_norm,
                              schedule=lambda k: policy_lr(first_policy_step + k))
            pump = TrainPump(policy, value, acc, value_opt, cfg, step, refit=lambda: source.refit(step + 1, policy),
                             ref=ref, log=log.info, policy_off=offload[0], value_off=offload[1],  # value ready (S12)
                             device=world.device, value_schedule=lambda k: value_lr(step * p.critic_ppo_epochs + k))
            if step == start and not source.colocated:
                log.info(f"step {step}: waiting for the first completed groups from the rollout ranks ...")
            ready = ReadyGroups(P, a.min_groups_for_streaming_train, a.sampler.name,
                                a.sampler.max_lookahead_versions, align=world.world_size)
            rewards, by_reward, lengths, clipped, prompt_tokens, t_first_chunk, consumed = [], [], [], [], 0, None, 0
            for taken, groups in source.chunks(step, ready):
                consumed += taken
                t_first_chunk = t_first_chunk or time.perf_counter()
                rewards += [g["rewards"] for g in groups]
                by_reward += [g["reward_parts"] for g in groups]
                lengths += [g["lengths"] for g in groups]
                clipped += [g["clipped"] for g in groups]
                prompt_tokens += sum(g["prompt"].numel() * g["lengths"].numel() for g in groups)
                pump.chunk({**_rows(groups, pad_id), "groups": taken})
            out = pump.close()
            t_closed = time.perf_counter()
            if warmup:
                source.refit(step + 1, None)  # a version bump without new weights (S14)
            ready.release()
            source.release(step)  # only after both updates (S11)
            r, n = torch.cat(rewards), torch.cat(lengths)
            samples = sample_metrics(r, p.num_generations_per_prompt, n.tolist(), torch.cat(clipped).tolist(),
                                     dict(zip(reward_names, torch.cat(by_reward, dim=1))))
            prompts = dist.all_reduce(torch.tensor([float(prompt_tokens)], dtype=torch.float64)).item()
            dt = time.perf_counter() - t0
            rolled = across_ranks(out)
            entropy, gap = rolled.pop("ppo_entropy", None), rolled.pop("ppo_logprob_gap", None)
            rollout_peak = source.rollout_memory_gib()  # separate rollout ranks' engines (0: none)
            record = {"step": step, **samples, "prompt_len_mean": prompts / (P * p.num_generations_per_prompt),
                      **rolled, "entropy": entropy, "logprob_gap": gap, "lr": policy_opt.param_groups[0]["lr"],
                      "value_lr": value_opt.param_groups[0]["lr"],
                      "memory_peak_gib": max(memory_peak_gib(world.device), rollout_peak),
                      "rollout_memory_peak_gib": rollout_peak or None,
                      "critic_warmup": warmup, "groups_consumed": consumed, "time/step": dt,
                      "tokens_per_s": samples["completion_len_mean"] * P * p.num_generations_per_prompt / dt,
                      "time/wait_first_chunk": (t_first_chunk or t0) - t0, **source.evals(step + 1)}
            if source.t_all_ready:  # streaming's tail: last group ready -> update done (bench/streaming.py)
                record["time/tail"] = t_closed - source.t_all_ready
            log.write(record)
            stepped = warmup or not pump.skipped  # False: the policy update was non-finite
            stall.step(stepped, step)  # raises after --ppo.max-skipped-steps steps without an update
            terminate = stop()  # SIGTERM: an emergency save at this step boundary, then exit
            if terminate or (args.checkpoint.every and (step + 1) % args.checkpoint.every == 0 and stepped):
                with log.phase("checkpoint", announce=f"saving the checkpoint of step {step + 1}"):
                    source.save(save)
            if terminate:
                log.info(f"{stop.name}: saved {args.checkpoint_dir} at step {step + 1}; exiting")
                break
            target = args.log.target_eval_accuracy
            reached = target and record.get("eval_accuracy", 0.0) >= target
            if dist.all_reduce(torch.tensor([float(bool(reached))]), "max").item():  # every train rank stops
                log.info(f"eval_accuracy reached --log.target-eval-accuracy={args.log.target_eval_accuracy}; stopping")
                break
        else:
            final = source.final_eval(args.steps)
            if final:
                log.write({"step": args.steps, **final})
                record.update(final)
        source.stop()
        if not terminate:
            offload[1].offload()
            offload[0].onload()
            card = checkpoint.model_card("PPO", args, step + 1, record.get("eval_accuracy"))
            with log.phase("export", announce=f"exporting the policy to {args.log.run_dir}/final"):
                checkpoint.export_hf(policy, path, os.path.join(args.log.run_dir, "final"), world.is_main,
                                     models.DTYPES[args.model.dtype], card)
    except BaseException:
        source.cleanup()
        dist.quietly(source.close)  # the error that brought us here is the one raised (B24)
        raise
    else:
        source.close()
    finally:
        log.close()


def offloaders(policy, policy_opt, value, value_opt, ref):
    """The pump's two offloaders (the policy's gradients stay resident while it is offloaded, S7), and
    with the reference's all that leaves a colocated card while the engine is awake."""
    pump = TrainerOffload(policy, policy_opt, keep_grads=True), TrainerOffload(value, value_opt)
    return pump, pump + ((TrainerOffload(ref),) if ref is not None else ())


def pump_config(args: PPOArgs, step: int, colocated: bool) -> PumpConfig:
    """The pump's settings for `step` (critic warmup or not) under this placement."""
    p = args.ppo
    return PumpConfig(gamma=p.adv_estimator.gamma, lam=p.adv_estimator.lam, clip_eps=p.clip_eps,
                      clip_eps_high=p.clip_eps_high, dual_clip=p.dual_clip, kl_coef=p.kl_coef,
                      value_max_grad_norm=p.max_grad_norm, value_clip_eps=p.clip_eps,
                      normalize_advantages=p.adv_estimator.normalize_advantages,
                      critic_ppo_epochs=p.critic_ppo_epochs, critic_warmup=step < p.critic_warmup_steps,
                      ppo_epochs=p.ppo_epochs, refit_after_critic=colocated, value_ready_early=not colocated,
                      policy_micro_rows=p.policy_micro_batch_rows, critic_micro_rows=p.critic_micro_batch_rows,
                      use_rollout_logprobs=p.use_rollout_logprobs_for_loss)


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
    return {"input_ids": b["input_ids"], "mask": b["mask"], "rewards": seq_rewards, "rollout_logp": b["rollout_logp"],
            "lengths": b["lengths"].tolist()}


def cli(argv: list[str] | None = None) -> None:
    """The `minirl-ppo` console script and `python -m minirl.ppo`."""
    launch.run("minirl.ppo", main, argv)


if __name__ == "__main__":
    cli()
