"""GRPO with batch, mini-batch and micro-batch (docs/guide-batching.md), colocated on every rank.

    python -m minirl.grpo --steps 20                            # one process, CPU, built-in task
    torchrun --nproc-per-node 2 -m minirl.grpo --steps 20       # two ranks: FSDP2 over gloo/NCCL

Each loop step: sample G completions for P prompts with vLLM -> score -> group advantages ->
(mu_iterations x) n_mini optimizer steps of n_micro forward/backward chunks each -> publish the
new weights to the engine -> log. Weight sync, the reward report and evaluation happen once
per collected batch, never per optimizer step (B4).

How it departs from the GRPO paper: no reference KL unless --rl.kl-coef > 0; the loss is a
token mean over the whole mini-batch (DAPO-style), made exact under micro-batching by the
deferred divisor (accumulator.py).

Shapes: P prompts, G = group_size, B = P*G sequences (B_r on this rank), T tokens.
"""

from __future__ import annotations

import json
import os
import time

import torch

from minirl import checkpoint, dist, launch, models, plan, rundir
from minirl.accumulator import Accumulator, Stall, across_ranks, lr_schedule, roll_up
from minirl.batch import RolloutStore, pack, plan_chunks
from minirl.checkpoint import export_hf, model_card
from minirl.config_grpo import GRPOArgs
from minirl.gae import group_advantages
from minirl.logger import RunLog, engine_log, memory_peak_gib, sample_metrics
from minirl.models import token_logprobs as score
from minirl.objective import logprob_gap, policy_loss
from minirl.offload import HandOff, Profile, Together, TrainerOffload
from minirl.rollout import Engine, check_model
from minirl.tasks import dp_partition, encode_prompt, held_out, make_task, prompt_id


