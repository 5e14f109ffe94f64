"""Typed run configuration shared by the entrypoints, and every check on it.

Each field's docstring is its `--help` text (tyro reads them). Derived sizes (`n_mini`,
`n_micro`, per-rank shares) are properties computed here and never settable
(rules B1-B2 in docs/invariants.md). `validate()` runs before any model, engine or
process group is built, so a bad flag fails in a second with a message that names it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

import tyro

TINY = "tiny"  # the --model.path value that selects the built-in tiny model


class ConfigError(ValueError):
    """A flag has a value minirl cannot run with; the message names the flag and a fix."""


@dataclass
class TinyModelConfig:
    """Shape of the built-in tiny Qwen2 model (used when --model.path is `tiny`)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 2
    """Attention heads; head_dim = hidden_size / num_heads must be one the CPU attention runs."""
    num_kv_heads: int = 1
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP width."""
    max_positions: int = 256
    """Longest sequence (prompt + completion) the model takes (max_position_embeddings)."""
    warm_start_steps: int = 8
    """Supervised steps on the built-in task before saving (deliberately few: RL has to do the rest)."""


@dataclass
class ModelConfig:
    path: str = TINY
    """A local Hugging Face folder, a hub name (org/name), or `tiny` for the built-in model."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype in the trainer and the engine (float32 keeps CPU runs exact)."""
    packing: bool = True
    """Padding-free training: each micro-batch's rows packed end to end (positions restarting per row),
    so no compute goes to pads. Checked at load to give the padded numbers; off for a model that fails it."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class RolloutConfig:
    max_tokens: int = 8
    """Most completion tokens sampled per sequence."""
    max_prompt_tokens: int = 32
    """Longest prompt in tokens; the engine's context is this plus --rollout.max-tokens."""
    min_tokens: int = 0
    """Fewest completion tokens (EOS is suppressed before that); benchmarks set it to --rollout.max-tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    kv_cache_gib: float = 1.0
    """CPU only: the engine's KV cache in GiB (sets VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.3
    """CUDA only: the share of the card the engine may take, weights and KV cache."""
    enforce_eager: Optional[bool] = None
    """Run the engine without compilation/CUDA graphs; default: eager on CPU (starts in seconds), compiled on CUDA."""
    sleep_level: Literal[1, 2] = 1
    """1: engine weights are backed up to host while the trainer runs; 2: discarded and rewritten by weight sync."""


@dataclass
class TaskConfig:
    name: Literal["count", "jsonl"] = "count"
    """`count`: the built-in task; `jsonl`: prompts and answers from --task.path."""
    path: str = ""
    """JSONL file with one {"prompt": ..., "answer": ...} per line (for --task.name jsonl)."""
    eval_prompts: int = 128
    """Held-out prompts scored greedily for `eval_accuracy`."""
    eval_path: str = ""
    """JSONL file of held-out prompts (e.g. GSM8K test); empty = hold out part of --task.path."""


