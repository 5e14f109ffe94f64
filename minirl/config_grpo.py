"""GRPO's configuration (`minirl.grpo`): the batch / mini / micro sizes and the objective's flags.

Derived sizes (`n_mini`, `n_micro`) are properties computed here and never settable (rules B1-B2,
B11 in docs/invariants.md); `validate()` checks divisibility at every level and over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tyro

from minirl.config import (CheckpointConfig, ConfigError, GridConfig, Launch, LogConfig, ModelConfig, OptimConfig,
                           RolloutConfig, TaskConfig, _check_numbers, _check_optimization, _check_run,
                           _positive)


@dataclass
class RLConfig(OptimConfig):
    group_size: int = 8
    """Samples per prompt (G, at least 2); advantages are taken within each group."""
    batch_per_replica: int = 32
    """Trajectories per collected batch per policy replica; a positive multiple of group_size."""
    mini_batch_per_replica: int = 0
    """Trajectories per optimizer step; 0 = the whole batch (one step)."""
    micro_batch_per_replica: int = 0
    """Trajectories per forward/backward; 0 = the whole mini-batch (no accumulation)."""
    max_tokens_per_micro_batch: int = 0
    """Token-budgeted micro-batching: split each mini-batch into micro-batches of at most this many
    computed tokens (packed lanes with --model.packing, one lane under flash attention, else rows x longest
    row), rows of like length together (0 = off; replaces --rl.micro-batch-per-replica)."""
    mu_iterations: int = 1
    """Inner PPO epochs over one collected batch, all scored against the frozen pi_old."""
    grad_accum: tyro.conf.Suppress[int] = 1
    """Retired for GRPO (B11): the accumulation count is derived; not a flag (launch.parse refuses it by
    name, pointing at --rl.micro-batch-per-replica), and a config file that sets it is refused too."""
    scale_by_std: bool = True
    """Divide group advantages by the group's reward std."""
    deterministic: bool = False
    """Turn on torch's deterministic algorithms (CUDA: CUBLAS_WORKSPACE_CONFIG must be set at launch)."""


@dataclass
class GRPOFlags:
    """GRPO's own flags and checks (GRPOArgs lists them before the launch's in --help)."""

    LOOP = "grpo"  # the loop these flags start (checkpoints record it)
    REFUSED = {  # flags GRPO does not have, and what to use instead (launch.parse)
        "--rl.grad-accum": "--rl.grad-accum is retired for GRPO: the accumulation count is derived. Set "
                           "--rl.micro-batch-per-replica to accumulate gradients over smaller chunks",
        "--grid.": "GRPO runs colocated, every rank generating and training: it has no --grid.* flags "
                   "(disaggregated placement is for PPO streaming, minirl.ppo)"}

    steps: int = 20
    """Collected batches (loop steps) to run."""
    seed: int = 0
    """Base seed: model init, data order and per-request sampling seeds derive from it."""
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    grid: tyro.conf.Suppress[GridConfig] = field(default_factory=GridConfig)  # GRPO is colocated: not a flag
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    # ---- derived: computed, never configured (B2) ----
    @property
    def mini_batch(self) -> int:
        return self.rl.mini_batch_per_replica or self.rl.batch_per_replica

    @property
    def micro_batch(self) -> int:
        return self.rl.micro_batch_per_replica or self.mini_batch

    @property
    def n_mini(self) -> int:
        return self.rl.batch_per_replica // self.mini_batch

    @property
    def n_micro(self) -> int:
        """Micro-batches per optimizer step; with a token budget, decided per mini-batch at run time."""
        return self.mini_batch // self.micro_batch

    @property
    def needs_cached_old_logprobs(self) -> bool:
        """Several optimizer steps per collected batch move the policy under later chunks, so pi_old
        must be scored once up front (B17), unless the
        loss takes the engine's logprobs. GRPO's clipped objective always consumes pi_old."""
        return (self.n_mini > 1 or self.rl.mu_iterations > 1) and not self.rl.use_rollout_logprobs_for_loss

    def validate(self, world_size: int) -> "GRPOArgs":
        """Raise ConfigError naming the flag for anything the run cannot do. Cheap: no I/O but stat()."""
        rl = self.rl
        _check_numbers(self)  # every count >= 0 and every float finite, first
        _positive("--steps", self.steps)
        if rl.group_size < 2:  # a group of one is its own mean: every advantage 0, nothing learned
            raise ConfigError(f"--rl.group-size={rl.group_size} must be >= 2: GRPO's baseline is the group's mean "
                              "reward (for one sample per prompt, use minirl.ppo and its critic)")
        _positive("--rollout.max-tokens", self.rollout.max_tokens)
        if rl.batch_per_replica <= 0 or rl.batch_per_replica % rl.group_size:
            raise ConfigError(
                f"--rl.batch-per-replica={rl.batch_per_replica} must be a positive multiple of "
                f"--rl.group-size={rl.group_size} (e.g. {4 * rl.group_size})")
        if rl.grad_accum != 1:
            raise ConfigError(
                f"--rl.grad-accum={rl.grad_accum} is retired for GRPO: the accumulation count is derived. "
                f"Set --rl.micro-batch-per-replica (e.g. {rl.batch_per_replica // 2}) to accumulate gradients "
                "over smaller forward/backward chunks.")
        _positive("--rl.mu-iterations", rl.mu_iterations)
        if rl.max_tokens_per_micro_batch and rl.micro_batch_per_replica:
            raise ConfigError("set one of --rl.micro-batch-per-replica (fixed rows) and "
                              "--rl.max-tokens-per-micro-batch (token budget), not both")
        if self.rl.batch_per_replica % self.mini_batch:
            raise ConfigError(
                f"--rl.mini-batch-per-replica={rl.mini_batch_per_replica} must divide "
                f"--rl.batch-per-replica={rl.batch_per_replica} exactly (a ragged last mini-batch changes its token mean)")
        if self.mini_batch % self.micro_batch:
            raise ConfigError(
                f"--rl.micro-batch-per-replica={rl.micro_batch_per_replica} must divide the mini-batch "
                f"({self.mini_batch}) exactly (a ragged last micro-batch changes its token mean)")
        if self.grid.gpu_placement == "disaggregated":
            raise ConfigError("GRPO runs colocated: use --grid.gpu-placement colocated "
                              "(disaggregated placement is for PPO streaming, minirl.ppo)")
        # DP shares: every level must split evenly over the data-parallel ranks, in whole groups.
        dp = world_size
        if rl.batch_per_replica % (dp * rl.group_size):
            raise ConfigError(
                f"--rl.batch-per-replica={rl.batch_per_replica} must split into whole groups of "
                f"{rl.group_size} over {dp} data-parallel rank(s); use a multiple of {dp * rl.group_size}")
        if self.micro_batch % dp:
            raise ConfigError(
                f"the micro-batch ({self.micro_batch}) must split evenly over {dp} data-parallel rank(s); "
                "change --rl.micro-batch-per-replica")
        _check_optimization("rl", rl)
        _check_run(self)
        return self


@dataclass
class GRPOArgs(Launch, GRPOFlags):  # a dataclass lists its bases' fields last base first: the run's own on top
    """GRPO: sample G completions per prompt with vLLM, score, group advantages, mini/micro-batched update, publish.

    One process, CPU, the built-in task: python -m minirl.grpo --steps 20

    Two ranks, FSDP2 over gloo or NCCL: torchrun --nproc-per-node 2 -m minirl.grpo --steps 20
    """
