"""The run log: phase timers, one metrics.jsonl record and one console line per step, and the held-out
(and, asked for, training) completions in samples.jsonl; TensorBoard and W&B get the same numbers.

Only rank 0 writes, line by line, so a crashed run keeps every finished step. A resumed run keeps the
steps before its checkpoint: each history is rewritten to a temporary file, fsynced and renamed, so a
kill leaves the old history or the kept one. Under MINIRL_PROFILE_LOOP=1 every phase's end (and every
finer mark inside one) is a profile mark of time and memory, recorded as `<loop>_step` (B27).
The keys are listed in docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
import uuid

import torch

from minirl import dist
from minirl.config import ConfigError, first_line


class RunLog:
    def __init__(self, run_dir: str, enabled: bool, every: int = 1, start_step: int = 0, tensorboard: bool = False,
                 wandb_project: str = "", config: dict | None = None, total_steps: int = 0, samples: int = 2,
                 device: torch.device | None = None):
        self.run_dir, self.enabled, self.every, self.total, self.shown = run_dir, enabled, every, total_steps, samples
        self.start_step, self._evals = start_step, 0
        self.times: dict[str, float] = {}
        self.profiling = os.environ.get("MINIRL_PROFILE_LOOP") == "1"
        self.device, self.profile, self._t = device or torch.device("cpu"), {}, time.perf_counter()
        self.step_times: list[float] = []  # for the ETA
        self._file = self._samples = self._tb = self._wandb = None
        self.last_eval: dict = {}  # a resumed run's newest eval record in the history it keeps (rank 0)
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError("--log.tensorboard needs TensorBoard: pip install -e '.[tensorboard]'") from e
            # TensorBoard shows what metrics.jsonl keeps: the events from `start_step` on that an earlier run
            # left here (past its checkpoint, or a whole run a fresh one replaces) are purged from its view
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start_step)
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
            try:
                self._wandb = wandb.init(project=wandb_project, dir=run_dir, config=config or {}, id=run_id,
                                         resume="allow")
            except wandb.errors.Error as e:  # no API key (and no terminal to ask for one), W&B unreachable
                raise ConfigError(f"--log.wandb-project={wandb_project!r}: W&B did not start ({type(e).__name__}: "
                                  f"{first_line(e)}); log in (wandb login, or WANDB_API_KEY), or keep the "
                                  "run's W&B logs in files with WANDB_MODE=offline (wandb sync uploads them)") from e
            # W&B drops what is logged below its newest step; a streamed run's late eval and a resumed run's
            # steps come out of order, so its charts run on the records' own `step` instead
            self._wandb.define_metric("step")
            self._wandb.define_metric("*", step_metric="step")
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self._file, kept = _history(os.path.join(run_dir, "metrics.jsonl"), start_step)
            self._samples, _ = _history(os.path.join(run_dir, "samples.jsonl"), start_step)
            self.last_eval = next((r for r in map(json.loads, reversed(kept)) if "eval_version" in r), {})

    @contextlib.contextmanager
    def phase(self, name: str, announce: str = "", extra=None):
        """Time a phase into `time/<name>` (accumulated) and mark its end in the profile; `announce`: say what
        a long phase does and when it is done; `extra()`: more numbers for its mark."""
        t0, marks = time.perf_counter(), len(self.profile.get("phases", ()))
        if announce:
            self.info(f"{announce} ...")
        yield  # an error (a Ctrl-C) goes up from here: the phase is not done, and is not said to be
        dt = time.perf_counter() - t0
        self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + dt
        if announce:
            self.info(f"{announce}: done in {dt:.1f} s")
        if len(self.profile.get("phases", ())) == marks:
            self.mark(name, **(extra() if extra else {}))

    def mark(self, boundary: str, **extra: float) -> None:
        """MINIRL_PROFILE_LOOP=1: close the profile's phase ending at `boundary`: its wall time, the
        device's memory now (CUDA: allocated and reserved; CPU: the process's RSS), any `extra` numbers."""
        if not self.profiling:
            return
        now = time.perf_counter()
        self.profile.setdefault("phases", []).append(boundary)
        self.profile[f"{boundary}/s"] = round(now - self._t, 6)
        self.profile.update({f"{boundary}/{k}": round(v, 6) for k, v in extra.items()})
        self._t = now
        if self.device.type == "cuda":
            self.profile[f"{boundary}/allocated_mib"] = torch.cuda.memory_allocated(self.device) / 2**20
            self.profile[f"{boundary}/reserved_mib"] = torch.cuda.memory_reserved(self.device) / 2**20
        else:
            import psutil  # CPU runs only (a bare CUDA box may lack it)
            self.profile[f"{boundary}/rss_mib"] = psutil.Process().memory_info().rss / 2**20

    def begin_step(self) -> None:
        self.profile, self._t = {}, time.perf_counter()

    def take_profile(self) -> dict | None:
        """The step's profile record (None unless profiling), and a fresh one for the next step."""
        out, self.profile = (self.profile if self.profiling else None), {}
        return out

    def write(self, record: dict) -> None:
        """Append one record (plus this step's phase times) and print the console line. An eval's
        `eval_samples` go to samples.jsonl, and the first --log.samples of them to the console."""
        shown, trained = record.pop("eval_samples", []), record.pop("train_samples", [])
        record = {k: v for k, v in {**record, **{k: round(v, 4) for k, v in self.times.items()}}.items()
                  if v is not None}
        self.times = {}
        if "time/step" in record:
            self.step_times.append(record["time/step"])
        if not self.enabled:
            return
        strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        _append(self._file, [json.dumps(strict) + "\n"])  # NaN and inf as null: strict JSON, as samples.jsonl
        scalars = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, record.get("step", 0))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({"step": record.get("step", 0), **scalars})
        if record.get("step", 0) % self.every == 0 or "eval_accuracy" in record:
            eta = None
            if self.total and self.step_times and "time/step" in record:
                recent = (self.step_times[1:] or self.step_times)[-20:]  # the first step's warm-up is no rate
                eta = sum(recent) / len(recent) * max(self.total - record["step"] - 1, 0)
            print(console_line(record, self.total, eta, first=record.get("step") == self.start_step), flush=True)
        if trained:  # --log.train-samples: beside the evals', and a W&B table
            _append(self._samples, [json.dumps({"step": record["step"], "split": "train", **r}) + "\n" for r in trained])
            if self._wandb is not None:
                import wandb
                self._wandb.log({"step": record["step"], "train_samples": wandb.Table(
                    columns=list(trained[0]), data=[list(map(str, r.values())) for r in trained])})
        if shown:
            self._write_samples(record, shown)

    def _write_samples(self, record: dict, rows: list[dict]) -> None:
        where = {"step": record.get("step", 0), "eval_version": record.get("eval_version")}
        _append(self._samples, [json.dumps({**where, **row}) + "\n" for row in rows])
        first = self._evals * self.shown % len(rows)  # each eval shows the next few prompts of the set
        self._evals += 1
        for row in (rows[first:] + rows[:first])[:self.shown]:
            print(sample_line(row, f"version {where['eval_version']}"), flush=True)

    def sync(self) -> None:
        """metrics.jsonl and samples.jsonl on disk (before a checkpoint may claim their steps)."""
        for f in (self._file, self._samples):
            if f:
                f.flush()
                os.fsync(f.fileno())

    def info(self, msg: str) -> None:
        """minirl's own lines go to stdout with the step lines; errors alone go to stderr."""
        if self.enabled:
            print(msg, flush=True)

    def close(self) -> None:
        for f in (self._file, self._samples):
            if f:
                with contextlib.suppress(OSError):  # a full disk was said when a write failed (`_append`)
                    f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _append(f, lines: list[str]) -> None:
    """Whole lines to a history file, flushed; a full disk is one line (a resume drops a line it cut)."""
    try:
        f.writelines(lines)
        f.flush()
    except OSError as e:
        raise ConfigError(f"writing {f.name} failed: [Errno {e.errno}] {e.strerror}; free some space and resume "
                          "with --checkpoint.resume auto (a line cut short is dropped)") from e


