"""The command layer: flags (with `--config FILE`) in, every check before a loop starts, an exit code out.

- `parse(cls, argv, description)`: tyro's flags for the dataclass `cls`. `--config FILE` (YAML or
  JSON, nested like the flags: `{"rl": {"lr": 1e-5}}`) gives the defaults and the flags beside it
  win, so a run's own config.json reruns that run and `--config run/config.json --steps 800`
  continues the same recipe for longer. A key the dataclass does not have, or a value its flag would
  refuse, is an error naming it. A file never sets the run's own switches (`--log.run-dir`,
  `--log.overwrite`, `--checkpoint.resume`, `--checkpoint.dir`): rerunning another run's config.json
  must not write into, resume or wipe that run. YAML aliases, a key given twice and files over 64 KiB are refused.
- `preflight(cls, argv, loop)`: what a loop starts from, every check done first, before
  any model, engine or process group is built: the flags and `--config`, the `--dry-run` branch (the
  only way into the tools, minirl/tools/, and lazily), validation for the launch's world, the model
  folder and what the engine can run, the task (its prompts checked, its reward functions imported),
  the checkpoint to resume (its files, and its shapes against the model's), and the run directory's
  claim (`claim`).
- `claim(args, resume)`: one live run owns a run directory (a kernel lock, `<run dir>/.lock`, that dies
  with its process; a second run on it exits 2 naming the holder); `--checkpoint.resume auto` in a run
  directory that holds a run but no complete checkpoint is refused; `--log.overwrite` removes the old
  run's metrics, config, final/, logs and its checkpoints first, so neither a resume nor a prune ever
  mixes two runs. (The checks that need no lock are `config._check_run_dir`, in every `validate`.)
- `run(name, main, argv)`: the console scripts (`minirl-grpo`, ...) and `python -m` both go
  through it: exit 0 on success; 2 with one line on a bad flag, file or checkpoint, or a reward
  function past --task.reward-timeout; 1 with one line when a reward function failed during the run
  (`rewards.RewardError`, naming it); 3 with one line when a run stopped because it could no longer
  learn; 4 with one line when a rank lost a peer
  (another rank, its node, or the run's store; `dist.lost_peer`); and the process group is torn down
  before the process leaves (without the interpreter's teardown, see `leave`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import inspect
import json
import logging
import os
import shutil
import sys
import time
import typing
import uuid
from dataclasses import dataclass

import tyro
import yaml

from minirl import checkpoint, dist, models, rewards, tasks
from minirl.accumulator import StalledError
from minirl.config import ConfigError
from minirl.rollout import check_model


MAX_CONFIG_BYTES = 64 << 10  # a recipe is a few KiB; PyYAML takes seconds per 100 KiB of a long list
MAX_CONFIG_DEPTH = 32
# Switches that belong to one run: a config file (often another run's config.json) never carries them
# into this one; only the command line sets them.
PER_RUN = {"log.run_dir", "log.overwrite", "checkpoint.resume", "checkpoint.dir"}


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path!r} is not a file")
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config={path!r} is over {MAX_CONFIG_BYTES >> 10} KiB; a config file holds flags")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config={path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    try:
        if path.endswith((".yaml", ".yml")):
            # Aliases are refused before anything is built: nested ones expand exponentially (a 351-byte
            # "billion laughs" file never finishes), and flags have no use for them. Deep flow nesting is
            # refused first, by a linear count: PyYAML's scanner slows with the depth (600 KB took minutes).
            depth = deepest = 0
            for ch in text:
                depth += (ch in "[{") - (ch in "]}")
                deepest = max(deepest, depth)
            if deepest > MAX_CONFIG_DEPTH:
                raise ConfigError(f"--config={path!r} nests [ or {{ more than {MAX_CONFIG_DEPTH} deep; flags "
                                  "nest a few levels")
            if any(isinstance(t, yaml.AliasToken) for t in yaml.scan(text)):
                raise ConfigError(f"--config={path!r}: YAML aliases (*name) are not supported; write the values out")
            data = yaml.load(text, Loader=_Unique)  # plain data only (SafeLoader): never constructs objects
        else:
            data = json.loads(text, object_pairs_hook=lambda pairs: _unique(dict(pairs), [k for k, _ in pairs]))
    except ConfigError:
        raise
    except _Twice as e:
        raise ConfigError(f"--config={path!r}: {e}") from None
    except Exception as e:
        raise ConfigError(f"--config={path!r}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config={path!r}: expected a mapping of flags, got a {type(data).__name__}")
    return data


class _Twice(ValueError):
    """A key given twice in one mapping of a config file (YAML and JSON readers keep the last, silently)."""


def _unique(mapping: dict, keys: list) -> dict:
    if len(mapping) != len(keys):
        raise _Twice(f"the key {next(k for k in keys if keys.count(k) > 1)!r} is given twice; give it once")
    return mapping


class _Unique(yaml.SafeLoader):
    """PyYAML's safe loader (plain data only), refusing a key given twice."""

    def construct_mapping(self, node, deep=False):
        return _unique(super().construct_mapping(node, deep), [self.construct_object(k) for k, _ in node.value])


