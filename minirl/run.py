"""The harness: everything that runs around a step of either loop, so a loop says what happens and this
module decides when. Both loops build one `Run` and call it in a line at each point: the run log
and config.json, SIGTERM and Ctrl-C (an emergency save at the next step boundary), the stall rule,
the error guard (B24), timed phases (B27), the checkpoint parts and their resume, the eval and save
schedule (`evaluates`, `saves`), each step's record, the early stop, and the final export.
Where a save happens within a step is the loop's business (GRPO's update window, B22-B23); whether
it happens is the harness's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time

import torch
from huggingface_hub import save_torch_state_dict

from minirl import checkpoint, dist, models, rollout
from minirl.accumulator import Stall
from minirl.config import TINY, OptimConfig, RolloutConfig
from minirl.logger import RunLog, memory_peak_gib


class Run:
    def __init__(self, ready, world: dist.World, mode: str, rows: int):
        args = ready.args
        self.args, self.world, self.path, self.resume, self.rows = args, world, ready.path, ready.resume, rows
        self.loop = type(args).LOOP
        self.start = checkpoint.steps_done(ready.resume) if ready.resume else 0
        self.log = RunLog(args.log.run_dir, enabled=world.is_main, every=args.log.every, start_step=self.start,
                          tensorboard=args.log.tensorboard, wandb_project=args.log.wandb_project,
                          config=args.to_dict(), total_steps=args.steps, samples=args.log.samples, device=world.device)
        self.info, self.mark = self.log.info, self.log.mark
        ready.task.scorer.say = self.info  # its warnings go to the run's console and log
        group = "rl" if self.loop == "grpo" else "ppo"  # the optimizer's flags (config.OptimConfig)
        opt = getattr(args, group)
        self.stall = Stall(opt.max_skipped_steps,
                           f"a learning rate too high for this model (--{group}.lr={opt.lr}) or non-finite rewards")
        if args.model.path != TINY and opt.lr >= OptimConfig.lr:  # AdamW's first steps move every weight by ~lr
            self.info(f"warning: --{group}.lr={opt.lr:g} suits the built-in tiny model; it moves a pretrained model "
                      "far in a step (TRL and verl default to 1e-6)")
        if args.model.path != TINY and args.rollout.max_tokens == RolloutConfig.max_tokens:
            self.info(f"warning: --rollout.max-tokens={args.rollout.max_tokens} suits the built-in task's one-digit "
                      "answers; a completion cut there earns nothing (TRL 1.x and verl default to 512 tokens)")
        cut = [f for f, on in (("--rollout.top-p", args.rollout.top_p < 1), ("--rollout.top-k", args.rollout.top_k > 0),
                               ("--rollout.min-tokens", args.rollout.min_tokens > 0)) if on]
        if opt.use_rollout_logprobs_for_loss and cut:  # vLLM's processed logprobs: of the distribution it sampled
            self.info(f"warning: --{group}.use-rollout-logprobs-for-loss takes pi_old from the engine, whose logprobs "
                      f"are of the distribution {' and '.join(cut)} cut and renormalized; the trainer's are of the "
                      "whole one, so every ratio starts off 1 (the step's logprob_gap says by how much)")
        self.stop = dist.sigterm_flag()
        self.record = dict(self.log.last_eval)  # the newest record; a resumed run's newest eval until a step's
        self.logged_eval = self.log.last_eval.get("eval_version", -1)  # the newest eval version logged (rank 0)
        self.stopped = ""          # "" (ran on), "signal" or "target"
        self.saved = None          # the last step whose checkpoint this run wrote
        self.parts, self.state = {}, dict
        self.owner = {"run": ready.owner["run"], "line": ready.owner["line"],
                      "run_dir": os.path.abspath(args.log.run_dir)} if ready.owner else {}  # stamped on each save
        self.first_step, self._t0, self._in_step = self.start, time.perf_counter(), False
        self.done = self.start     # loop steps done
        if args.checkpoint.resume == "auto" and not ready.resume:
            self.info(f"--checkpoint.resume auto: no complete checkpoint in {args.checkpoint_dir}; starting fresh")
        self.info(f"minirl.{self.loop}: {mode}; model {ready.path}")
        trained = f"{len(ready.task.rows):,} to train on" if hasattr(ready.task, "rows") else "made by the built-in task"
        self.info(f"prompts: {trained}, {len(ready.task.eval_set):,} held out")  # verl's "dataset len"
        self.info("config: " + json.dumps(args.to_dict(), separators=(",", ":")))
        if world.is_main:
            with open(os.path.join(args.log.run_dir, "config.json"), "w") as f:
                json.dump(args.to_dict(), f, indent=2)

    @contextlib.contextmanager
    def guard(self, cleanup, close):
        """An exceptional exit runs `cleanup`, then `close`, never masking the error (B24); a clean one `close`."""
        try:
            yield
        except BaseException:
            dist.quietly(cleanup)
            dist.quietly(close)  # the error that brought us here is the one raised (B24)
            raise
        else:
            close()
        finally:
            self.log.close()

    def phase(self, name: str, announce: str = "", extra=None):
        """A timed phase, `time/<name>` in the step's record and a profile mark (B27; logger.RunLog.phase)."""
        if not announce and self.first_step is not None and self._in_step:  # the run's first phase is the slow
            announce, self.first_step = f"step {self.first_step}: {name}", None  # one (a warm-up): say so
        return self.log.phase(name, announce, extra)

    # ---- checkpoints ----
    def checkpoints(self, parts: dict, state=dict) -> None:
        """`parts`: {name: (model, optimizer)}; `state()`: the loop's own state to save beside them."""
        self.parts, self.state = parts, state

    def load(self) -> dict:
        """The resumed checkpoint into `parts` (a collective); returns the loop state it holds."""
        return checkpoint.load(self.resume, self.parts)

    def resumed(self, rates: list[tuple]) -> None:
        """After a load: each (optimizer, the schedule's next rate, its flag) is reported when the
        checkpoint's rate differs (the flags' schedule sets the rate, checkpoint.report_lr)."""
        for optimizer, lr, flag in rates:
            checkpoint.report_lr(optimizer, lr, flag, self.info)
        self.info(f"resumed from {self.resume} at step {self.start}")
        if self.start == self.args.steps:
            self.info(f"--steps={self.args.steps}: every step is done; finishing the run (its export)")

    def save(self, step: int) -> None:
        """The checkpoint after `step` (a collective), written but not complete: `end_step` completes it once
        the step's records are on disk."""
        checkpoint.save(self.args.checkpoint_dir, step + 1, self.parts, {"loop": self.loop, **self.owner, **self.state()},
                        self.args.checkpoint.keep, complete=False)
        self.saved = step

    # ---- the step ----
    def baseline(self, evaluate, announce: str = "") -> None:
        """The held-out score of the policy a fresh run starts from, when one is due (`evaluate(version)`).
        A resumed run's was logged before its checkpoint was complete, with the step that made it."""
        if not self.resume and self.args.log.evaluates(self.start, self.args.steps):
            with self.log.phase("eval", announce=announce):
                scored = evaluate(self.start)
            if scored:
                self.log.write({"step": self.start, **scored})

    def steps(self):
        """The loop's steps, from the resumed one, until the last or a stop (`end_step`)."""
        self.stop.armed = True  # a first signal now waits for the step's end, and its save
        for step in range(self.start, self.args.steps):
            self._t0, self._in_step = time.perf_counter(), True
            self.log.begin_step()
            if dist.fault_due("sigterm", step):  # tests: a scheduler's SIGTERM in the middle of this step
                os.kill(os.getpid(), signal.SIGTERM)
            yield step
            if self.stopped:
                return

    def evaluates(self, step: int) -> bool:
        """Whether the policy after `step` is scored (`LogConfig.evaluates`: the one rule)."""
        return self.args.log.evaluates(step + 1, self.args.steps)

    def saves(self, step: int, stepped: bool) -> bool:
        """Whether a scheduled save follows `step` (`CheckpointConfig.saves`)."""
        return self.args.checkpoint.saves(step + 1, stepped)

    def end_step(self, step: int, record: dict, stepped: bool, save) -> None:
        """Write the step's record, apply the stall rule, then save and stop as the harness's rules say.
        `save()`: the loop's way to save this step (through its hand-off where it has one)."""
        seconds = time.perf_counter() - self._t0
        rollout = record.get("rollout_memory_peak_gib") or 0.0  # separate rollout ranks' engines
        record = {"step": step, **record, "memory_peak_gib": max(memory_peak_gib(self.world.device), rollout),
                  "time/step": seconds, "tokens_per_s": record["completion_len_mean"] * self.rows / seconds}
        profile = self.log.take_profile()
        if profile:
            record[f"{self.loop}_step"] = profile
        self.log.write(record)
        self.record, self.done = record, step + 1
        self.stall.step(stepped, step)  # raises after the flag's number of steps without an update
        signalled = self.stop()  # every rank agrees (a collective)
        if (signalled or self.saves(step, stepped)) and self.saved != step:
            with self.log.phase("checkpoint", announce=f"saving the checkpoint of step {step + 1}"):
                save()
        if self.saved == step:  # the step's records first, then the checkpoint that claims them
            self.log.sync()
            checkpoint.commit(self.args.checkpoint_dir, step + 1, self.args.checkpoint.keep)
        if signalled:
            self.info(f"{self.stop.name}: saved {self.args.checkpoint_dir} at step {step + 1}; exiting")
            self.stopped = "signal"
            return
        target = self.args.log.target_eval_accuracy
        trained = record.get("eval_version") != 0  # streamed PPO's step 0 can carry the starting policy's score
        reached = float(bool(target) and trained and record.get("eval_accuracy", 0.0) >= target)
        if dist.all_reduce(torch.tensor([reached]), "max").item():  # every rank stops with the one that saw it
            self.info(f"eval_accuracy {record.get('eval_accuracy', target):.3f} reached "
                      f"--log.target-eval-accuracy={target}; stopping")
            self.stopped = "target"

    def write(self, step: int, record: dict) -> None:
        """A record outside the steps' own (a late eval), logged at `step`."""
        if record:
            self.log.write({"step": step, **record})
            self.record.update(record)

    def finish(self, policy, before=None) -> None:
        """The final policy to <run dir>/final (a collective), unless a signal stopped the run; `before()`
        puts it on the card first (the hand-off's trainer window)."""
        if self.stopped == "signal":
            return
        self.stop.answer = (b"Ctrl-C: the export of the final policy finishes first, then the run exits "
                            b"(Ctrl-C again to stop now: nothing half-written is kept)\n")  # no step remains
        if before is not None:
            before()
        args, accuracy = self.args, self.record.get("eval_accuracy")
        card = model_card(f"{os.path.basename(os.path.abspath(args.log.run_dir))} ({self.loop.upper()})", args.model.path,
                          {"algorithm": self.loop.upper(), "task": os.path.basename(args.task.path) or args.task.name,
                           "steps": self.done, "held-out accuracy (greedy, last evaluation)":
                           "not evaluated" if accuracy is None else f"{accuracy:.4f}", "dtype": args.model.dtype})
        final = os.path.join(self.args.log.run_dir, "final")
        with self.log.phase("export", announce=f"exporting the policy to {final}"):
            export_hf(policy, self.path, final, self.world.is_main, models.DTYPES[self.args.model.dtype],
                      {"README.md": card, RUN_CONFIG: json.dumps(args.to_dict(), indent=2)})
        dist.barrier()