def main(argv: list[str] | None = None) -> dict:
    args = launch.parse(GRPOArgs, argv, __doc__)
    if args.dry_run:  # the plan for the world the flags describe; nothing is loaded or built
        plan.dry_run(args, argv)
        return {}
    world = dist.init()
    args.validate(world.world_size)
    path = models.resolve_path(args.model)
    max_model_len = args.rollout.max_prompt_tokens + args.rollout.max_tokens
    check_model(path, args.rollout, max_model_len, head_dim_flag="--model.tiny.num-heads")
    tok = models.load_tokenizer(path)
    task = make_task(args.task, args.seed, tok, args.rollout.max_prompt_tokens, evaluates=bool(args.log.eval_every))
    if args.rl.deterministic:
        dist.set_deterministic()
    resume = checkpoint.find(args.checkpoint.resume, args.checkpoint_dir, "grpo", world.world_size, args.steps)  # checked now
    rundir.claim(args, resume)  # this run owns the run dir; --log.overwrite clears the old run's
    start = checkpoint.steps_done(resume) if resume else 0
    log = RunLog(args.log.run_dir, enabled=world.is_main, every=args.log.every, start_step=start,
                 tensorboard=args.log.tensorboard, wandb_project=args.log.wandb_project, config=args.to_dict(),
                 total_steps=args.steps, samples=args.log.samples)
    if args.checkpoint.resume == "auto" and not resume:
        log.info(f"--checkpoint.resume auto: no complete checkpoint in {args.checkpoint_dir}; starting fresh")
    log.info(f"minirl.grpo: {world.world_size} rank(s) on {world.device}; model {path}; n_mini={args.n_mini} "
             f"n_micro={'by token budget' if args.rl.max_tokens_per_micro_batch else args.n_micro}")
    log.info("config: " + json.dumps(args.to_dict(), separators=(",", ":")))
    if world.is_main:
        with open(os.path.join(args.log.run_dir, "config.json"), "w") as f:
            json.dump(args.to_dict(), f, indent=2)

    # ---- build: task, trainer (FSDP2), reference, engine side by side ----
    dist.seed_everything(args.seed)
    rl, G, dp = args.rl, args.rl.group_size, world.world_size
    P = rl.batch_per_replica // G
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    dtype = models.DTYPES[args.model.dtype]
    with log.phase("build_trainer", announce="loading the policy (FSDP2)"):
        policy = models.sharded(path, "policy", world, args.model.dtype, args.model.packing,
                                checkpointing=args.model.activation_checkpointing)  # float32 masters
        ref = models.sharded(path, "reference", world, args.model.dtype, like=policy) if rl.kl_coef else None
    log.info(models.load_report(args.model.packing, policy))
    optimizer = models.adamw(policy, rl.lr, rl.weight_decay)
    total_steps = args.steps * args.n_mini * rl.mu_iterations  # optimizer steps of the whole run
    acc = Accumulator(policy, optimizer, args.n_micro, rl.max_grad_norm,
                      schedule=lr_schedule(rl.lr, rl.lr_warmup_steps, total_steps, rl.lr_schedule, rl.min_lr_ratio))
    probe = Probe(policy)
    with log.phase("build_engine", announce="building the vLLM engine"):
        engine = Engine(path, args.rollout, max_model_len, world.engine_device, dtype=args.model.dtype,
                        seed=args.seed, sleep_mode=rl.colocated_offload,
                        log_file=engine_log(args.log, world.rank, world.world_size > 1))
    profile = Profile(world.device)
    handoff = hand_off(engine, policy, optimizer, ref, args, profile)

    def save() -> None:
        checkpoint.save(args.checkpoint_dir, step + 1, {"policy": (policy, optimizer)}, keep=args.checkpoint.keep,
                        loop_state={"loop": "grpo", "optimizer_steps": acc.steps, "skipped": acc.skipped,
                                    "probe_done": probe.done})

    def evaluate(version: int) -> dict:  # greedy accuracy on the held-out prompts (a collective over the ranks)
        scored = held_out(engine, task, tok, args.rollout.max_prompt_tokens, world.rank, world.world_size)
        return {**scored, "eval_version": version}

    stop, terminate = dist.sigterm_flag(), False
    stall = Stall(rl.max_skipped_steps, f"a learning rate too high for this model (--rl.lr={rl.lr}) or non-finite "
                                        "rewards")
    try:
        if resume:  # B25: the engine sleeps before the trainer loads; the restored policy is published first
            state = handoff.restore(lambda: checkpoint.load(resume, {"policy": (policy, optimizer)}))
            acc.steps, acc.skipped, probe.done = state["optimizer_steps"], state["skipped"], state["probe_done"]
            checkpoint.report_lr(optimizer, acc.schedule(acc.steps), "--rl.lr", log.info)
            log.info(f"resumed from {resume} at step {start}")
        else:
            handoff.start_fresh()
            if args.log.eval_every:  # the baseline, before the first update
                with log.phase("eval", announce="scoring the held-out prompts before training"):
                    baseline = evaluate(0)
                log.write({"step": 0, **baseline})
        record: dict = {}
        step = start - 1  # the last step done, should the loop have none left
        for step in range(start, args.steps):
            t_step, syncs = time.perf_counter(), engine.loads
            profile.begin_step()
            # ---- sample: this rank's share of the step's P prompts (B14: canonical partition) ----
            pids = [prompt_id(0, step * P + i) for i in range(P)]
            keys = [(pid, j) for pid in pids for j in range(G)]              # (group_id, id) of all B rows
            mine = sorted({keys[i][0] for i in dp_partition(keys, world.rank, dp)})
            problems = {pid: task.train_problem(pid) for pid in mine}
            prompts = [encode_prompt(tok, problems[pid].prompt, args.rollout.max_prompt_tokens) for pid in mine]
            first = f"step {step}: sampling {len(mine)} prompt(s) x {G} on this rank" if step == start else ""
            with log.phase("generate", announce=first):  # later steps report through their step line
                samples = engine.generate(prompts, mine, G)
            profile.mark("generate")

            # ---- score and advantages ----
            texts = tok.batch_decode(samples.completion_tokens, skip_special_tokens=True)
            clipped = samples.clipped
            rewards, parts = task.scorer(texts, [problems[pid].answer for pid in samples.prompt_ids], clipped)
            rewards = torch.tensor(rewards)                                         # (B_r,)
            if dist.fault_due("nan_rewards", step, onward=True):  # tests: a run that can no longer learn
                rewards = rewards * float("nan")
            advantages = group_advantages(rewards, G, rl.scale_by_std)              # (B_r,)
            batch = pack(samples, advantages, pad_id)                              # (B_r, T) tensors
            profile.mark("score")
            chunks = plan_chunks(batch["lengths"].tolist(), args.n_mini, args.micro_batch // dp,
                                 rl.max_tokens_per_micro_batch, packed=policy.pack_rows)
            ahead = args.needs_cached_old_logprobs
            store = RolloutStore(batch, chunks, reads_per_chunk=rl.mu_iterations + ahead,  # B18: same predicate
                                 device=world.device)

            # ---- update: the trainer holds the card while the rollout sleeps (B20) ----
            handoff.to_trainer()
            optimizer_s, steps_before = acc.step_s, acc.steps
            with log.phase("train"):
                calls, steps_out = update(policy, ref, acc, store, args, probe, ahead)
            store.close()
            profile.mark("train", optimizer_s=acc.step_s - optimizer_s)
            stepped = acc.steps > steps_before  # False: every window of this batch was non-finite
            evaluates = args.log.eval_every and ((step + 1) % args.log.eval_every == 0 or step == args.steps - 1)
            saves = args.checkpoint.every and (step + 1) % args.checkpoint.every == 0 and stepped
            if saves and not evaluates:
                with log.phase("checkpoint", announce=f"saving the checkpoint of step {step + 1}"):
                    handoff.save_in_update_window(save)  # B22: before publication, one publish per step

            # ---- publish: wake the weights, sync, offload the trainer, wake the KV cache (B20) ----
            with log.phase("publish"):
                handoff.publish()

            # ---- report once per collected batch (B4) ----
            lengths = [len(c) for c in samples.completion_tokens]
            rolled = across_ranks(roll_up(calls))
            entropy, gap = rolled.pop("grpo_entropy", None), rolled.pop("grpo_logprob_gap", None)
            record = {"step": step,
                      **sample_metrics(rewards, G, lengths, clipped, dict(zip(task.scorer.names, parts))),
                      **rolled, "entropy": entropy, "logprob_gap": gap, **roll_up(steps_out),
                      "lr": optimizer.param_groups[0]["lr"], "optimizer_steps": acc.steps,
                      "weight_syncs": engine.loads - syncs, "memory_peak_gib": memory_peak_gib(world.device)}
            if evaluates:
                with log.phase("eval"):
                    record.update(evaluate(step + 1))  # the policy after this step's update
                profile.mark("eval")
            terminate = stop()
            if (saves and evaluates) or (terminate and not saves):  # saved in the update window already
                with log.phase("checkpoint", announce=f"saving the checkpoint of step {step + 1}"):
                    handoff.save_after_publication(save)  # B23: validation and emergency saves
            record["time/step"] = time.perf_counter() - t_step
            record["tokens_per_s"] = record["completion_len_mean"] * rl.batch_per_replica / record["time/step"]
            if profile.enabled:
                record["grpo_step"] = profile.take()
            log.write(record)
            stall.step(stepped, step)  # raises after --rl.max-skipped-steps steps without an update
            if terminate:
                log.info(f"{stop.name}: saved {args.checkpoint_dir} at step {step + 1}; exiting")
                break
            if args.log.target_eval_accuracy and record.get("eval_accuracy", 0.0) >= args.log.target_eval_accuracy:
                log.info(f"eval_accuracy {record['eval_accuracy']:.3f} reached --log.target-eval-accuracy; stopping")
                break

        # ---- final policy in Hugging Face format ----
        if not terminate:
            handoff.to_trainer()
            card = model_card("GRPO", args, step + 1, record.get("eval_accuracy"))
            with log.phase("export", announce=f"exporting the policy to {args.log.run_dir}/final"):
                export_hf(policy, path, os.path.join(args.log.run_dir, "final"), world.is_main, dtype, card)
            dist.barrier()
    except BaseException:
        handoff.cleanup()  # B24: never masks the error being raised
        dist.quietly(engine.close)
        raise
    else:
        engine.close()
    finally:
        log.close()
    return record


