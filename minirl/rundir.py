"""The run directory: one live run owns it, and a new run never loses an old one's work by accident.

`claim(args, resume)` runs on global rank 0 of a launch, after the flags are checked and before
anything is written or built:
- a lock (`<run dir>/.lock`, `fcntl.flock`) held for the life of the process: a second run on a run
  directory that a live run holds exits 2 naming it. The kernel drops the lock when the holder
  dies, however it dies, so a crashed run never leaves it stuck.
- `--checkpoint.resume auto` in a run directory that holds a run but no complete checkpoint is
  refused (it would start fresh over that run's history and final/).
- `--log.overwrite` starts the directory clean of the old run: its metrics, config, final/,
  engine logs, TensorBoard and W&B files, and the checkpoints in `--checkpoint.dir`, so neither
  `--checkpoint.resume auto` nor checkpoint pruning can ever mix two runs.
The run-directory checks that need no lock (a file, not writable, holding a run that is neither
resumed nor overwritten) are `config._check_run_dir`, run by every `validate`.
"""

from __future__ import annotations

import fcntl
import os
import shutil

from minirl.config import ConfigError

_held: dict[str, object] = {}  # run dir -> its open lock file, kept open (and locked) until the process exits

OLD_RUN = ("metrics.jsonl", "metrics.jsonl.tmp", "samples.jsonl", "samples.jsonl.tmp", "config.json", "final",
           "final.tmp", "tensorboard", "wandb", "wandb_run_id", "curve.png")


def holds_run(run_dir: str) -> bool:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    return os.path.isfile(metrics) and os.path.getsize(metrics) > 0


def claim(args, resume: str | None) -> None:
    """Own `args.log.run_dir` for this run (global rank 0 only; other ranks return at once)."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    d = args.log.run_dir
    os.makedirs(d, exist_ok=True)
    lock(d)
    if args.log.overwrite:
        clear(d, args.checkpoint_dir)
    elif args.checkpoint.resume == "auto" and resume is None and holds_run(d):
        raise ConfigError(f"--checkpoint.resume auto: {d!r} holds a run but {args.checkpoint_dir!r} has no complete "
                          "checkpoint to resume; start over with --log.overwrite, or pick another --log.run-dir")


def lock(run_dir: str) -> None:
    path = os.path.abspath(os.path.join(run_dir, ".lock"))
    if path in _held:
        return
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"--log.run-dir={run_dir!r} is in use by a live run ({holder}); wait for it to end, "
                          "or pick another --log.run-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    f.flush()
    _held[path] = f


def clear(run_dir: str, checkpoint_dir: str) -> None:
    """--log.overwrite: remove what an old run left (never anything else in the folder)."""
    for name in os.listdir(run_dir):
        if name in OLD_RUN or name.startswith("engine") and name.endswith(".log"):
            _remove(os.path.join(run_dir, name))
    if os.path.isdir(checkpoint_dir):
        for name in os.listdir(checkpoint_dir):
            if name.startswith("step_"):
                _remove(os.path.join(checkpoint_dir, name))
        if not os.listdir(checkpoint_dir):
            os.rmdir(checkpoint_dir)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