# ---- the final policy in Hugging Face format (final/, and minirl-export's) ----

SHARD_BYTES = 5 * 2**30  # like save_pretrained's default max_shard_size
TOKENIZER_FILES = (".json", ".txt", ".model", ".jinja", ".tiktoken")  # configs, vocabularies, chat templates
RUN_CONFIG = "minirl_config.json"  # an export's run config: minirl-eval scores it on that run's task


def export_hf(model: torch.nn.Module, source_path: str, out_dir: str, is_main: bool,
              dtype: torch.dtype | None = None, files: dict[str, str] | None = None) -> None:
    """Gather the full parameters (a collective) and, on rank 0, write `out_dir/` whole (under a temporary
    name, then renamed): the source's config, tokenizer and template files, the weights in `dtype` as
    safetensors (sharded above SHARD_BYTES), and `files` ({name: text}: the model card, the run's
    config). A failure leaves nothing written."""
    checkpoint.require_finite({"policy": model})
    state = {}
    for name, t in rollout.as_checkpoint(model, dist.full_parameters(model, dtype)):  # the files' names and layout
        if is_main:
            state[name] = t.to("cpu", copy=True).contiguous()
    if not is_main:
        return
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_export(state, source_path, tmp, files or {})
    except BaseException as e:  # a full disk, a Ctrl-C: nothing half-written stays; an earlier export is whole
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise checkpoint.CheckpointError(f"exporting to {out_dir} failed: [Errno {e.errno}] {e.strerror}; "
                                             "nothing was written there") from e
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)


