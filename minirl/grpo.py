"""GRPO with batch, mini-batch and micro-batch (docs/guide-batching.md), colocated on every rank.

    python -m minirl.grpo --steps 20                            # one process, CPU, built-in task
    torchrun --nproc-per-node 2 -m minirl.grpo --steps 20       # two ranks: FSDP2 over gloo/NCCL

Each step: sample G completions for P prompts -> score -> group advantages -> (mu_iterations x)
n_mini optimizer steps of n_micro chunks each -> publish the weights -> report, once per collected
batch (B4). The harness (run.py) runs around it in a line each.

Departures from the GRPO paper: no reference KL unless --rl.kl-coef > 0; by default a token mean over
the mini-batch (DAPO-style; --rl.loss-agg-mode seq-mean-token-mean is the paper's), exact under
micro-batching by the deferred divisor (accumulator.py).

Shapes: P prompts, G = group_size, B = P*G sequences (B_r on this rank), T tokens.
"""

from __future__ import annotations

import sys

import torch

from minirl import dist, launch, models
from minirl.accumulator import Accumulator, across_ranks, lr_schedule, roll_up
from minirl.batch import RolloutStore, pack, plan_chunks
from minirl.config_grpo import GRPOArgs
from minirl.gae import group_advantages
from minirl.logger import engine_log, sample_metrics, training_rows
from minirl.models import token_logprobs as score
from minirl.objective import logprob_gap, policy_loss
from minirl.offload import HandOff, Together, TrainerOffload
from minirl.rollout import Engine
from minirl.run import Run
from minirl.tasks import dp_partition, held_out, prompt_id, scored


def main(argv: list[str] | None = None) -> dict:
    """Every check first, on the command layer (launch.preflight); then the loop."""
    ready = launch.preflight(GRPOArgs, argv, sys.modules[__name__])
    return train(ready) if ready else {}