@dataclass
class RLConfig:
    group_size: int = 8
    """Samples per prompt (G); advantages are taken within each group."""
    batch_per_replica: int = 32
    """Trajectories per collected batch per policy replica; a positive multiple of group_size."""
    mini_batch_per_replica: int = 0
    """Trajectories per optimizer step; 0 = the whole batch (one step)."""
    micro_batch_per_replica: int = 0
    """Trajectories per forward/backward; 0 = the whole mini-batch (no accumulation)."""
    max_tokens_per_micro_batch: int = 0
    """Token-budgeted micro-batching: split each mini-batch into micro-batches of at most this many
    computed tokens (packed lanes with --model.packing, else rows x longest row), balanced by cost
    (0 = off; replaces --rl.micro-batch-per-replica)."""
    mu_iterations: int = 1
    """Inner PPO epochs over one collected batch, all scored against the frozen pi_old."""
    grad_accum: tyro.conf.Suppress[int] = 1
    """Retired for GRPO (B11): the accumulation count is derived; not a flag (launch.parse refuses it by
    name, pointing at --rl.micro-batch-per-replica), and a config file that sets it is refused too."""
    lr: float = 1e-4
    """AdamW learning rate (the peak, after --rl.lr-warmup-steps)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to --rl.lr."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to --rl.min-lr-ratio x lr at the run's last optimizer step."""
    min_lr_ratio: float = 0.0
    """The cosine schedule's final learning rate, as a fraction of --rl.lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this after normalization (0 = no clip)."""
    clip_eps: float = 0.2
    """PPO ratio clip epsilon (the ratio's lower bound is 1 - this)."""
    clip_eps_high: float = 0.0
    """Upper clip epsilon, DAPO's "clip-higher" (e.g. 0.28); 0 = the same as --rl.clip-eps."""
    dual_clip: float = 0.0
    """Dual clip c > 1 (verl's clip_ratio_c, e.g. 3): a negative-advantage token's loss is at most -c x A; 0 = off."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference penalty (0 = no reference model)."""
    max_skipped_steps: int = 3
    """Stop the run after this many consecutive steps whose updates were all skipped as non-finite."""
    scale_by_std: bool = True
    """Divide group advantages by the group's reward std."""
    use_rollout_logprobs_for_loss: bool = False
    """Use the engine's sampling logprobs as pi_old instead of recomputing them in the trainer."""
    deterministic: bool = False
    """Turn on torch's deterministic algorithms (CUDA: CUBLAS_WORKSPACE_CONFIG must be set at launch)."""
    colocated_offload: bool = True
    """Colocated: hand the card between engine and trainer each step (sleep / offload)."""


@dataclass
class GridConfig:
    gpu_placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: every rank generates and trains; disaggregated: ranks [0, R) generate, [R, N) train."""
    rollout_ranks: int = 0
    """R, the number of generate-only ranks under disaggregated placement."""


@dataclass
class LogConfig:
    run_dir: str = "runs/latest"
    """Run directory: metrics.jsonl, config.json and the final model go here."""
    every: int = 1
    """Print a console line every this many steps."""
    eval_every: int = 5
    """Score held-out prompts greedily before the first update, after every this many steps and after
    the last (0 = never)."""
    target_eval_accuracy: float = 0.0
    """Stop early once eval_accuracy reaches this (0 = run all --steps)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars to <run dir>/tensorboard (pip install -e '.[tensorboard]')."""
    wandb_project: str = ""
    """Also log the metrics to this Weights & Biases project (pip install -e '.[wandb]'); empty = off."""
    overwrite: bool = False
    """Start a fresh run in a run directory that already holds one: the old run's metrics, config.json,
    final/, logs and its checkpoints in --checkpoint.dir are removed first."""
    engine_logs: bool = False
    """Show the engine's own log lines (vLLM and its native libraries) in the console; by default they
    go to <run dir>/engine.log (engine_rank<R>.log per rank when there are several)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every this many loop steps (0 = only the emergency save on SIGTERM)."""
    keep: int = 2
    """Complete checkpoints to keep; older ones are deleted after a newer one is complete."""
    resume: str = ""
    """Empty = a fresh run; `auto` = the newest complete checkpoint in --checkpoint.dir (fresh if none); or a checkpoint folder."""
    dir: str = ""
    """Where checkpoints go (default: <run dir>/checkpoints)."""


@dataclass
class Launch:
    """What both entrypoints share about the launch itself: the dry run and the run's folders."""

    config: str = ""
    """A YAML or JSON file of flags (nested as in config.json) read first; flags given beside it win.
    A run's own config.json reruns that run."""
    dry_run: bool = False
    """Validate the flags, print every rank's role, devices, share and memory estimate, and exit 0:
    nothing is loaded, built or launched. Shows whether a recipe fits before paying for a node."""
    dry_run_world_size: int = 0
    """--dry-run: the launch's number of ranks (0 = $WORLD_SIZE, else 1)."""
    dry_run_nnodes: int = 1
    """--dry-run: the launch's number of nodes (torchrun --nnodes); ranks are numbered node by node, and a
    rank's card is its index on its node."""
    dry_run_device: Optional[Literal["cpu", "cuda"]] = None
    """--dry-run: the launch's device type (default: this machine's)."""
    dry_run_card_gib: float = 80.0
    """--dry-run: memory of one card in GiB, for the fits / does not fit verdict."""

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.log.run_dir, "checkpoints")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class GRPOArgs(Launch):
    """GRPO on a prompt set: sample G completions per prompt, score, update, publish."""

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

    def validate(self, world_size: int = 1) -> "GRPOArgs":
        """Raise ConfigError naming the flag for anything the run cannot do. Cheap: no I/O but stat()."""
        rl = self.rl
        _positive("--steps", self.steps)
        _positive("--rl.group-size", rl.group_size)
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
        for flag, val in (("--rl.mini-batch-per-replica", rl.mini_batch_per_replica),
                          ("--rl.micro-batch-per-replica", rl.micro_batch_per_replica)):
            if val < 0:
                raise ConfigError(f"{flag}={val} must be >= 0 (0 = the whole level above)")
        _positive("--rl.mu-iterations", rl.mu_iterations)
        if rl.max_tokens_per_micro_batch < 0:
            raise ConfigError(f"--rl.max-tokens-per-micro-batch={rl.max_tokens_per_micro_batch} must be >= 0")
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
        _at_least("--rl.weight-decay", rl.weight_decay, 0)
        _check_run(self)
        return self