# TRL's and verl's names for a setting (the last part of a dotted name, `_` for `-`) -> minirl's flag;
# "{opt}" is the loop's optimizer group. The whole table, with each library's full names: docs/flags.md.
ELSEWHERE = {
    "learning_rate": "--{opt}.lr", "beta": "--{opt}.kl-coef", "kl_loss_coef": "--{opt}.kl-coef",
    "kl_loss_type": "--{opt}.kl-estimator", "kl_penalty": "--{opt}.kl-estimator", "epsilon": "--{opt}.clip-eps",
    "clip_ratio": "--{opt}.clip-eps", "epsilon_high": "--{opt}.clip-eps-high", "clip_ratio_high": "--{opt}.clip-eps-high",
    "clip_ratio_c": "--{opt}.dual-clip", "entropy_coeff": "--{opt}.entropy-coef", "loss_type": "--{opt}.loss-agg-mode",
    "loss_agg_mode": "--{opt}.loss-agg-mode", "warmup_steps": "--{opt}.lr-warmup-steps",
    "lr_scheduler_type": "--{opt}.lr-schedule", "max_grad_norm": "--{opt}.max-grad-norm", "grad_clip": "--{opt}.max-grad-norm",
    "num_generations": {"grpo": "--rl.group-size", "ppo": "--ppo.num-generations-per-prompt"},
    "n": {"grpo": "--rl.group-size", "ppo": "--ppo.num-generations-per-prompt"},
    "num_iterations": {"grpo": "--rl.mu-iterations", "ppo": "--ppo.ppo-epochs"},
    "max_steps": "--steps", "total_training_steps": "--steps", "max_completion_length": "--rollout.max-tokens",
    "max_response_length": "--rollout.max-tokens", "max_prompt_length": "--rollout.max-prompt-tokens",
    "output_dir": "--log.run-dir", "save_steps": "--checkpoint.every", "save_freq": "--checkpoint.every",
    "save_total_limit": "--checkpoint.keep", "eval_steps": "--log.eval-every", "test_freq": "--log.eval-every",
    "reward_funcs": "--task.reward", "model_name_or_path": "--model.path", "train_files": "--task.path",
    "val_files": "--task.eval-path"}


def elsewhere(name: str, loop: str) -> str:
    """A hint for a flag or config key minirl does not have but TRL or verl does ('' if none)."""
    hint = ELSEWHERE.get(name.lstrip("-").split("=")[0].split(".")[-1].replace("-", "_"))
    if isinstance(hint, dict):
        hint = hint.get(loop, "")
    return f"; did you mean {hint.format(opt='ppo' if loop == 'ppo' else 'rl')} (TRL's and verl's names: " \
           "docs/flags.md)?" if hint else ""