def _write_export(state: dict, source_path: str, tmp: str, files: dict[str, str]) -> None:
    os.makedirs(tmp)
    for f in os.listdir(source_path):  # a source that is itself an export: not its card or run config
        if f.endswith(TOKENIZER_FILES) and not f.endswith(".index.json") and f not in ("README.md", RUN_CONFIG):
            shutil.copyfile(os.path.join(source_path, f), os.path.join(tmp, f))  # contents, not the cache's modes
    # one model.safetensors, or shards of at most SHARD_BYTES with their index (as save_pretrained writes them)
    save_torch_state_dict(state, tmp, max_shard_size=SHARD_BYTES, metadata={"format": "pt"})
    for name, text in files.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    for f in os.listdir(tmp):
        os.chmod(os.path.join(tmp, f), 0o644)
    os.chmod(tmp, 0o755)
    checkpoint.fsync_tree(tmp)


def model_card(name: str, base: str, rows: dict) -> str:
    """An export's README.md: a Hugging Face model card (`huggingface_hub.ModelCard`) with a metadata header,
    the table `rows`, and the base model by its hub name or its folder's name (no absolute path)."""
    from huggingface_hub import ModelCard, ModelCardData

    hub = base.count("/") == 1 and not os.path.exists(base)
    data = ModelCardData(library_name="transformers", base_model=base if hub else None,
                         tags=["minirl", "reinforcement-learning"])
    rows = {"base model": base if hub else os.path.basename(os.path.abspath(base)), **rows}
    table = "\n".join(f"| {k} | {v} |" for k, v in rows.items())
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {name}\n\n{CARD_MARK}\n\n| | |\n| --- | --- |\n{table}\n"))


CARD_MARK = "Trained with minirl (RL post-training in plain PyTorch)."  # what tells an export from other folders
