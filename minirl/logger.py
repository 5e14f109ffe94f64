"""The run log: phase timers, one metrics.jsonl record per step, one console line per step.

Only rank 0 writes. Records are flushed line by line, so a crashed run keeps every finished
step. A resumed run keeps the steps before its checkpoint: the history is rewritten to a
temporary file, fsynced and renamed over metrics.jsonl before anything slow starts, so a kill at
any moment leaves either the old history or the kept one, never an empty file. Keys: `step`, `reward_mean`, the objective's rolled-up metrics, and `time/<phase>`.
metrics.jsonl is always written; TensorBoard (`--log.tensorboard`) and Weights & Biases
(`--log.wandb-project`) get the same numbers when asked for, and need their optional extras.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
import uuid

import torch

from minirl import dist
from minirl.config import ConfigError


class RunLog:
    def __init__(self, run_dir: str, enabled: bool, every: int = 1, start_step: int = 0, tensorboard: bool = False,
                 wandb_project: str = "", config: dict | None = None, total_steps: int = 0):
        self.run_dir, self.enabled, self.every, self.total = run_dir, enabled, every, total_steps
        self.start_step = start_step
        self.times: dict[str, float] = {}
        self.step_times: list[float] = []  # for the ETA
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
            os.makedirs(run_dir, exist_ok=True)
            id_file = os.path.join(run_dir, "wandb_run_id")  # a resumed run continues the same W&B run
            if start_step and os.path.isfile(id_file):
                run_id = open(id_file).read().strip()
            else:
                run_id = uuid.uuid4().hex[:12]  # W&B takes any id of [a-z0-9]; wandb.util.generate_id is gone in 0.2x
                with open(id_file, "w") as f:
                    f.write(run_id)
            self._wandb = wandb.init(project=wandb_project, dir=run_dir, config=config or {}, id=run_id,
                                     resume="allow")
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, "metrics.jsonl")
            kept = []
            if start_step and os.path.exists(path):  # a resumed run keeps the steps it does not re-run
                try:
                    with open(path, encoding="utf-8") as f:
                        kept = [line for line in f if line.strip() and _step(line) < start_step]
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}), so its history cannot "
                                      "be kept; move it aside to resume without it") from e
            with open(path + ".tmp", "w") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
            self._file = open(path, "a")

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
        record = {k: v for k, v in {**record, **{k: round(v, 4) for k, v in self.times.items()}}.items()
                  if v is not None}
        self.times = {}
        if "time/step" in record:
            self.step_times.append(record["time/step"])
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
            eta = None
            if self.total and self.step_times and "time/step" in record:
                recent = (self.step_times[1:] or self.step_times)[-20:]  # the first step's warm-up is no rate
                eta = sum(recent) / len(recent) * max(self.total - record["step"] - 1, 0)
            print(console_line(record, self.total, eta, first=record.get("step") == self.start_step), flush=True)

    def info(self, msg: str) -> None:
        """minirl's own lines go to stdout with the step lines; errors alone go to stderr."""
        if self.enabled:
            print(msg, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def engine_log(log_cfg, rank: int, several: bool) -> str | None:
    """Where an engine's own output goes: <run dir>/engine.log (engine_rank<R>.log when several
    ranks have engines), or None (the console) with --log.engine-logs."""
    if log_cfg.engine_logs:
        return None
    return os.path.join(log_cfg.run_dir, f"engine_rank{rank}.log" if several else "engine.log")


def sample_metrics(rewards: torch.Tensor, group_size: int, lengths: list[int], clipped: list[bool]) -> dict:
    """The step's samples over every rank (a collective; each rank passes its own whole groups):
    reward mean and std, the share of groups whose rewards are all equal (no learning signal),
    completion lengths, and the share of completions cut at --rollout.max-tokens."""
    r = rewards.double().view(-1, group_size)                                        # (groups, G)
    flat = dist.all_reduce(torch.tensor([r.numel(), r.sum(), r.square().sum(), r.shape[0],
                                         (r.max(1).values == r.min(1).values).sum(), sum(lengths), sum(clipped)],
                                        dtype=torch.float64))
    n, total, squares, groups, flat_groups, tokens, cut = flat.tolist()
    far = dist.all_reduce(torch.tensor([max(lengths), -min(lengths)], dtype=torch.float64), "max").tolist()
    mean = total / n
    return {"reward_mean": mean, "reward_std": max(squares / n - mean * mean, 0.0) ** 0.5,
            "frac_reward_zero_std": flat_groups / groups, "completion_len_mean": tokens / n,
            "completion_len_min": -far[1], "completion_len_max": far[0], "completion_clip_ratio": cut / n}


def memory_peak_gib(device: torch.device) -> float:
    """The largest memory any rank held since the last call: the card's allocated peak (reset
    here), or on CPU the process's resident high-water mark (never reset)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return dist.all_reduce(torch.tensor([peak], dtype=torch.float64), "max").item()


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (ValueError, AttributeError):  # a line cut by a kill: not a step to keep
        return 1 << 62


SHOWN = [("reward_mean", "reward"), ("eval_accuracy", "eval_acc"), ("grpo_loss", "loss"), ("ppo_loss", "loss"),
         ("value_loss", "vloss"), ("ppo_chunks", "chunks"), ("grpo_kl", "kl"), ("ppo_kl", "kl"),
         ("grpo_clipfrac", "clip"), ("ppo_clipfrac", "clip"), ("grad_norm", "gnorm"), ("completion_len_mean", "len"),
         ("time/step", "s"), ("tokens_per_s", "tok/s")]


def console_line(r: dict, total: int = 0, eta: float | None = None, first: bool = False) -> str:
    """One step's line; `first`: the run's first step, whose time includes the engine's first-call warm-up."""
    step = r.get("step", "?")
    parts = [f"step {step:>4}/{total}" if total else f"step {step:>4}"]
    for key, label in SHOWN:
        if key in r:
            v = r[key]
            if first and key == "tokens_per_s":
                label += " (incl. warm-up)"
            parts.append(f"{label} {v:.3g}" if isinstance(v, float) else f"{label} {v}")
    if eta is not None:
        parts.append(f"eta {_duration(eta)}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