def train(ready: launch.Ready) -> dict:
    args, rl, task, tok = ready.args, ready.args.rl, ready.task, ready.tok
    if rl.deterministic:
        dist.set_deterministic()  # B15: before CUDA is up
    world = dist.init()
    G, dp, limit = rl.group_size, world.world_size, args.rollout.max_prompt_tokens
    P = rl.batch_per_replica // G
    n_micro = "by token budget" if rl.max_tokens_per_micro_batch else args.n_micro
    run = Run(ready, world, f"{dp} rank(s) on {world.device}; n_mini={args.n_mini} n_micro={n_micro}",
              rows=rl.batch_per_replica)  # TRY NOT TO MODIFY: the harness (log, resume, signals, schedule)

    # ---- build: trainer (FSDP2, float32 masters), reference, engine side by side ----
    dist.seed_everything(args.seed)
    with run.phase("build_trainer", announce="loading the policy (FSDP2)"):
        policy = models.sharded(ready.path, "policy", world, args.model.dtype, args.model.packing,
                                checkpointing=args.model.activation_checkpointing,
                                temperature=args.rollout.temperature)  # scored as the engine samples
        ref = models.sharded(ready.path, "reference", world, args.model.dtype, like=policy) if rl.kl_coef else None
    run.info(models.load_report(args.model.packing, policy))
    optimizer = models.adamw(policy, rl.lr, rl.weight_decay)
    total = args.steps * args.n_mini * rl.mu_iterations  # optimizer steps of the whole run
    acc = Accumulator(policy, optimizer, args.n_micro, rl.max_grad_norm,
                      schedule=lr_schedule(rl.lr, rl.lr_warmup_steps, total, rl.lr_schedule, rl.min_lr_ratio))
    probe = Probe(policy)
    with run.phase("build_engine", announce="building the vLLM engine"):
        engine = Engine(ready.path, args.rollout, args.rollout.max_model_len, world.engine_device,
                        dtype=args.model.dtype, seed=args.seed, sleep_mode=rl.colocated_offload,
                        log_file=engine_log(args.log, world.rank, dp > 1))
    handoff = hand_off(engine, policy, optimizer, ref, args, run.mark)
    run.checkpoints({"policy": (policy, optimizer)},
                    lambda: {"optimizer_steps": acc.steps, "skipped": acc.skipped, "probe_done": probe.done})

    def evaluate(version: int) -> dict:  # greedy accuracy on the held-out prompts (a collective over the ranks)
        return {**held_out(engine, task, tok, limit, world.rank, dp, version), "eval_version": version}

    with run.guard(handoff.cleanup, engine.close):  # TRY NOT TO MODIFY: the error raised is the one that stopped it
        if run.resume:  # B25: the engine sleeps before the trainer loads; the restored policy is published first
            state = handoff.restore(run.load)
            acc.steps, acc.skipped, probe.done = state["optimizer_steps"], state["skipped"], state["probe_done"]
            run.resumed([(optimizer, acc.schedule(acc.steps), "--rl.lr")])
        else:
            handoff.start_fresh()
            run.baseline(evaluate, "scoring the held-out prompts before training")  # before the first update
        for step in run.steps():
            # ---- sample: this rank's share of the step's P prompts (B14: canonical partition) ----
            pids = [prompt_id(0, step * P + i) for i in range(P)]
            keys = [(pid, j) for pid in pids for j in range(G)]                # (group_id, id) of all B rows
            mine = sorted({keys[i][0] for i in dp_partition(keys, world.rank, dp)})
            with run.phase("generate"):
                samples, rewards, parts = scored(engine, task, tok, [task.train_problem(p) for p in mine], mine, G,
                                                 limit, step=step)
            # ---- score: group advantages, then this rank's rows as (mini, micro) chunks ----
            with run.phase("score"):
                rewards = torch.tensor(rewards)                                   # (B_r,)
                if dist.fault_due("nan_rewards", step, onward=True):  # tests: a run that can no longer learn
                    rewards = rewards * float("nan")
                advantages = group_advantages(rewards, G, rl.scale_by_std)        # (B_r,)
                batch = pack(samples, advantages, ready.pad_id)                  # (B_r, T) tensors
                chunks = plan_chunks(batch["lengths"].tolist(), args.n_mini, args.micro_batch // dp,
                                     rl.max_tokens_per_micro_batch, lambda rows: models.computed_tokens(policy, rows))
                ahead = args.needs_cached_old_logprobs
                store = RolloutStore(batch, chunks, reads_per_chunk=rl.mu_iterations + ahead,  # B18: same predicate
                                     device=world.device)
            # ---- update: the trainer holds the card while the rollout sleeps (B20) ----
            handoff.to_trainer()
            steps_before, loads = acc.steps, engine.loads
            with run.phase("train", extra=acc.timer()):
                calls, steps_out = update(policy, ref, acc, store, args, probe, ahead)
            store.close()
            stepped = acc.steps > steps_before  # False: every window of this batch was non-finite
            if run.saves(step, stepped) and not run.evaluates(step):
                handoff.save_in_update_window(lambda: run.save(step))  # B22: before publication, one publish
            # ---- publish: wake the weights, sync, offload the trainer, wake the KV cache (B20) ----
            with run.phase("publish"):
                handoff.publish()
            # ---- report once per collected batch (B4) ----
            rolled, named = across_ranks(roll_up(calls)), dict(zip(task.scorer.names, parts))
            record = {**sample_metrics(rewards, G, samples.lengths, samples.clipped, named),
                      "entropy": rolled.pop("grpo_entropy", None), "logprob_gap": rolled.pop("grpo_logprob_gap", None),
                      **rolled, **roll_up(steps_out), "lr": optimizer.param_groups[0]["lr"],
                      "optimizer_steps": acc.steps, "weight_syncs": engine.loads - loads,
                      "train_samples": training_rows(tok, samples.prompt_tokens, samples.completion_tokens, rewards,
                                                     named, samples.clipped, args.log.train_samples)}
            if run.evaluates(step):
                with run.phase("eval"):
                    record.update(evaluate(step + 1))  # the policy after this step's update
            # B23: a validation or emergency save comes after publication, in a window of its own
            run.end_step(step, record, stepped, save=lambda: handoff.save_after_publication(lambda: run.save(step)))
        run.finish(policy, before=handoff.to_trainer)  # final/ in Hugging Face format
    return run.record


