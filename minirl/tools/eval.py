"""`python -m minirl.tools.eval` (or `minirl-eval`): score a model on a task's held-out prompts, without
training, with the same greedy scorer and rewards the training loops use (tasks.held_out).

    minirl-eval --model.path runs/demo/final                          # an exported policy (or any HF folder)
    minirl-eval --checkpoint runs/demo/checkpoints/step_00000400      # a training checkpoint
    minirl-eval --model.path Qwen/Qwen2.5-0.5B-Instruct --task.name jsonl --task.path data/gsm8k/train.jsonl \\
        --task.eval-path data/gsm8k/test.jsonl --task.eval-prompts 512 --model.dtype bfloat16

A checkpoint's run config.json (in its run directory), or an export's `minirl_config.json`, gives the
model, task and rollout flags, as `--config` would; flags given beside it win. Prints a few prompts
with their completions (`--samples`), then `eval_accuracy <value> on <n> prompts`, and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field

from minirl.config import ModelConfig, RolloutConfig, TaskConfig


@dataclass
class EvalArgs:
    """Score a model on the task's held-out prompts, greedily."""

    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: str = ""
    """A training checkpoint folder (<run dir>/checkpoints/step_N) to score instead of --model.path's
    weights; its run's config.json gives the defaults."""
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int = 0
    """The task's seed (which prompts are held out for a JSONL task without --task.eval-path)."""
    steps: int = 0
    """The run's --steps, for a TRL reward function's trainer_state (scored as at the run's end)."""
    config: str = ""
    """A YAML or JSON file of flags read first, e.g. a run's config.json (keys this command does not
    have are ignored); flags given beside it win."""
    samples: int = 4
    """Held-out prompts printed with their completions, answers and rewards before the result line."""
    engine_logs: bool = False
    """Show the engine's own log lines (vLLM and its native libraries); by default they go to a file
    that is removed with the run's temporary folder, and the console shows the one result line."""


def main(argv: list[str] | None = None) -> float:
    from minirl import dist, launch, models
    from minirl.logger import sample_line
    from minirl.rollout import Engine, check_model
    from minirl.tasks import held_out, make_task
    argv = list(sys.argv[1:] if argv is None else argv)
    args = launch.parse(EvalArgs, _with_run_config(argv), __doc__, lenient=True)
    args.task.check()
    if args.checkpoint:
        from minirl.tools.export import check_checkpoint
        check_checkpoint(args.checkpoint, "--checkpoint")
    world = dist.init()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so the temporary export is removed
    base = launch.resolve_path(args.model)  # checked before any export, which copies its config and tokenizer
    check_model(base, args.rollout, args.rollout.max_model_len)
    tok = models.load_tokenizer(base)
    task = make_task(args.task, args.seed, tok, args.rollout.max_prompt_tokens, True, args.steps)
    with tempfile.TemporaryDirectory(prefix="minirl-eval-") as tmp:
        path = base
        if args.checkpoint:  # the engine loads a Hugging Face folder: export the checkpoint's policy
            from minirl.tools.export import export
            path = export(args.checkpoint, os.path.join(tmp, "policy"), base)
        engine = Engine(path, args.rollout, args.rollout.max_model_len, world.engine_device, dtype=args.model.dtype,
                        seed=args.seed, log_file=None if args.engine_logs else os.path.join(tmp, "engine.log"))
        try:
            scored = held_out(engine, task, tok, args.rollout.max_prompt_tokens, version=args.steps)
        finally:
            engine.close()
    for row in scored["eval_samples"][:args.samples]:
        print(sample_line(row))
    accuracy, first = scored["eval_accuracy"], task.scorer.names[0]
    counted = sum(row["rewards"][first] is not None for row in scored["eval_samples"])  # a TRL None counts none
    print(f"eval_accuracy {accuracy:.4f} on {counted} prompts", flush=True)
    return accuracy


def _with_run_config(argv: list[str]) -> list[str]:
    """`--checkpoint <run dir>/checkpoints/step_N`, or `--model.path` of a run's export (its final/ or
    minirl-export's), without `--config`: read the run's config first (its task, not the built-in one)."""
    from minirl.run import RUN_CONFIG
    from minirl.tools.export import run_config_path
    if any(a == "--config" or a.startswith("--config=") for a in argv):
        return argv
    for i, a in enumerate(argv):
        flag, _, value = a.partition("=")
        value = os.path.expanduser(value or (argv[i + 1] if i + 1 < len(argv) else ""))  # as the flags read it
        if flag == "--checkpoint" and value:
            run_config = run_config_path(value)
        elif flag == "--model.path" and value:
            run_config = os.path.join(value, RUN_CONFIG)
        else:
            continue
        if os.path.isfile(run_config):
            return ["--config", run_config, *argv]
    return argv


def cli(argv: list[str] | None = None) -> None:
    from minirl import launch
    launch.run("minirl.eval", main, argv)


if __name__ == "__main__":
    cli()
