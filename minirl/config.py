"""Typed run configuration: the parts both entrypoints share, and every check on them.

Each field's docstring is its `--help` text (tyro reads them). `validate()` (on `GRPOArgs` in
config_grpo.py and `PPOArgs` in config_ppo.py) runs before any model, engine or process group is
built, so a bad flag fails in a second with a message that names it; the checks both share
(`_check_run`: every number's range, sampling, task, checkpoint, log and run-directory flags) are here.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

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
    warm_start_steps: int = 120
    """Supervised steps on the built-in task before saving, on labels off by up to 2 (tasks.warm_start): the
    model learns the answer format and a rough count, and RL has to make the count exact."""


@dataclass
class ModelConfig:
    path: str = TINY
    """A local Hugging Face folder, a hub name (org/name), or `tiny` for the built-in model."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype in the trainer and the engine (float32 keeps CPU runs exact)."""
    packing: bool = True
    """Padding-free training: each micro-batch's rows packed end to end (positions restarting per row),
    so no compute goes to pads. Checked at load to give the padded numbers; off for a model that fails it."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward (policy and critic): a block keeps only its
    input for backward, so activations shrink by about the number of layers, for a second forward of
    each block. On in the GPU recipes; off by default (the CPU demo's blocks are tiny)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class RolloutConfig:
    max_tokens: int = 8
    """Most completion tokens sampled per sequence; a completion cut here gains no reward. The default suits the
    built-in task's one-digit answers (TRL 1.x and verl default to 512)."""
    max_prompt_tokens: int = 32
    """Longest prompt in tokens (a BOS its tokenizer puts first included); the engine's context is this plus
    --rollout.max-tokens."""
    min_tokens: int = 0
    """Fewest completion tokens (EOS is suppressed before that); benchmarks set it to --rollout.max-tokens."""
    temperature: float = 1.0
    """Sampling temperature, in [1e-05, 2]: vLLM samples greedily below 1e-05."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens holding this much probability (1 = all)."""
    top_k: int = 0
    """Sample from the k likeliest tokens only (0 or -1 = all)."""
    kv_cache_gib: float = 1.0
    """CPU only: the engine's KV cache in GiB (sets VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.3
    """CUDA only: the share of the card the engine may take, weights and KV cache."""
    enforce_eager: Optional[bool] = None
    """Run the engine without compilation/CUDA graphs; default: eager on CPU (starts in seconds), compiled on CUDA."""
    sleep_level: Literal[1, 2] = 1
    """1: engine weights are backed up to host while the trainer runs; 2: discarded and rewritten by weight sync."""

    @property
    def max_model_len(self) -> int:
        """The engine's context: the prompt budget plus the completion cap."""
        return self.max_prompt_tokens + self.max_tokens


def first_line(e: BaseException) -> str:
    """An error's message for a one-line report: its first line ("" when it has none)."""
    return (str(e).strip().splitlines() or [""])[0]