def hand_off(engine, policy, optimizer, ref, args: GRPOArgs, profile: Profile | None = None) -> HandOff:
    """The card's hand-off between the engine and all the trainer holds: the policy with its optimizer,
    and the frozen reference (B20); the engine gets the policy in the compute dtype."""
    trainer = Together(TrainerOffload(policy, optimizer), *([TrainerOffload(ref)] if ref is not None else []))
    return HandOff(engine, trainer, lambda: dist.full_parameters(policy, models.DTYPES[args.model.dtype]),
                   enabled=args.rl.colocated_offload, sleep_level=args.rollout.sleep_level, profile=profile)


def update(policy, ref, acc: Accumulator, store: RolloutStore, args: GRPOArgs, probe: "Probe",
           ahead: bool) -> tuple[list[dict], list[dict]]:
    """Train on one collected batch: mu_iterations x n_mini optimizer steps of planned micro-batches.

    The (mini, micro) loop passes indices only; the store materializes this rank's rows on the
    trainer's device (B3). pi_old: the ahead pass's record when `ahead` (B17); else the engine's
    logprobs under --rl.use-rollout-logprobs-for-loss; else `logp.detach()`, exact when nothing
    moved yet (B5). The reference scores a chunk before the policy does, so its activations are
    gone before the policy's graph is built. `grpo_logprob_gap`: mean |trainer - engine| logprob
    on the calls scored at the sampling weights (the engine's kernels differ from the trainer's).
    Returns the per-call objective metrics and the per-step accumulator metrics.
    """
    rl = args.rl
    policy.train()
    old_logps = ahead_pass(policy, store, probe) if ahead else None
    steps_before = acc.steps
    calls, steps_out = [], []
    for _ in range(rl.mu_iterations):
        k = 0  # call order within the epoch: the key of the ahead pass's record
        for mini, micros in enumerate(store.plan):
            acc.n_micro = len(micros)  # fixed by config, or decided per mini-batch by the token budget
            for micro in range(len(micros)):
                k += 1
                c = store.chunk(mini, micro)                                    # (rows, T_c)
                ref_logp = None
                if ref is not None:
                    with torch.no_grad():
                        ref_logp = score(ref, c["input_ids"], lengths=c["lengths"])
                logp, entropy = score(policy, c["input_ids"], entropy=True, lengths=c["lengths"])
                at_sampling = old_logps[k - 1] if old_logps is not None else (
                    logp.detach() if acc.steps == steps_before else None)
                if rl.use_rollout_logprobs_for_loss:
                    old = c["rollout_logp"]
                else:
                    old = at_sampling if at_sampling is not None else logp.detach()
                loss, divisor, m = policy_loss(logp, old, c["advantages"], c["mask"], rl.clip_eps, ref_logp, rl.kl_coef,
                                               clip_eps_high=rl.clip_eps_high, dual_clip=rl.dual_clip, entropy=entropy)
                m["grpo_computed_tokens"] = models.computed_tokens(policy, c["input_ids"], c["lengths"])
                if at_sampling is not None:
                    m["grpo_logprob_gap"] = logprob_gap(at_sampling, c["rollout_logp"], c["mask"])
                calls.append(m)
                out = acc.backward(loss, divisor)
                if out is not None:
                    steps_out.append(out)
    return calls, steps_out


