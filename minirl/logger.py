"""The run log: phase timers, one metrics.jsonl record per step, one console line per step.

Only rank 0 writes. Records are flushed line by line, so a crashed run keeps every finished
step. Keys: `step`, `reward_mean`, the objective's rolled-up metrics, and `time/<phase>`.
metrics.jsonl is always written; TensorBoard (`--log.tensorboard`) and Weights & Biases
(`--log.wandb-project`) get the same numbers when asked for, and need their optional extras.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from minirl.config import ConfigError


class RunLog:
    def __init__(self, run_dir: str, enabled: bool, every: int = 1, start_step: int = 0, tensorboard: bool = False,
                 wandb_project: str = "", config: dict | None = None):
        self.run_dir, self.enabled, self.every = run_dir, enabled, every
        self.times: dict[str, float] = {}
        self._file = self._tb = self._wandb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError("--log.tensorboard needs TensorBoard: pip install -e '.[tensorboard]'") from e
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if enabled and wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise ConfigError("--log.wandb-project needs Weights & Biases: pip install -e '.[wandb]'") from e
            self._wandb = wandb.init(project=wandb_project, dir=run_dir, config=config or {}, resume="allow")
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, "metrics.jsonl")
            kept = []
            if start_step and os.path.exists(path):  # a resumed run keeps the steps it does not re-run
                with open(path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line).get("step", -1) < start_step]
            self._file = open(path, "w")
            self._file.writelines(kept)

    @contextlib.contextmanager
    def phase(self, name: str, announce: str = ""):
        """Time a phase of the current step into `time/<name>` (accumulates if entered twice).
        `announce`: a long one-off phase says what it is doing, and when it is done."""
        t0 = time.perf_counter()
        if announce:
            self.info(f"{announce} ...")
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + dt
            if announce:
                self.info(f"{announce}: done in {dt:.1f} s")

    def write(self, record: dict) -> None:
        """Append one record (plus this step's phase times) and print the console line."""
        record = {**record, **{k: round(v, 4) for k, v in self.times.items()}}
        self.times = {}
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, record.get("step", 0))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=record.get("step", 0))
        if record.get("step", 0) % self.every == 0 or "eval_accuracy" in record:
            print(console_line(record), flush=True)

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


SHOWN = [("reward_mean", "reward"), ("eval_accuracy", "eval_acc"), ("grpo_loss", "loss"), ("ppo_loss", "loss"),
         ("value_loss", "vloss"), ("ppo_chunks", "chunks"), ("grpo_kl", "kl"), ("grpo_clipfrac", "clip"),
         ("ppo_clipfrac", "clip"), ("grad_norm", "gnorm"),
         ("time/step", "s"), ("tokens_per_s", "tok/s")]


def console_line(r: dict) -> str:
    parts = [f"step {r.get('step', '?'):>4}"]
    for key, label in SHOWN:
        if key in r:
            v = r[key]
            parts.append(f"{label} {v:.3g}" if isinstance(v, float) else f"{label} {v}")
    return " | ".join(parts)