def fill(instance, data: dict, where: str, lenient: bool = False, skip=frozenset(), path: str = "", loop: str = ""):
    """`instance` with the values of `data` (nested dicts for nested dataclasses), each checked
    against its field's type as the flag's parser would (`_typed`). A key is the flag's name with `-`
    or `_` (one spelling per flag). `lenient`: skip what this command does not have (another command's
    run config), instead of refusing it. `skip`: flags never taken from a file (`log.run_dir`, ...).
    `loop`: the command's loop, for the hint that names minirl's flag for a TRL or verl key."""
    fields = {f.name: f for f in dataclasses.fields(instance)}
    types = typing.get_type_hints(type(instance))
    seen: dict[str, str] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in seen:
            raise ConfigError(f"--config: {where}{key} is given twice (also as {where}{seen[name]})")
        seen[name] = key
        if path + name in skip:
            continue
        current = getattr(instance, name, None)
        if name not in fields or (lenient and isinstance(value, dict) != dataclasses.is_dataclass(current)):
            if lenient:
                continue
            nest = f"; keys nest: write {key.split('.')[0]}: {{{key.split('.', 1)[1]}: ...}}" if "." in key else ""
            raise ConfigError(f"--config: {where}{key} is not a flag of this command (see --help){nest}"
                              f"{elsewhere(key, loop)}")
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"--config: {where}{key} must be a mapping")
            fill(current, value, f"{where}{key}.", lenient, skip, f"{path}{name}.", loop)
        else:
            setattr(instance, name, _typed(value, types[name], f"{where}{key}"))
    return instance


