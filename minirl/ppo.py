"""PPO with a critic, streamed over completed rollout chunks (docs/guide-streaming.md).

    torchrun --nproc-per-node 2 -m minirl.ppo --steps 40          # CPU: one rollout rank, one train rank
    python -m minirl.ppo --grid.gpu-placement colocated \
        --async-rl.min-groups-for-streaming-train 16 --ppo.ppo-epochs 2   # full batch on one process

One trainer loop (`train`) for either placement: take chunks of completed groups, feed each to
`stream.TrainPump` (S5), close the step (policy step, refit, critic epochs, S8-S10), release the
groups, report; the harness saves between steps only (S11). Where the groups come from is
placement.py's.
"""

from __future__ import annotations

import functools
import sys

import torch

from minirl import dist, launch, models, refit
from minirl.accumulator import Accumulator, across_ranks, lr_schedule
from minirl.batch import group_rows
from minirl.config_ppo import PPOArgs
from minirl.logger import engine_log, sample_metrics, training_rows
from minirl.offload import TrainerOffload
from minirl.placement import EngineGroups, StoreGroups, rollout_rank
from minirl.rollout import Engine
from minirl.run import Run
from minirl.sampler import ReadyGroups
from minirl.stream import PumpConfig, TrainPump


def main(argv: list[str] | None = None) -> None:
    """Every check first, on the command layer (launch.preflight); then each rank to its side."""
    ready = launch.preflight(PPOArgs, argv, sys.modules[__name__])
    if ready is None:
        return
    args = ready.args
    if args.grid.gpu_placement == "colocated":
        world = dist.init()
        dist.seed_everything(args.seed)
        engine = functools.partial(Engine, ready.path, args.rollout, args.rollout.max_model_len, world.engine_device,
                                   dtype=args.model.dtype, seed=args.seed, sleep_mode=args.ppo.colocated_offload,
                                   log_file=engine_log(args.log, world.rank, world.world_size > 1))
        train(ready, world, EngineGroups(args, world, engine, ready.task, ready.tok))  # built after the trainer
        return
    roles, world, store = refit.init_disaggregated(args.grid.rollout_ranks)
    ready.owner = refit.share_claim(store, roles, ready.owner)  # no rank touches the run dir before its claim
    dist.seed_everything(args.seed)
    if roles.generates:
        rollout_rank(ready, roles, store)
    else:
        train(ready, world, StoreGroups(args, store, world))


def train(ready: launch.Ready, world: dist.World, source) -> dict:
    """The trainer loop of every train rank, either placement."""
    args, p, a = ready.args, ready.args.ppo, ready.args.async_rl
    P, G = p.num_prompts_per_step, p.num_generations_per_prompt
    mode = f"streaming, min {a.min_groups_for_streaming_train} groups" if args.streaming else "full batch"
    run = Run(ready, world, f"{args.grid.gpu_placement}, {world.world_size} train rank(s) on {world.device}; {mode}",
              rows=P * G)  # TRY NOT TO MODIFY: the harness (log, resume, signals, schedule)
    if args.streaming and p.adv_estimator.normalize_advantages:
        run.info("warning: --ppo.adv-estimator.normalize-advantages under streaming whitens advantages within "
                 "each chunk, so chunk boundaries change the policy gradient (critic returns are unaffected)")

    # ---- build: policy, critic and reference (FSDP2, float32 masters) ----
    with run.phase("build_trainer", announce="loading the policy and the value model (FSDP2)"):
        policy = models.sharded(ready.path, "policy", world, args.model.dtype, args.model.packing,
                                checkpointing=args.model.activation_checkpointing,
                                temperature=args.rollout.temperature)  # scored as the engine samples
        value = models.sharded(ready.path, "value", world, args.model.dtype, args.model.packing,
                               checkpointing=args.model.activation_checkpointing)
        ref = models.sharded(ready.path, "reference", world, args.model.dtype, like=policy) if p.kl_coef else None
    run.info(models.load_report(args.model.packing, policy))
    policy_opt = models.adamw(policy, p.lr, p.weight_decay)
    value_opt = models.adamw(value, p.value_lr, p.weight_decay)
    offload, resident = offloaders(policy, policy_opt, value, value_opt, ref)
    # learning rates by optimizer step: the policy steps ppo_epochs times a step after critic warmup,
    # the critic critic_ppo_epochs times every step; a resumed run recomputes both from its step
    policy_lr = lr_schedule(p.lr, p.lr_warmup_steps, (args.steps - p.critic_warmup_steps) * p.ppo_epochs,
                            p.lr_schedule, p.min_lr_ratio)
    value_lr = lr_schedule(p.value_lr, p.lr_warmup_steps, args.steps * p.critic_ppo_epochs, p.lr_schedule,
                           p.min_lr_ratio)
    run.checkpoints({"policy": (policy, policy_opt), "value": (value, value_opt)})

    def save(step: int) -> None:  # between steps only: the counters advanced, both models resident (S11)
        for o in offload:
            o.onload()
        run.save(step)

    with run.guard(source.cleanup, source.close):  # TRY NOT TO MODIFY: the error raised is the one that stopped it
        source.start(run.start, policy, resident, load=run.load if run.resume else None, say=run.info, write=run.write,
                     logged_eval=run.logged_eval)
        if run.resume:
            run.resumed([(policy_opt, policy_lr(max(0, run.start - p.critic_warmup_steps) * p.ppo_epochs), "--ppo.lr"),
                         (value_opt, value_lr(run.start * p.critic_ppo_epochs), "--ppo.value-lr")])
        run.baseline(source.evals)
        for step in run.steps():
            dist.fault(f"kill_train_rank{world.rank}", step)  # tests: a train rank dies (kill -9)
            warmup, first = step < p.critic_warmup_steps, (step - p.critic_warmup_steps) * p.ppo_epochs
            acc = Accumulator(policy, policy_opt, n_micro=None, max_grad_norm=p.max_grad_norm,
                              schedule=lambda k: policy_lr(first + k))  # one window for the whole step
            pump = TrainPump(policy, value, acc, value_opt, pump_config(args, step, source.colocated), step,
                             refit=lambda: source.refit(step + 1, policy), ref=ref, log=run.info,
                             policy_off=offload[0], value_off=offload[1], device=world.device,  # value ready (S12)
                             value_schedule=lambda k: value_lr(step * p.critic_ppo_epochs + k))
            ready_groups = ReadyGroups(P, a.min_groups_for_streaming_train, a.sampler.name,
                                       a.sampler.max_lookahead_versions, align=world.world_size)
            # ---- stream: each chunk of completed groups through the pump as it comes (S5, S16) ----
            groups, consumed = [], 0
            for taken, chunk in source.chunks(step, ready_groups):
                groups, consumed = groups + chunk, consumed + taken
                pump.chunk({**group_rows(chunk, ready.pad_id), "groups": taken})
            # ---- close: the policy step, the refit, the critic's epochs (S8-S10, S13, S14) ----
            out = pump.close()
            if warmup:
                source.refit(step + 1, None)  # a version bump without new weights (S14)
            times = source.times()
            ready_groups.release()
            source.release(step)  # only after both updates (S11)
            # ---- report ----
            rolled = across_ranks(out)
            record = {**group_metrics(groups, G, ready.task.scorer.names, P * G, ready.tok, args.log.train_samples),
                      "entropy": rolled.pop("ppo_entropy", None), "logprob_gap": rolled.pop("ppo_logprob_gap", None),
                      **rolled, "lr": None if warmup else policy_opt.param_groups[0]["lr"],  # warmup: no policy step
                      "value_lr": value_opt.param_groups[0]["lr"],
                      "rollout_memory_peak_gib": source.rollout_memory_gib() or None, "critic_warmup": warmup,
                      "groups_consumed": consumed, **times, **source.evals(step + 1)}
            run.end_step(step, record, warmup or acc.steps > 0, save=lambda: source.save(lambda: save(step)))
        if not run.stopped:
            run.write(args.steps, source.final_eval(args.steps))  # the last version's eval, when it came late
        source.stop()
        run.finish(policy, before=lambda: (offload[1].offload(), offload[0].onload()))
    return run.record