def _check_numbers(obj, prefix: str = "--") -> None:
    """Every number flag at once: a float must be finite (NaN and inf are refused, never trained
    with), an integer (a count, a size, a step, the seed) must be >= 0."""
    for f in dataclasses.fields(obj):
        value, flag = getattr(obj, f.name), prefix + f.name.replace("_", "-")
        if dataclasses.is_dataclass(value):
            _check_numbers(value, flag + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag}={value} must be a finite number")
        elif isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"{flag}={value} must be >= 0")


def _check_run(args) -> None:
    """The checks GRPO and PPO share: every number's range, sampling, task file, checkpoint and log
    flags, the run directory (a file, not writable, or holding a run that is neither resumed nor
    overwritten), the dry run's world."""
    _check_numbers(args)
    t, r = args.model.tiny, args.rollout
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
        _positive(f"--model.tiny.{name.replace('_', '-')}", getattr(t, name))
    _positive("--rollout.max-prompt-tokens", r.max_prompt_tokens)
    _positive("--rollout.kv-cache-gib", r.kv_cache_gib)
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"--rollout.gpu-memory-utilization={r.gpu_memory_utilization} must be in (0, 1]")
    if not args.log.run_dir.strip():
        raise ConfigError("--log.run-dir is empty; give a directory")
    if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise ConfigError(f"--checkpoint.dir={args.checkpoint_dir!r} is a file; give a directory")
    if args.dry_run_world_size < 0 or args.dry_run_card_gib <= 0:
        raise ConfigError("--dry-run-world-size must be >= 0 and --dry-run-card-gib > 0")
    if args.log.overwrite and args.checkpoint.resume:
        raise ConfigError(f"--log.overwrite starts over and --checkpoint.resume={args.checkpoint.resume!r} continues: "
                          "give one of them")
    if args.dry_run_nnodes < 1:
        raise ConfigError(f"--dry-run-nnodes={args.dry_run_nnodes} must be >= 1")
    _at_least("--log.every", args.log.every, 1)
    for flag, on, module, extra in (("--log.tensorboard", args.log.tensorboard, "tensorboard", "tensorboard"),
                                    ("--log.wandb-project", args.log.wandb_project, "wandb", "wandb")):
        if on and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs {module}: pip install -e '.[{extra}]'")
    _at_least("--log.eval-every", args.log.eval_every, 0)
    _check_run_dir(args)
    if not 0.0 < args.rollout.temperature:
        raise ConfigError(f"--rollout.temperature={args.rollout.temperature} must be > 0")
    if not 0 <= args.rollout.min_tokens <= args.rollout.max_tokens:
        raise ConfigError(f"--rollout.min-tokens={args.rollout.min_tokens} must be in [0, --rollout.max-tokens="
                          f"{args.rollout.max_tokens}]")
    if args.task.name == "jsonl" and not os.path.isfile(args.task.path):
        raise ConfigError(f"--task.path={args.task.path!r} is not a file; give a JSONL prompt file "
                          "or use --task.name count")
    if args.task.eval_path and not os.path.isfile(args.task.eval_path):
        raise ConfigError(f"--task.eval-path={args.task.eval_path!r} is not a file; "
                          "give a JSONL file or leave it empty")
    if args.checkpoint.every < 0 or args.checkpoint.keep < 1:
        raise ConfigError("--checkpoint.every must be >= 0 and --checkpoint.keep >= 1")
    if args.checkpoint.resume not in ("", "auto") and not os.path.isdir(args.checkpoint.resume):
        raise ConfigError(f"--checkpoint.resume={args.checkpoint.resume!r} is not a folder; "
                          "give a checkpoint folder, `auto`, or leave it empty")