@torch.no_grad()
def ahead_pass(policy, store: RolloutStore, probe: "Probe") -> list[torch.Tensor]:
    """pi_old for every planned chunk, scored in eval() before any optimizer step (B17).

    Keyed by call order: the training loop walks the same (mini, micro) plan in the same order.
    The first chunk of the run also feeds the one-shot determinism probe (B19).
    """
    out = []
    policy.eval()
    for mini, micros in enumerate(store.plan):
        for micro in range(len(micros)):
            c = store.chunk(mini, micro)
            out.append(score(policy, c["input_ids"], lengths=c["lengths"]))
            if not probe.done:
                probe(c, out[-1])
    policy.train()
    return out


class Probe:
    """One-shot screen for a stochastic forward (spec: "The determinism probe").

    On the first ahead chunk of a run, re-score it in train() mode at unchanged weights and
    compare with the eval() record. Fails when the mesh-wide fraction of completion tokens whose
    logprob moved more than the model's declared per-token bound exceeds its tolerance. A model
    declares them as `config.minirl_forward_noise = {"nats": ..., "tolerance": ...}`; one that
    declares none gets the strict gate: 0.05 nats on any token.
    """

    def __init__(self, policy):
        declared = getattr(policy.config, "minirl_forward_noise", None) or {}
        self.nats = float(declared.get("nats", 0.05))
        self.tolerance = float(declared.get("tolerance", 0.0))
        self.policy, self.done, self.fraction = policy, False, None

    @torch.no_grad()
    def __call__(self, c: dict, eval_logp) -> None:
        self.done = True
        self.policy.train()
        mask = c["mask"]
        moved = ((score(self.policy, c["input_ids"], lengths=c["lengths"]) - eval_logp).abs() > self.nats).float() * mask
        self.policy.eval()
        counts = dist.all_reduce(torch.stack([moved.sum(), mask.sum()]).double())
        self.fraction = (counts[0] / counts[1].clamp_min(1)).item()
        if self.fraction > self.tolerance:
            raise RuntimeError(
                f"determinism probe: {self.fraction:.1%} of tokens moved more than {self.nats} nats between "
                f"eval() and train() forwards at unchanged weights (tolerance {self.tolerance:.1%}). pi_old "
                "from the ahead pass would not match training: disable dropout/stochastic layers, or run "
                "with --rl.mini-batch-per-replica 0 --rl.mu-iterations 1")


def cli(argv: list[str] | None = None) -> None:
    """The `minirl-grpo` console script and `python -m minirl.grpo`."""
    launch.run("minirl.grpo", main, argv)


if __name__ == "__main__":
    cli()