def group_metrics(groups: list[dict], G: int, names: list[str], rows: int, tok, train_samples: int) -> dict:
    """The step's sample metrics over every train rank (collectives; logger.sample_metrics) and this rank's
    first `train_samples` rollouts."""
    cat = lambda key, dim=0: torch.cat([g[key] for g in groups], dim=dim)  # noqa: E731
    parts = dict(zip(names, cat("reward_parts", dim=1)))
    out = sample_metrics(cat("rewards"), G, cat("lengths").tolist(), cat("clipped").tolist(), parts)
    prompt_tokens = float(sum(g["prompt"].numel() * g["lengths"].numel() for g in groups))
    shown = groups[:-(-train_samples // G)]  # only the groups that hold the rows asked for (none by default)
    comps = [c[:n].tolist() for g in shown for c, n in zip(g["completions"], g["lengths"].tolist())]
    return {**out, "prompt_len_mean": dist.all_reduce(torch.tensor([prompt_tokens], dtype=torch.float64)).item() / rows,
            "train_samples": training_rows(tok, [g["prompt"].tolist() for g in shown for _ in range(G)], comps,
                                           cat("rewards"), parts, cat("clipped"), train_samples)}


def offloaders(policy, policy_opt, value, value_opt, ref):
    """The pump's two offloaders (the policy's gradients stay resident while it is offloaded, S7), and
    with the reference's all that leaves a colocated card while the engine is awake."""
    pump = TrainerOffload(policy, policy_opt, keep_grads=True), TrainerOffload(value, value_opt)
    return pump, pump + ((TrainerOffload(ref),) if ref is not None else ())


def pump_config(args: PPOArgs, step: int, colocated: bool) -> PumpConfig:
    """The pump's settings for `step` (critic warmup or not) under this placement."""
    p = args.ppo
    return PumpConfig(gamma=p.adv_estimator.gamma, lam=p.adv_estimator.lam,
                      loss=p.loss_options(args.rollout.max_tokens), value_max_grad_norm=p.max_grad_norm,
                      value_clip_eps=p.clip_eps, normalize_advantages=p.adv_estimator.normalize_advantages,
                      critic_ppo_epochs=p.critic_ppo_epochs, critic_warmup=step < p.critic_warmup_steps,
                      ppo_epochs=p.ppo_epochs, refit_after_critic=colocated, value_ready_early=not colocated,
                      policy_micro_rows=p.policy_micro_batch_rows, critic_micro_rows=p.critic_micro_batch_rows,
                      use_rollout_logprobs=p.use_rollout_logprobs_for_loss)


def cli(argv: list[str] | None = None) -> None:
    """The `minirl-ppo` console script and `python -m minirl.ppo`."""
    launch.run("minirl.ppo", main, argv)


if __name__ == "__main__":
    cli()
