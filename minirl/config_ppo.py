"""PPO's configuration (`minirl.ppo`): the step's prompts and samples, the streaming threshold and
sampler, the placement; `validate()` enforces streaming's support limits (rules S1, S20 in
docs/invariants.md) and the data-parallel alignment of the batch (S21).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from minirl.config import (CheckpointConfig, ConfigError, GridConfig, Launch, LogConfig, ModelConfig, OptimConfig,
                           RolloutConfig, TaskConfig, _check_numbers, _check_optimization, _check_run, _positive)


@dataclass
class AdvEstimatorConfig:
    normalize_advantages: bool = True
    """Whiten advantages; under streaming this happens within each chunk (a warning says so at start-up)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""


@dataclass
class PPOConfig(OptimConfig):
    num_prompts_per_step: int = 16
    """Prompt groups per step (P)."""
    num_generations_per_prompt: int = 4
    """Samples per prompt (G); the critic trains on P x G samples per epoch."""
    ppo_epochs: int = 1
    """Policy epochs per step, each one optimizer step over the whole batch; streaming requires 1."""
    critic_ppo_epochs: int = 1
    """Critic epochs per step, each over the whole assembled batch."""
    critic_warmup_steps: int = 0
    """First steps that train only the critic (no policy update, no refit)."""
    weight_decay: float = 0.01
    """AdamW weight decay of the policy and the critic (verl's default; GRPO's is 0)."""
    value_lr: float = 1e-4
    """Critic AdamW learning rate (the peak; the same schedule as the policy's)."""
    policy_micro_batch_rows: int = 0
    """Rows per policy forward/backward on each train rank, within a chunk (0 = the whole chunk); the
    step stays exact at any size (deferred normalization). Lower it if the policy runs out of memory."""
    critic_micro_batch_rows: int = 0
    """Rows per critic forward/backward on each train rank (0 = all of them at once); exact at any
    size, as for the policy. Lower it if critic training runs out of memory."""
    adv_estimator: AdvEstimatorConfig = field(default_factory=AdvEstimatorConfig)


@dataclass
class SamplerConfig:
    name: Literal["in_order", "ready_first"] = "in_order"
    """in_order: take ready groups in issue order; ready_first: take any ready group."""
    max_lookahead_versions: int = 1
    """A group sampled by policy version v is used at step s only if s - v <= this."""


@dataclass
class AsyncRLConfig:
    min_groups_for_streaming_train: int = 4
    """Ready groups needed before a chunk trains; equal to --ppo.num-prompts-per-step = full batch."""
    rollout_groups_per_call: int = 2
    """Groups a rollout rank submits to vLLM at once (smaller = groups complete in more waves)."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)


@dataclass
class PPOFlags:
    """PPO's own flags and checks (PPOArgs lists them before the launch's in --help)."""

    LOOP = "ppo"  # the loop these flags start (checkpoints record it)
    steps: int = 20
    """Policy steps to run."""
    seed: int = 0
    """Base seed: data order and per-request sampling seeds derive from it."""
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    grid: GridConfig = field(default_factory=lambda: GridConfig(gpu_placement="disaggregated", rollout_ranks=1))
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def streaming(self) -> bool:
        return self.async_rl.min_groups_for_streaming_train < self.ppo.num_prompts_per_step

    def validate(self, world_size: int) -> "PPOArgs":
        p, a = self.ppo, self.async_rl
        _check_numbers(self)  # every count >= 0 and every float finite, first
        _positive("--steps", self.steps)
        _positive("--ppo.num-prompts-per-step", p.num_prompts_per_step)
        _positive("--ppo.num-generations-per-prompt", p.num_generations_per_prompt)
        _positive("--ppo.critic-ppo-epochs", p.critic_ppo_epochs)
        if p.critic_warmup_steps >= self.steps:  # the policy would end as it started
            raise ConfigError(f"--ppo.critic-warmup-steps={p.critic_warmup_steps} leaves none of --steps={self.steps} "
                              "to the policy: give fewer warmup steps or more steps")
        if not 1 <= a.min_groups_for_streaming_train <= p.num_prompts_per_step:
            raise ConfigError(f"--async-rl.min-groups-for-streaming-train={a.min_groups_for_streaming_train} must be "
                              f"in [1, --ppo.num-prompts-per-step={p.num_prompts_per_step}]")
        if a.sampler.name not in ("in_order", "ready_first"):
            raise ConfigError(f"--async-rl.sampler.name={a.sampler.name!r}: use in_order or ready_first")
        _positive("--ppo.ppo-epochs", p.ppo_epochs)
        if self.streaming and p.ppo_epochs != 1:
            raise ConfigError(f"--ppo.ppo-epochs={p.ppo_epochs}: streaming requires 1; several policy epochs need "
                              f"full batch (--async-rl.min-groups-for-streaming-train={p.num_prompts_per_step})")
        if self.grid.gpu_placement == "colocated":
            if self.streaming:
                raise ConfigError("PPO streaming needs separate generation ranks: use --grid.gpu-placement "
                                  "disaggregated, or full batch colocated with --async-rl.min-groups-for-streaming-"
                                  f"train={p.num_prompts_per_step}")
            dp = world_size
        else:
            if not 0 < self.grid.rollout_ranks < world_size:
                fits = f"--grid.rollout-ranks in [1, {world_size - 1}]" if world_size > 1 else "two ranks or more"
                least = max(self.grid.rollout_ranks, 1) + 1  # its rollout ranks and a train rank
                raise ConfigError(f"disaggregated PPO needs separate generation ranks: {fits} (this launch has "
                                  f"{world_size} rank(s); start it with torchrun --nproc-per-node {least} or more, or "
                                  "use --grid.gpu-placement colocated with full batch: --async-rl.min-groups-for-"
                                  f"streaming-train={p.num_prompts_per_step})")
            dp = world_size - self.grid.rollout_ranks
        if p.num_prompts_per_step % dp:
            other = ""
            if dp < world_size:  # disaggregated: the fewest rollout ranks whose train ranks split them
                r = next(r for r in range(1, world_size) if p.num_prompts_per_step % (world_size - r) == 0)
                other = f", or --grid.rollout-ranks {r} ({world_size - r} train rank(s))"
            raise ConfigError(f"--ppo.num-prompts-per-step={p.num_prompts_per_step} must split evenly over "
                              f"{dp} train rank(s); use a multiple of {dp}{other}")
        _positive("--async-rl.rollout-groups-per-call", a.rollout_groups_per_call)
        _check_optimization("ppo", p)
        _positive("--ppo.value-lr", p.value_lr)
        for flag, v in (("--ppo.adv-estimator.gamma", p.adv_estimator.gamma), ("--ppo.adv-estimator.lam",
                                                                               p.adv_estimator.lam)):
            if not 0 <= v <= 1:
                raise ConfigError(f"{flag}={v} must be in [0, 1]")
        _check_run(self)
        return self


@dataclass
class PPOArgs(Launch, PPOFlags):  # a dataclass lists its bases' fields last base first: the run's own on top
    """PPO with a critic, streamed: the trainer starts on completed groups while the rest still generate.

    One rollout rank and one train rank: torchrun --nproc-per-node 2 -m minirl.ppo --steps 20
    """