def hub_name(text: str) -> bool:
    """Whether `text` reads as a Hugging Face hub repository's name, `owner/name`."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None


def data_files(path: str) -> list[str]:
    """The files --task.path or --task.eval-path names: the file itself, or every file a pattern matches, in
    name order."""
    return [path] if os.path.isfile(path) else sorted(p for p in glob.glob(path) if os.path.isfile(p))


@dataclass
class TaskConfig:
    name: Literal["count", "jsonl"] = "count"
    """`count`: the built-in task; `jsonl`: prompts and answers from --task.path."""
    path: str = ""
    """A JSONL file (or .jsonl.gz) of one {"prompt": ..., "answer": ...} per line, or a JSON array, .parquet or
    .arrow file of such rows (for --task.name jsonl; .arrow: the datasets library's save_to_disk); a quoted pattern
    reads every file it matches, in name order (a hub dataset's shards: 'gsm8k/main/train-*.parquet'). A prompt is
    text or chat messages [{"role": ..., "content": ...}] (rendered by the model's chat template); the answer is a
    string or a number (a list or an object reaches a --task.reward function as it is: Search-R1's targets)."""
    prompt_key: str = "prompt"
    """The column holding the prompt, text or chat messages (verl's data.prompt_key; raw GSM8K's is question)."""
    answer_key: str = ""
    """The column holding the reference answer, dotted for a nested one (verl: reward_model.ground_truth);
    empty = the first of answer, solution and reward_model.ground_truth."""
    filter_overlong_prompts: bool = False
    """Leave out the prompts over --rollout.max-prompt-tokens as the task loads, saying how many (verl's
    data.filter_overlong_prompts); without it such a prompt is an error naming it (TRL cuts it)."""
    eval_prompts: int = 128
    """Held-out prompts scored greedily for `eval_accuracy`."""
    eval_path: str = ""
    """A file of held-out prompts, as --task.path (e.g. GSM8K test); empty = hold out part of --task.path."""
    chat_template_kwargs: str = ""
    """Variables for the chat template of chat prompts, as a JSON object, e.g. '{"enable_thinking": false}'
    (Qwen3 without thinking); TRL's chat_template_kwargs, verl's apply_chat_template_kwargs."""
    answer_format: Literal["strict", "flexible"] = "strict"
    """The JSONL task's built-in reward: `strict` reads the number after the last `#### ` (GSM8K's format,
    verl's strict mode); `flexible` the last number anywhere (verl's flexible). A reference that is not a
    number is compared as text, normalised."""
    reward: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """A reward function `module:function`, f(completion: str, answer: str) -> float or TRL's or verl's form
    (told apart by its parameters), imported by name; repeat the flag for several. Empty = the task's own
    (minirl.rewards:count, :gsm8k or :gsm8k_flexible). A completion cut by --rollout.max-tokens gains nothing
    from any function (a penalty is kept); the first one's held-out mean is eval_accuracy."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per --task.reward function (the reward is their weighted sum); empty = 1 each."""
    reward_timeout: float = 0.0
    """Seconds one call of a reward function may take before the run stops, naming it (a judge or sandbox call
    that never returns); 0 = no limit. Either way, a call that has not returned for a minute is reported."""

    def check(self) -> None:
        """The task's files exist; one given to the built-in task (which reads none) is a forgotten --task.name."""
        given = [flag for flag, v in (("--task.path", self.path), ("--task.eval-path", self.eval_path),
                                      ("--task.prompt-key", self.prompt_key != "prompt"),
                                      ("--task.answer-key", self.answer_key),
                                      ("--task.chat-template-kwargs", self.chat_template_kwargs)) if v]
        if self.name == "count" and given:
            raise ConfigError(f"{given[0]} is for your own prompts, and --task.name is count, the built-in task, "
                              "which reads no file: add --task.name jsonl")
        for flag, path, needed, split in (("--task.path", self.path, self.name == "jsonl", "train"),
                                          ("--task.eval-path", self.eval_path, False, "test")):
            if (needed or path) and not data_files(path):
                # a downloaded dataset's folder: name one of its data files, of the flag's split first
                inside = sorted((p for p in glob.glob(os.path.join(path, "**"), recursive=True)
                                 if p.endswith((".parquet", ".jsonl", ".jsonl.gz", ".arrow"))),
                                key=lambda p: (split not in p, p))
                what = "not a file, nor a pattern that matches one"
                if inside:  # the hub's train-00000-of-00002.parquet, save_to_disk's train/data-00000-of-00001.arrow
                    shards = os.path.join(os.path.dirname(inside[0]), re.sub(r"-\d+-of-\d+", "-*",
                                                                             os.path.basename(inside[0])))
                    what = f"a folder: name a file in it ({inside[0]!r}) or its shards by a quoted pattern ({shards!r})"
                elif hub_name(path) and not os.path.exists(path):  # TRL's --dataset_name
                    what = (f"no local file; as a hub dataset's name, download it first (hf download --repo-type "
                            f"dataset {path} --local-dir data/{path.split('/')[1]}) and name its files")
                raise ConfigError(f"{flag}={path!r} is {what}; give a JSONL, Parquet or Arrow file"
                                  + (" or use --task.name count" if needed else " or leave it empty"))
        self.template_kwargs()

    def template_kwargs(self) -> dict:
        """--task.chat-template-kwargs as the keywords of the tokenizer's apply_chat_template."""
        try:
            got = json.loads(self.chat_template_kwargs or "{}")
        except json.JSONDecodeError:
            got = None
        if not isinstance(got, dict):
            raise ConfigError(f"--task.chat-template-kwargs={self.chat_template_kwargs!r} is not a JSON object; "
                              "give one such as '{\"enable_thinking\": false}'")
        return got


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
    samples: int = 2
    """Held-out completions printed at each eval; every one goes to <run dir>/samples.jsonl."""
    train_samples: int = 0
    """Training rollouts of each step written to samples.jsonl (and to W&B as a table): prompt, completion,
    reward, each reward function's value, clipped (this rank's first; 0 = none)."""
    target_eval_accuracy: float = 0.0
    """Stop early once a trained policy's eval_accuracy reaches this (0 = run all --steps)."""
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

    def evaluates(self, version: int, steps: int) -> bool:
        """Whether the policy after `version` updates is scored on the held-out prompts: before the
        first update, every --log.eval-every, and after the last of `steps`. The one rule: every loop,
        placement and rollout rank asks it."""
        return bool(self.eval_every) and (version % self.eval_every == 0 or version == steps)


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

    def saves(self, steps_done: int, stepped: bool) -> bool:
        """Whether a scheduled save follows the step that brings the run to `steps_done`: every
        --checkpoint.every, and never after a step that took no update (a non-finite one)."""
        return bool(self.every) and steps_done % self.every == 0 and stepped


@dataclass
class OptimConfig:
    """What --rl.* (GRPO) and --ppo.* (the policy's, and the critic's where it says so) share: the
    learning rate and its schedule, the clipped objective, the gradient clip, the stall rule, the hand-off."""

    lr: float = 1e-4
    """AdamW learning rate of the policy (the peak, after the warmup). The default suits the built-in tiny
    model; a pretrained one wants about 1e-6 (TRL's and verl's default)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to the peak learning rate."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to min-lr-ratio x the peak at the run's last optimizer step."""
    min_lr_ratio: float = 0.0
    """The cosine schedule's final learning rate, as a fraction of the peak."""
    clip_eps: float = 0.2
    """PPO ratio clip epsilon (the ratio's lower bound is 1 - this; PPO's value clip too)."""
    clip_eps_high: float = 0.0
    """Upper clip epsilon, DAPO's "clip-higher" (e.g. 0.28); 0 = the same as clip-eps."""
    dual_clip: float = 0.0
    """Dual clip c > 1 (verl's clip_ratio_c, e.g. 3): a negative-advantage token's loss is at most -c x A; 0 = off."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the starting policy (a frozen reference model); 0 = none."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The penalty's per-token KL estimate: k1 = l - r, k2 = (l - r)^2 / 2, k3 = exp(r - l) - (r - l) - 1."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus in the policy loss (0 = none; the entropy is logged either way)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = \
        "token-mean"
    """How token losses become the step's loss: token-mean (every token alike); seq-mean-token-mean
    (each completion's mean, then the mean over completions: the GRPO paper); seq-mean-token-sum (each
    completion's sum); seq-mean-token-sum-norm (the sum over --rollout.max-tokens: Dr. GRPO)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this after normalization (0 = no clip)."""
    max_skipped_steps: int = 3
    """Stop the run after this many consecutive steps whose updates were all skipped as non-finite."""
    use_rollout_logprobs_for_loss: bool = False
    """Use the engine's sampling logprobs as pi_old instead of the trainer's own (on GPUs they differ:
    bf16 kernels; the step's `logprob_gap` in metrics.jsonl shows by how much)."""
    colocated_offload: bool = True
    """Colocated: hand the card between engine and trainer each step (the engine sleeps while the
    trainer runs, the trainer is offloaded while the engine generates)."""

    def loss_options(self, max_tokens: int) -> dict:
        """The policy loss's settings, as objective.policy_loss takes them (`max_tokens`: Dr. GRPO's constant)."""
        return dict(clip_eps=self.clip_eps, kl_coef=self.kl_coef, clip_eps_high=self.clip_eps_high,
                    dual_clip=self.dual_clip, kl_estimator=self.kl_estimator, entropy_coef=self.entropy_coef,
                    agg=self.loss_agg_mode, norm_len=max_tokens)


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
    rehearse: bool = False
    """--dry-run: also run the real train step of train rank 0 on fake CUDA tensors at the model's shape
    (no GPU, no weights; a C++ compiler builds its stand-ins once) and print its measured peak memory per
    card beside the plan's, and any CPU tensor that meets a CUDA one."""

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.log.run_dir, "checkpoints")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_numbers(obj, prefix: str = "--") -> None:
    """Every number flag at once: a float must be finite (NaN and inf are refused, never trained
    with), an integer (a count, a size, a step, the seed) must be >= 0."""
    for f in dataclasses.fields(obj):
        value, flag = getattr(obj, f.name), prefix + f.name.replace("_", "-")
        if dataclasses.is_dataclass(value):
            _check_numbers(value, flag + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag}={value} must be a finite number")
        elif isinstance(value, int) and not isinstance(value, bool) and value < 0 and flag != "--rollout.top-k":
            raise ConfigError(f"{flag}={value} must be >= 0")


def _check_run(args) -> None:
    """The checks GRPO and PPO share, after `_check_numbers`: the sizes, sampling, task file, checkpoint
    and log flags, the run directory (a file, not writable, or holding a run that is neither resumed
    nor overwritten), the dry run's world."""
    t, r = args.model.tiny, args.rollout
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
        _positive(f"--model.tiny.{name.replace('_', '-')}", getattr(t, name))
    _positive("--rollout.max-prompt-tokens", r.max_prompt_tokens)
    _positive("--rollout.kv-cache-gib", r.kv_cache_gib)
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"--rollout.gpu-memory-utilization={r.gpu_memory_utilization} must be in (0, 1]")
    if not args.log.run_dir.strip():
        raise ConfigError("--log.run-dir is empty; give a directory")
    target = args.log.target_eval_accuracy
    if not 0 <= target <= 1:
        raise ConfigError(f"--log.target-eval-accuracy={target} must be in [0, 1] (0: run every step)")
    if target and not args.log.eval_every:
        raise ConfigError(f"--log.target-eval-accuracy={target} stops at an evaluation, and --log.eval-every 0 "
                          "runs none: give --log.eval-every N")
    if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise ConfigError(f"--checkpoint.dir={args.checkpoint_dir!r} is a file; give a directory")
    _positive("--dry-run-card-gib", args.dry_run_card_gib)
    if args.log.overwrite and args.checkpoint.resume:
        raise ConfigError(f"--log.overwrite starts over and --checkpoint.resume={args.checkpoint.resume!r} continues: "
                          "give one of them")
    if args.rehearse and not args.dry_run:
        raise ConfigError("--rehearse is part of a dry run: add --dry-run")
    if args.rehearse and args.dry_run_device == "cpu":
        raise ConfigError("--rehearse plays a CUDA launch: drop --dry-run-device cpu")
    _at_least("--dry-run-nnodes", args.dry_run_nnodes, 1)
    _at_least("--log.every", args.log.every, 1)
    for flag, on, module, extra in (("--log.tensorboard", args.log.tensorboard, "tensorboard", "tensorboard"),
                                    ("--log.wandb-project", args.log.wandb_project, "wandb", "wandb")):
        if on and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs {module}: pip install -e '.[{extra}]'")
    _check_run_dir(args)
    if not 1e-5 <= r.temperature <= 2:  # vLLM refuses more, when the first step samples
        raise ConfigError(f"--rollout.temperature={r.temperature} must be in [1e-05, 2]: below 1e-05 vLLM samples "
                          "greedily (vllm/sampling_params.py, _SAMPLING_EPS), and a group of one prompt's same "
                          "completion has nothing to learn from")
    if r.top_k < -1:
        raise ConfigError(f"--rollout.top-k={r.top_k} must be >= 1, or 0 (or -1) for every token")
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"--rollout.top-p={r.top_p} must be in (0, 1]")
    if not 0 <= r.min_tokens <= r.max_tokens:
        raise ConfigError(f"--rollout.min-tokens={r.min_tokens} must be in [0, --rollout.max-tokens={r.max_tokens}]")
    args.task.check()
    _at_least("--checkpoint.keep", args.checkpoint.keep, 1)
    _at_least("--task.reward-timeout", args.task.reward_timeout, 0)
    if args.seed >= 2**32:
        raise ConfigError(f"--seed={args.seed} must be below 2**32 (numpy's seeds are 32-bit)")
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
    """What --rl.* and --ppo.* share: learning rate and schedule, weight decay, clips, KL, gradient clip, the stall
    limit."""
    _positive(f"--{group}.lr", c.lr)
    _positive(f"--{group}.clip-eps", c.clip_eps)
    _at_least(f"--{group}.kl-coef", c.kl_coef, 0)
    _at_least(f"--{group}.entropy-coef", c.entropy_coef, 0)
    _at_least(f"--{group}.weight-decay", c.weight_decay, 0)
    _at_least(f"--{group}.max-grad-norm", c.max_grad_norm, 0)
    _at_least(f"--{group}.max-skipped-steps", c.max_skipped_steps, 1)
    _at_least(f"--{group}.clip-eps-high", c.clip_eps_high, 0)
    if c.dual_clip and not c.dual_clip > 1:
        raise ConfigError(f"--{group}.dual-clip={c.dual_clip} must be > 1 (e.g. 3), or 0 for off")
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
    if not args.dry_run and not args.checkpoint.resume and not args.log.overwrite and holds_run(d):
        raise ConfigError(f"--log.run-dir={d!r} already holds a run ({os.path.join(d, 'metrics.jsonl')}); continue it "
                          "with --checkpoint.resume auto, start over with --log.overwrite, or pick another --log.run-dir")


def holds_run(run_dir: str) -> bool:
    """Whether a run directory holds a run: a metrics.jsonl with a record in it."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    return os.path.isfile(metrics) and os.path.getsize(metrics) > 0
