"""GRPO with batch, mini-batch and micro-batch (spec/batching.md), colocated on every rank.

    python -m minirl.grpo --steps 20                            # one process, CPU, built-in task
    torchrun --nproc-per-node 2 -m minirl.grpo --steps 20       # two ranks: FSDP2 over gloo/NCCL

Each loop step: sample G completions for P prompts with vLLM -> score -> group advantages ->
n_mini optimizer steps of n_micro forward/backward chunks each -> publish the new weights to
the engine -> log. Weight sync, the reward report and evaluation happen once per collected
batch, never per optimizer step (B4).

How it departs from the GRPO paper: no reference KL unless --rl.kl-coef > 0; the loss is a
token mean over the whole mini-batch (DAPO-style), made exact under micro-batching by the
deferred divisor (accumulator.py).

Shapes: P prompts, G = group_size, B = P*G sequences (B_r on this rank), T tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import tyro

from minirl import dist, models
from minirl.models import token_logprobs as score
from minirl.accumulator import Accumulator, across_ranks, roll_up
from minirl.batch import chunk, pack
from minirl.checkpoint import export_hf
from minirl.config import ConfigError, GRPOArgs
from minirl.gae import group_advantages
from minirl.logger import RunLog
from minirl.objective import policy_loss
from minirl.rollout import Engine, check_model
from minirl.tasks import dp_partition, make_task, prompt_id


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(GRPOArgs, args=argv, description=__doc__)
    world = dist.init()
    args.validate(world.world_size)
    path = models.resolve_path(args.model)
    max_model_len = args.rollout.max_prompt_tokens + args.rollout.max_tokens
    check_model(path, args.rollout, max_model_len, head_dim_flag="--model.tiny.num-heads")
    log = RunLog(args.log.run_dir, enabled=world.is_main, every=args.log.every)
    log.info(f"minirl.grpo: {world.world_size} rank(s) on {world.device}; model {path}; "
             f"n_mini={args.n_mini} n_micro={args.n_micro}")
    if world.is_main:
        with open(os.path.join(args.log.run_dir, "config.json"), "w") as f:
            json.dump(args.to_dict(), f, indent=2)

    # ---- build: task, trainer (FSDP2), reference, engine ----
    dist.seed_everything(args.seed)
    rl = args.rl
    task = make_task(args.task, args.seed)
    tok = models.load_tokenizer(path)
    policy = dist.shard(models.load_policy(path, args.model.dtype), world, models.DTYPES[args.model.dtype])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=rl.lr, weight_decay=rl.weight_decay)
    acc = Accumulator(policy, optimizer, args.n_micro, rl.max_grad_norm)
    ref = None
    if rl.kl_coef:
        ref = dist.shard(models.load_reference(path, args.model.dtype), world, models.DTYPES[args.model.dtype])
    with log.phase("build_engine"):
        engine = Engine(path, args.rollout, max_model_len, dtype=args.model.dtype, seed=args.seed,
                        sleep_mode=rl.colocated_offload)
    try:
        return _loop(args, world, task, tok, policy, ref, acc, engine, log, path)
    finally:
        engine.close()
        log.close()


def _loop(args, world, task, tok, policy, ref, acc, engine, log, path) -> dict:
    rl, G, dp = args.rl, args.rl.group_size, world.world_size
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    P = rl.batch_per_replica // G
    mini_r, micro_r = args.mini_batch // dp, args.micro_batch // dp  # this rank's rows per mini / micro
    record: dict = {}
    for step in range(args.steps):
        t_step = time.perf_counter()
        # ---- sample: this rank's share of the step's P prompts (B14: canonical partition) ----
        pids = [prompt_id(0, step * P + i) for i in range(P)]
        keys = [(pid, j) for pid in pids for j in range(G)]              # (group_id, id) of all B rows
        mine = sorted({keys[i][0] for i in dp_partition(keys, world.rank, dp)})
        problems = {pid: task.train_problem(pid) for pid in mine}
        prompts = [_encode(tok, problems[pid].prompt, args.rollout.max_prompt_tokens) for pid in mine]
        with log.phase("generate"):
            samples = engine.generate(prompts, mine, G)
        # ---- score and advantages ----
        texts = tok.batch_decode(samples.completion_tokens, skip_special_tokens=True)
        rewards = torch.tensor([task.reward(t, problems[pid].answer)
                                for t, pid in zip(texts, samples.prompt_ids)])   # (B_r,)
        advantages = group_advantages(rewards, G, rl.scale_by_std)              # (B_r,)
        batch = pack(samples, advantages, pad_id)                              # tensors, (B_r, T)

        # ---- update: n_mini optimizer steps of n_micro chunks (indices only, B3) ----
        engine.sleep()
        with log.phase("train"):
            policy.train()
            old_logps = _ahead_pass(policy, batch, args, mini_r, micro_r)  # pi_old frozen across the window (B17)
            calls, steps_out = [], []
            for mini in range(args.n_mini):
                for micro in range(args.n_micro):
                    if acc.discarding():  # rest of a poisoned window (B12)
                        continue
                    c = chunk(batch, mini * mini_r + micro * micro_r, micro_r)   # (micro_r, T_c)
                    logp = score(policy, c["input_ids"])
                    if old_logps is not None:
                        old = old_logps[mini * args.n_micro + micro]
                    elif rl.use_rollout_logprobs_for_loss:
                        old = c["rollout_logp"]
                    else:
                        old = logp.detach()
                    ref_logp = None
                    if ref is not None:
                        with torch.no_grad():
                            ref_logp = score(ref, c["input_ids"])
                    loss, divisor, m = policy_loss(logp, old, c["advantages"], c["mask"], rl.clip_eps,
                                                   ref_logp, rl.kl_coef)
                    calls.append(m)
                    out = acc.backward(loss, divisor)
                    if out is not None:
                        steps_out.append(out)
        # ---- publish: wake the weights, sync, then the KV cache (B20) ----
        engine.wake_up(["weights"])
        with log.phase("weight_sync"):
            engine.load_weights(dist.full_parameters(policy))
        engine.wake_up(["kv_cache"])

        # ---- report once per collected batch (B4) ----
        n_tokens = torch.tensor(float(sum(map(len, samples.completion_tokens))))
        reward_sum = dist.all_reduce(torch.tensor([rewards.sum().item(), float(len(rewards))]))
        record = {"step": step, "reward_mean": (reward_sum[0] / reward_sum[1]).item(),
                  **across_ranks(roll_up(calls)), **roll_up(steps_out), "optimizer_steps": acc.steps}
        if args.log.eval_every and (step % args.log.eval_every == 0 or step == args.steps - 1):
            with log.phase("eval"):
                record["eval_accuracy"] = evaluate(engine, task, tok, world, args.rollout.max_prompt_tokens)
        record["time/step"] = time.perf_counter() - t_step
        record["tokens_per_s"] = dist.all_reduce(n_tokens).item() / record["time/step"]
        log.write(record)

    # ---- final policy in Hugging Face format ----
    export_hf(policy, path, os.path.join(args.log.run_dir, "final"), world.is_main)
    dist.barrier()
    return record


def _encode(tok, text: str, limit: int) -> list[int]:
    ids = tok(text, add_special_tokens=False).input_ids
    if len(ids) > limit:
        raise ValueError(f"a prompt has {len(ids)} tokens, over --rollout.max-prompt-tokens={limit}")
    return ids


def _ahead_pass(policy, batch, args: GRPOArgs, mini_r: int, micro_r: int) -> list[torch.Tensor] | None:
    """pi_old for every chunk of the window, scored once before any optimizer step (B17).

    Only when n_mini > 1 and the loss does not take the engine's logprobs: at n_mini == 1 nothing
    moves between the forward and the update, so `logp.detach()` is exact and the pass is skipped.
    Keyed by call order: the training loop walks the same (mini, micro) product in the same order.
    """
    if args.n_mini == 1 or args.rl.use_rollout_logprobs_for_loss:
        return None
    out = []
    policy.eval()
    with torch.no_grad():
        for mini in range(args.n_mini):
            for micro in range(args.n_micro):
                c = chunk(batch, mini * mini_r + micro * micro_r, micro_r)
                out.append(score(policy, c["input_ids"]))
    policy.train()
    return out


@torch.no_grad()
def evaluate(engine: Engine, task, tok, world, max_prompt_tokens: int) -> float:
    """Greedy accuracy on the task's held-out prompts, split over ranks, averaged over all."""
    share = task.eval_set[world.rank::world.world_size]
    if share:
        prompts = [_encode(tok, p.prompt, max_prompt_tokens) for p in share]
        out = engine.generate(prompts, list(range(len(share))), 1, greedy=True)
        texts = tok.batch_decode(out.completion_tokens, skip_special_tokens=True)
        hits = sum(task.reward(t, p.answer) for t, p in zip(texts, share))
    else:
        hits = 0.0
    tot = dist.all_reduce(torch.tensor([float(hits), float(len(share))]))
    return (tot[0] / tot[1]).item()


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:  # a flag the run cannot use: say which, no traceback
        print(f"minirl.grpo: error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        dist.shutdown()