def _typed(value, tp, where: str):
    """`value` as a flag of type `tp` would take it, or a ConfigError naming the key. Numbers may be
    written as YAML 1.1 reads them as strings (`1e-4`); a bool is never taken for a number."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        return _typed(value, next(a for a in args if a is not type(None)), where)
    wrong = ConfigError(f"--config: {where}={value!r} is not {_kind(tp)}")
    if origin is typing.Literal:
        if value not in args:
            raise wrong
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise wrong
        return origin(_typed(v, args[0], where) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if tp in (int, float):
        if isinstance(value, str):
            try:
                value = int(value) if tp is int else float(value)
            except ValueError:
                raise wrong from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (tp is int and not isinstance(value, int)):
            raise wrong
        return tp(value)
    if tp is str and not isinstance(value, str):
        raise wrong
    return value


def _flags(cls, prefix: str = "") -> set[str]:
    """Every flag name of the dataclass `cls` (dashed, dotted for nested ones; `no-` forms left out)."""
    names = set()
    for f in dataclasses.fields(cls):
        name = prefix + f.name.replace("_", "-")
        tp = typing.get_type_hints(cls)[f.name]
        names |= _flags(tp, name + ".") if dataclasses.is_dataclass(tp) else {name}
    return names


def _kind(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def parse(cls, argv: list[str] | None, description: str, lenient: bool = False):
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, why in getattr(cls, "REFUSED", {}).items():  # flags the command has retired or never had
        if any(a.startswith(flag) for a in argv):
            raise ConfigError(why)
    known = _flags(cls)
    for a in argv:  # a TRL or verl name: say minirl's (tyro would only list every flag)
        unknown = a.startswith("--") and a[2:].split("=")[0].replace("_", "-") not in known
        hint = elsewhere(a, getattr(cls, "LOOP", "")) if unknown else ""
        if hint:
            raise ConfigError(f"{a.split('=')[0]} is not a flag of this command{hint}")
    default = cls()
    for i, a in enumerate(argv):
        if a == "--config" or a.startswith("--config="):
            path = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            # this run's own switches, never another's (a config.json reruns a recipe), in either spelling
            default = fill(cls(), _read(path), "", lenient, skip={"config", *PER_RUN}, loop=getattr(cls, "LOOP", ""))
            default.config = path
            break
    return tyro.cli(cls, args=argv, default=default, description=description)


@dataclass
class Ready:
    """What a loop starts from, every check done (`preflight`)."""

    args: object         # GRPOArgs or PPOArgs, validated for this launch's world
    path: str            # the model's folder
    tok: object          # its tokenizer
    task: object         # the prompts, checked against the prompt budget, with their scorer
    resume: str | None   # the checkpoint to resume from, checked from its files, or None
    owner: dict = dataclasses.field(default_factory=dict)  # the run's identity (global rank 0; `claim`)

    @property
    def max_model_len(self) -> int:
        return self.args.rollout.max_prompt_tokens + self.args.rollout.max_tokens

    @property
    def pad_id(self) -> int:
        return self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id


def preflight(cls, argv: list[str] | None, loop) -> Ready | None:
    """Parse and check everything a run of `loop` (the loop's module) needs, in the order a bad input is
    cheapest to find; None after a dry run (nothing was loaded or built, the plan was printed). `--help`
    describes the command by its flags' class docstring, written for users."""
    args = parse(cls, argv, inspect.cleandoc(cls.__doc__))
    if args.dry_run:  # the tools' one door: the plan (and the rehearsal), or the rehearsal's child run
        if os.environ.get("MINIRL_REHEARSAL_CHILD") == "1":
            from minirl.tools import rehearse
            rehearse.child(args, loop)
            return None
        from minirl.tools import plan
        plan.dry_run(args)
        if args.rehearse and int(os.environ.get("RANK", 0)) == 0:  # one process rehearses train rank 0
            from minirl.tools import rehearse
            rehearse.run(sys.argv[1:] if argv is None else argv, cls.LOOP)
        return None
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.validate(world_size)
    path = models.resolve_path(args.model)
    ready = Ready(args, path, None, None, None)
    check_model(path, args.rollout, ready.max_model_len, head_dim_flag="--model.tiny.num-heads")
    ready.tok = models.load_tokenizer(path)
    ready.task = tasks.make_task(args.task, args.seed, ready.tok, args.rollout.max_prompt_tokens,
                                 evaluates=bool(args.log.eval_every))  # every prompt and reward function
    disaggregated = args.grid.gpu_placement == "disaggregated"
    train_ranks = world_size - (args.grid.rollout_ranks if disaggregated else 0)
    owned_checkpoints(args)
    ready.resume = checkpoint.find(args.checkpoint.resume, args.checkpoint_dir, cls.LOOP, train_ranks, args.steps,
                                   owner=identity(args.log.run_dir))
    if ready.resume:  # another model's checkpoint is refused before the run directory is touched
        checkpoint.check_shapes(ready.resume, models.on_meta(path, checkpoint.PARTS[cls.LOOP]))
    ready.owner = claim(args, ready.resume)
    return ready


def run(name: str, main, argv: list[str] | None = None) -> None:
    """Run `main(argv)` as a command: exit codes and one-line errors (the module docstring)."""
    code = 0
    try:
        main(argv)
    except (ConfigError, checkpoint.CheckpointError) as e:  # bad flag, file or checkpoint: say which, no traceback
        print(f"{name}: error: {e}", file=sys.stderr)
        code = 2
    except rewards.RewardError as e:  # a reward function raised, exited, returned no number or hung: which, on what
        print(f"{name}: error: {e}", file=sys.stderr)
        code = e.code
    except KeyboardInterrupt:  # a Ctrl-C outside the steps (the build, an eval, an export): one line
        print(f"{name}: interrupted (Ctrl-C); nothing after the last complete checkpoint is kept", file=sys.stderr)
        code = 130
    except StalledError as e:  # the run can no longer learn: say why, no traceback
        print(f"{name}: stopped: {e}", file=sys.stderr)
        code = 3
    except Exception as e:  # a peer rank, its node or the run's store is gone: say which, no traceback
        lost = dist.lost_peer(e)
        if lost is None:
            raise
        print(f"{name}: error: {lost}", file=sys.stderr)
        code = 4
    finally:
        dist.shutdown()
    leave(code)


def leave(code: int = 0) -> None:
    """Exit now, without the interpreter's teardown, once everything written is closed (metrics,
    checkpoints, the engine, the process group): C++ threads of the libraries underneath can abort
    there ("terminate called without an active exception", seen about once in ten multi-rank runs
    after a complete run, and in CI after a two-rank test script had passed), which would turn a
    finished run into a failed one. The test scripts under tests/dist leave the same way."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the run directory: one live run owns it ----

_held: dict[str, object] = {}  # run dir -> its open lock file, kept open (and locked) until the process exits

OLD_RUN = ("run.json", "metrics.jsonl", "metrics.jsonl.tmp", "samples.jsonl", "samples.jsonl.tmp", "config.json", "final",
           "final.tmp", "tensorboard", "wandb", "wandb_run_id", "curve.png")


def holds_run(run_dir: str) -> bool:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    return os.path.isfile(metrics) and os.path.getsize(metrics) > 0


def identity(run_dir: str) -> dict:
    """The run a run directory holds, from its `run.json`: `run` (its id), `line` (the id of the line of
    checkpoints it is on) and `from` (the step that line started from); {} when it holds none."""
    try:
        with open(os.path.join(run_dir, "run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def owned_checkpoints(args) -> None:
    """A checkpoint folder belongs to one run: one that holds another run's is refused (unless
    --log.overwrite, which removes them)."""
    other = "" if args.log.overwrite else checkpoint.foreign(args.checkpoint_dir, identity(args.log.run_dir))
    if other:
        raise ConfigError(f"--checkpoint.dir={args.checkpoint_dir!r} holds another run's checkpoint ({other}); a "
                          "checkpoint folder belongs to one run: pick another --checkpoint.dir (or --log.overwrite "
                          "to remove them)")


def claim(args, resume: str | None) -> dict:
    """Own `args.log.run_dir` and `args.checkpoint_dir` for this run (global rank 0 only; other ranks
    return {} at once); returns the run's identity (`identity`), begun or continued (`begin`)."""
    if int(os.environ.get("RANK", 0)) != 0:
        return {}
    d = args.log.run_dir
    os.makedirs(d, exist_ok=True)
    lock(d, "--log.run-dir")
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    lock(args.checkpoint_dir, "--checkpoint.dir")
    if args.log.overwrite:
        clear(d, args.checkpoint_dir)
    elif args.checkpoint.resume == "auto" and resume is None and holds_run(d):
        raise ConfigError(f"--checkpoint.resume auto: {d!r} holds a run but {args.checkpoint_dir!r} has no complete "
                          "checkpoint to resume; start over with --log.overwrite, or pick another --log.run-dir")
    return begin(args, resume)