def _positive(flag: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{flag}={value} must be > 0")


def _at_least(flag: str, value: float, low: float) -> None:
    if not value >= low:
        raise ConfigError(f"{flag}={value} must be >= {low}")


def _check_optimization(group: str, c) -> None:
    """What --rl.* and --ppo.* share: learning rate and schedule, clips, KL, gradient clip, the stall limit."""
    _positive(f"--{group}.lr", c.lr)
    _positive(f"--{group}.clip-eps", c.clip_eps)
    _at_least(f"--{group}.kl-coef", c.kl_coef, 0)
    _at_least(f"--{group}.max-grad-norm", c.max_grad_norm, 0)
    _at_least(f"--{group}.max-skipped-steps", c.max_skipped_steps, 1)
    _at_least(f"--{group}.clip-eps-high", c.clip_eps_high, 0)
    if c.dual_clip and not c.dual_clip > 1:
        raise ConfigError(f"--{group}.dual-clip={c.dual_clip} must be > 1 (e.g. 3), or 0 for off")
    _at_least(f"--{group}.lr-warmup-steps", c.lr_warmup_steps, 0)
    if not 0 <= c.min_lr_ratio <= 1:
        raise ConfigError(f"--{group}.min-lr-ratio={c.min_lr_ratio} must be in [0, 1]")


def _check_run_dir(args) -> None:
    d = args.log.run_dir
    if os.path.exists(d) and not os.path.isdir(d):
        raise ConfigError(f"--log.run-dir={d!r} is a file; give a directory")
    parent = d
    while not os.path.exists(parent):
        parent = os.path.dirname(os.path.abspath(parent))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--log.run-dir={d!r}: {parent!r} is not writable; give a directory you can write")
    metrics = os.path.join(d, "metrics.jsonl")
    if (not args.dry_run and not args.checkpoint.resume and not args.log.overwrite and os.path.isfile(metrics)
            and os.path.getsize(metrics) > 0):
        raise ConfigError(f"--log.run-dir={d!r} already holds a run ({metrics}); continue it with "
                          "--checkpoint.resume auto, start over with --log.overwrite, or pick another --log.run-dir")


# ---- PPO with a critic, streamed (docs/guide-streaming.md; rules S1-S23) ----

@dataclass
class AdvEstimatorConfig:
    normalize_advantages: bool = True
    """Whiten advantages; under streaming this happens within each chunk (a warning says so at start-up)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""


@dataclass
class PPOConfig:
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
    lr: float = 1e-4
    """Policy AdamW learning rate (the peak, after --ppo.lr-warmup-steps)."""
    value_lr: float = 1e-4
    """Critic AdamW learning rate (the peak; the same schedule as the policy's)."""
    lr_warmup_steps: int = 0
    """Steps of linear warmup from 0 to the learning rates."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to --ppo.min-lr-ratio x lr at the last step."""
    min_lr_ratio: float = 0.0
    """The cosine schedule's final learning rate, as a fraction of the peak."""
    clip_eps: float = 0.2
    """PPO ratio clip (lower: 1 - this) and value clip."""
    clip_eps_high: float = 0.0
    """Upper ratio clip epsilon, DAPO's "clip-higher"; 0 = the same as --ppo.clip-eps."""
    dual_clip: float = 0.0
    """Dual clip c > 1 (verl's clip_ratio_c): a negative-advantage token's loss is at most -c x A; 0 = off."""
    kl_coef: float = 0.0
    """Weight of a k3 KL penalty to the starting policy (a frozen reference model); 0 = none."""
    max_grad_norm: float = 1.0
    """Clip each model's gradient norm after normalization (0 = no clip)."""
    max_skipped_steps: int = 3
    """Stop the run after this many consecutive steps whose policy update was skipped as non-finite."""
    policy_micro_batch_rows: int = 0
    """Rows per policy forward/backward on each train rank, within a chunk (0 = the whole chunk); the
    step stays exact at any size (deferred normalization). Lower it if the policy runs out of memory."""
    critic_micro_batch_rows: int = 0
    """Rows per critic forward/backward on each train rank (0 = all of them at once); exact at any
    size, as for the policy. Lower it if critic training runs out of memory."""
    use_rollout_logprobs_for_loss: bool = False
    """Use the engine's sampling logprobs as pi_old instead of the trainer's own (on GPUs they differ:
    bf16 kernels; the step's `logprob_gap` in metrics.jsonl shows by how much)."""
    colocated_offload: bool = True
    """Colocated full batch: the engine sleeps while policy and value train (CUDA frees its memory)."""
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
class PPOArgs(Launch):
    """PPO with a critic; the train ranks start on completed groups while the rest still generate."""

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
        _positive("--steps", self.steps)
        _positive("--ppo.num-prompts-per-step", p.num_prompts_per_step)
        _positive("--ppo.num-generations-per-prompt", p.num_generations_per_prompt)
        _positive("--ppo.critic-ppo-epochs", p.critic_ppo_epochs)
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
                raise ConfigError(f"disaggregated PPO needs separate generation ranks: --grid.rollout-ranks in "
                                  f"[1, {world_size - 1}] (this launch has {world_size} rank(s); start it with "
                                  "torchrun --nproc-per-node 2 or more, or use --grid.gpu-placement colocated with "
                                  "full batch)")
            dp = world_size - self.grid.rollout_ranks
        if p.num_prompts_per_step % dp:
            raise ConfigError(f"--ppo.num-prompts-per-step={p.num_prompts_per_step} must split evenly over "
                              f"{dp} train rank(s)")
        if a.rollout_groups_per_call < 1 or a.sampler.max_lookahead_versions < 0:
            raise ConfigError("--async-rl.rollout-groups-per-call must be >= 1 and "
                              "--async-rl.sampler.max-lookahead-versions >= 0")
        for flag, rows in (("--ppo.policy-micro-batch-rows", p.policy_micro_batch_rows),
                           ("--ppo.critic-micro-batch-rows", p.critic_micro_batch_rows)):
            if rows < 0:
                raise ConfigError(f"{flag}={rows} must be >= 0 (0 = all rows at once)")
        _check_optimization("ppo", p)
        _positive("--ppo.value-lr", p.value_lr)
        _at_least("--ppo.critic-warmup-steps", p.critic_warmup_steps, 0)
        for flag, v in (("--ppo.adv-estimator.gamma", p.adv_estimator.gamma), ("--ppo.adv-estimator.lam",
                                                                               p.adv_estimator.lam)):
            if not 0 <= v <= 1:
                raise ConfigError(f"{flag}={v} must be in [0, 1]")
        _check_run(self)
        return self