def sample_line(row: dict, where: str = "") -> str:
    """One held-out row for the console: `  sample (<where>): 'prompt' -> 'completion' (answer, reward)`."""
    cut = ", cut at --rollout.max-tokens" if row.get("clipped") else ""
    return (f"  sample{f' ({where})' if where else ''}: {row['prompt']!r} -> {row['completion']!r} "
            f"(answer {row['answer']!r}, reward {row['reward']:.3g}{cut})")


def _history(path: str, start_step: int):
    """`path` open for appending, and the lines kept. A resumed run keeps only the lines of the steps before
    `start_step`, written to a temporary file, fsynced and renamed over it; a fresh run starts it empty."""
    kept = []
    if start_step and os.path.exists(path):
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
    return open(path, "a"), kept


def engine_log(log_cfg, rank: int, several: bool) -> str | None:
    """Where an engine's own output goes: <run dir>/engine.log (engine_rank<R>.log when several
    ranks have engines), or None (the console) with --log.engine-logs."""
    if log_cfg.engine_logs:
        return None
    return os.path.join(log_cfg.run_dir, f"engine_rank{rank}.log" if several else "engine.log")


def sample_metrics(rewards: torch.Tensor, group_size: int, lengths: list[int], clipped: list[bool],
                   parts: dict | None = None) -> dict:
    """The step's samples over every rank (a collective): reward mean and std, each function's mean over the
    rows it scores (None: it scored none), the share of groups without signal, completion lengths, the share
    cut at --rollout.max-tokens."""
    r = rewards.double().view(-1, group_size)                                        # (groups, G)
    parts = {name: torch.as_tensor(v, dtype=torch.float64) for name, v in (parts or {}).items()}
    applies = [(~v.isnan()).sum() for v in parts.values()]  # a TRL reward's None (NaN) is left out of its mean
    flat = dist.all_reduce(torch.tensor([r.numel(), r.sum(), r.square().sum(), r.shape[0],
                                         (r.max(1).values == r.min(1).values).sum(), sum(lengths), sum(clipped),
                                         *(v.nansum() for v in parts.values()), *applies], dtype=torch.float64))
    n, total, squares, groups, flat_groups, tokens, cut, *sums = flat.tolist()
    far = dist.all_reduce(torch.tensor([max(lengths), -min(lengths)], dtype=torch.float64), "max").tolist()
    mean = total / n
    k = len(parts)
    return {"reward_mean": mean, "reward_std": max(squares / n - mean * mean, 0.0) ** 0.5,
            **{f"reward/{name}": s / c if c else None for name, s, c in zip(parts, sums[:k], sums[k:])},
            "frac_reward_zero_std": flat_groups / groups, "completion_len_mean": tokens / n,
            "completion_len_min": -far[1], "completion_len_max": far[0], "completion_clip_ratio": cut / n}