def begin(args, resume: str | None) -> dict:
    """The run's identity in run.json: a new run when it starts fresh; the same run and line on `auto`;
    a new line from the checkpoint a resume by path names, the newer checkpoints of the line it leaves
    moved (never deleted) to `<checkpoint dir>/set_aside/<time>/`, so `auto` never goes back to them."""
    new, owner = uuid.uuid4().hex[:12], identity(args.log.run_dir)
    start = checkpoint.steps_done(resume) if resume else 0
    if not resume or not owner:
        owner = {"run": new, "line": new, "from": start}
    elif args.checkpoint.resume != "auto":
        owner = {"run": owner["run"], "line": new, "from": start}
    path = os.path.join(args.log.run_dir, "run.json")
    with open(path + ".tmp", "w") as f:
        json.dump(owner, f)
    os.replace(path + ".tmp", path)  # the new line first: a crash among the moves below leaves no doubt
    d = args.checkpoint_dir
    newer = sorted(n for n in os.listdir(d) if n.startswith("step_") and n[5:13].isdigit() and int(n[5:13]) > start)
    if resume and args.checkpoint.resume != "auto" and newer:
        aside = os.path.join(d, "set_aside", time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(aside, exist_ok=True)
        for n in newer:
            os.rename(os.path.join(d, n), os.path.join(aside, n))
        print(f"--checkpoint.resume={resume}: the line it leaves has newer checkpoints ({', '.join(newer)}); "
              f"they are set aside in {aside}", flush=True)
    return owner


def lock(folder: str, flag: str = "--log.run-dir") -> None:
    path = os.path.abspath(os.path.join(folder, ".lock"))
    if path in _held:
        return
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"{flag}={folder!r} is in use by a live run ({holder}); wait for it to end, "
                          f"or pick another {flag}") from None
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
            if name.startswith("step_") or name == "set_aside":
                _remove(os.path.join(checkpoint_dir, name))
        if not os.listdir(checkpoint_dir):
            os.rmdir(checkpoint_dir)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