def hand_off(engine, policy, optimizer, ref, args: GRPOArgs, mark=None) -> HandOff:
    """The card's hand-off between the engine and all the trainer holds (policy, optimizer, reference; B20)."""
    trainer = Together(TrainerOffload(policy, optimizer), *([TrainerOffload(ref)] if ref is not None else []))
    return HandOff(engine, trainer, lambda: dist.full_parameters(policy, models.DTYPES[args.model.dtype]),
                   enabled=args.rl.colocated_offload, sleep_level=args.rollout.sleep_level, mark=mark)


def update(policy, ref, acc: Accumulator, store: RolloutStore, args: GRPOArgs, probe: "Probe",
           ahead: bool) -> tuple[list[dict], list[dict]]:
    """Train on one collected batch: mu_iterations x n_mini optimizer steps of planned micro-batches.

    The loop passes indices only; the store materializes the rows on the trainer's device (B3). pi_old:
    the ahead pass's record when `ahead` (B17); else the engine's logprobs under
    --rl.use-rollout-logprobs-for-loss; else `logp.detach()`, exact while nothing has moved (B5). The
    reference scores a chunk before the policy, so its activations are gone before the policy's graph.
    Returns the per-call objective metrics and the per-step accumulator metrics."""
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
                logp, entropy = score(policy, c["input_ids"], entropy="grad" if rl.entropy_coef else True,
                                      lengths=c["lengths"])
                at_sampling = old_logps[k - 1] if old_logps is not None else (
                    logp.detach() if acc.steps == steps_before else None)
                if rl.use_rollout_logprobs_for_loss:
                    old = c["rollout_logp"]
                else:
                    old = at_sampling if at_sampling is not None else logp.detach()
                loss, divisor, m = policy_loss(logp, old, c["advantages"], c["mask"], ref_logp=ref_logp, entropy=entropy,
                                               **rl.loss_options(args.rollout.max_tokens))
                m["grpo_computed_tokens"] = models.computed_tokens(policy, c["lengths"])
                if at_sampling is not None:
                    m["grpo_logprob_gap"] = logprob_gap(at_sampling, c["rollout_logp"], c["mask"])
                calls.append(m)
                out = acc.backward(loss, divisor)
                if out is not None:
                    steps_out.append(out)
    return calls, steps_out


@torch.no_grad()
def ahead_pass(policy, store: RolloutStore, probe: "Probe") -> list[torch.Tensor]:
    """pi_old for every planned chunk, scored in eval() before any optimizer step (B17), keyed by call
    order; the run's first chunk also feeds the determinism probe (B19)."""
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
    """One-shot screen for a stochastic forward (B19): the run's first ahead chunk re-scored in train() at
    unchanged weights must not move more than the model's declared share of tokens by more than its
    declared bound (`config.minirl_forward_noise = {"nats", "tolerance"}`; by default no token moves 0.05 nats)."""

    def __init__(self, policy, done: bool = False):
        declared = getattr(policy.config, "minirl_forward_noise", None) or {}
        self.nats = float(declared.get("nats", 0.05))
        self.tolerance = float(declared.get("tolerance", 0.0))
        self.policy, self.done, self.fraction = policy, done, None  # done: a resumed run's probe already ran

    @torch.no_grad()
    def __call__(self, c: dict, eval_logp) -> None:
        self.done = True
        self.policy.train()
        mask = c["mask"]
        moved = (score(self.policy, c["input_ids"], lengths=c["lengths"]) - eval_logp).abs() > self.nats
        moved = moved.float() * mask
        self.policy.eval()
        counts = dist.all_reduce(torch.stack([moved.sum(), mask.sum()]).double())
        self.fraction = (counts[0] / counts[1].clamp_min(1)).item()  # once a run: a host read (a GPU sync)
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