def training_rows(tok, prompts: list, completions: list, rewards, parts: dict, clipped, n: int) -> list[dict]:
    """The first `n` of a step's training rollouts for samples.jsonl (--log.train-samples): prompt and
    completion decoded, the reward, each function's value (`parts`: name -> values), clipped. A prompt
    keeps its special tokens (a chat template's markers, as the eval rows show it); a completion's EOS goes."""
    n = min(n, len(completions))
    if not n:
        return []
    asked = tok.batch_decode([list(map(int, c)) for c in prompts[:n]], skip_special_tokens=False)
    said = tok.batch_decode([list(map(int, c)) for c in completions[:n]], skip_special_tokens=True)
    return [{"prompt": asked[i], "completion": said[i], "reward": float(rewards[i]),
             "rewards": {k: float(v[i]) if v[i] == v[i] else None for k, v in parts.items()},  # NaN: TRL's None
             "clipped": bool(clipped[i])} for i in range(n)]


def memory_peak_gib(device: torch.device, over_ranks: bool = True) -> float:
    """The peak memory since the last call (the card's, reset here; the process's RSS on CPU).
    `over_ranks`: the max over the default group; a rollout rank passes False (its group is vLLM's)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if not over_ranks:
        return peak
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
    """One step's line, counting the steps done with it (`step 20/20` after the last); `first`: its time
    includes the engine's warm-up."""
    step = r.get("step", "?") + ("reward_mean" in r)
    parts = [f"step {step:>4}/{total}" if total else f"step {step:>4}"]
    for key, label in SHOWN:
        if key in r:
            v = r[key]
            if first and key == "tokens_per_s":
                label += " (incl. warm-up)"
            parts.append(f"{label} {v:.3g}" if isinstance(v, float) else f"{label} {v}")
            if key == "eval_accuracy" and r.get("eval_version", step) != step:  # a streamed PPO's eval trails
                parts[-1] += f" (version {r['eval_version']})"
    if eta is not None:
        parts.append(f"eta {_duration(eta)}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
