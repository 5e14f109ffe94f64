"""A command's flags: tyro's for its dataclass (each help one paragraph), with `--config FILE` beneath them.

`--config FILE` (YAML or JSON, nested like the flags) gives the defaults and the flags beside it win,
so a run's own config.json reruns that run. A value its flag would refuse is an error naming it; so are
the unknown keys, all at once (each key inside a group minirl lacks), with minirl's name for a TRL or verl
one, and verl's Hydra overrides (key=value) given as arguments. A file never sets the run's own switches
(run dir, overwrite, resume, checkpoint dir; a line names those it holds); aliases, deep nesting, a key given
twice and files over 64 KiB are refused before anything is expanded. A leading `~` is the home folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import typing

import tyro
import yaml
from tyro import _docstrings

from minirl.config import ConfigError, first_line

MAX_CONFIG_BYTES = 64 << 10  # a recipe is a few KiB; PyYAML takes seconds per 100 KiB of a long list
MAX_CONFIG_DEPTH = 32
# Switches that belong to one run: a config file (often another run's config.json) never carries them
# into this one; only the command line sets them.
PER_RUN = {"log.run_dir", "log.overwrite", "checkpoint.resume", "checkpoint.dir"}


def _paragraphs(obj) -> dict[str, str]:
    """A class's field docstrings for --help, each one paragraph for the terminal to wrap. tyro 1.0 joins a
    docstring's lines before it dedents them, so it kept every line break of the source (tyro/_docstrings.py,
    `get_field_docstring`), and most entries in an 80-column terminal had a line cut short."""
    return {name: " ".join(text.split()) for name, text in _field_docstrings(obj).items()}


_field_docstrings = getattr(_docstrings, "parse_docstring_from_object", None)
if _field_docstrings:  # tyro 1.0's (private) reader; under another version --help is tyro's own
    _docstrings.parse_docstring_from_object = _paragraphs


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path!r} is not a file")
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config={path!r} is over {MAX_CONFIG_BYTES >> 10} KiB; a config file holds flags")
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is dropped
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
                          f"({type(e).__name__}: {first_line(e)[:160]})") from e
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


# TRL's and verl's names for a setting (the last part of a dotted name, `_` for `-`) -> minirl's flag, where minirl
# names it otherwise; "{opt}" is the loop's optimizer group. The whole table, with the libraries' full names:
# docs/flags.md.
ELSEWHERE = {
    "learning_rate": "--{opt}.lr", "beta": "--{opt}.kl-coef", "kl_loss_coef": "--{opt}.kl-coef",
    "kl_loss_type": "--{opt}.kl-estimator", "kl_penalty": "--{opt}.kl-estimator", "epsilon": "--{opt}.clip-eps",
    "clip_ratio": "--{opt}.clip-eps", "epsilon_high": "--{opt}.clip-eps-high", "clip_ratio_high": "--{opt}.clip-eps-high",
    "clip_ratio_c": "--{opt}.dual-clip", "entropy_coeff": "--{opt}.entropy-coef", "loss_type": "--{opt}.loss-agg-mode",
    "warmup_steps": "--{opt}.lr-warmup-steps", "lr_scheduler_type": "--{opt}.lr-schedule",
    "warmup_ratio": "--{opt}.lr-warmup-steps", "lr_warmup_steps_ratio": "--{opt}.lr-warmup-steps",
    "grad_clip": "--{opt}.max-grad-norm",
    "num_generations": {"grpo": "--rl.group-size", "ppo": "--ppo.num-generations-per-prompt"},
    "n": {"grpo": "--rl.group-size", "ppo": "--ppo.num-generations-per-prompt"},
    "num_iterations": {"grpo": "--rl.mu-iterations", "ppo": "--ppo.ppo-epochs"},
    "max_steps": "--steps", "total_training_steps": "--steps", "max_completion_length": "--rollout.max-tokens",
    "max_response_length": "--rollout.max-tokens", "max_prompt_length": "--rollout.max-prompt-tokens",
    "output_dir": "--log.run-dir", "save_steps": "--checkpoint.every", "save_freq": "--checkpoint.every",
    "save_total_limit": "--checkpoint.keep", "eval_steps": "--log.eval-every", "test_freq": "--log.eval-every",
    "reward_funcs": "--task.reward", "model_name_or_path": "--model.path", "train_files": "--task.path",
    "val_files": "--task.eval-path", "apply_chat_template_kwargs": "--task.chat-template-kwargs",
    "bf16": "--model.dtype bfloat16", "torch_dtype": "--model.dtype", "dataset_prompt_column": "--task.prompt-key",
    "dataset_name": "--task.path", "save_strategy": "--checkpoint.every", "log_completions": "--log.train-samples",
    "gradient_checkpointing": "--model.activation-checkpointing",
    "enable_gradient_checkpointing": "--model.activation-checkpointing", "use_remove_padding": "--model.packing",
    "logging_steps": "--log.every", "report_to": "--log.wandb-project or --log.tensorboard",
    "logger": "--log.wandb-project or --log.tensorboard",
    "vllm_gpu_memory_utilization": "--rollout.gpu-memory-utilization",
    "scale_rewards": {"grpo": "--rl.scale-by-std"}, "norm_adv_by_std_in_grpo": {"grpo": "--rl.scale-by-std"},
    "ppo_epochs": {"grpo": "--rl.mu-iterations"}, "ppo_mini_batch_size": {"grpo": "--rl.mini-batch-per-replica"},
    "ppo_micro_batch_size_per_gpu": {"grpo": "--rl.micro-batch-per-replica", "ppo": "--ppo.policy-micro-batch-rows"},
    "ppo_max_token_len_per_gpu": {"grpo": "--rl.max-tokens-per-micro-batch"},
    "train_batch_size": {"ppo": "--ppo.num-prompts-per-step"}, "critic_warmup": {"ppo": "--ppo.critic-warmup-steps"}}
# verl's critic.* keys whose minirl flag is not the policy's (PPO's; GRPO has no critic)
CRITIC = {"lr": "--ppo.value-lr", "ppo_epochs": "--ppo.critic-ppo-epochs", "cliprange_value": "--ppo.clip-eps",
          "ppo_micro_batch_size_per_gpu": "--ppo.critic-micro-batch-rows"}
REWARD = "--task.reward path/to/file.py:function"  # verl's custom_reward_function.path and .name, in one flag
# verl's groups whose keys are not minirl's flags of the same last name: the reward model's (its model.path is
# not --model.path), the validation's sampling, a data or server class's path and name, the profiler's steps
FOREIGN = {"reward-model", "val-kwargs", "custom-async-server", "custom-cls", "datagen", "profiler", "global-profiler"}


def elsewhere(name: str, command) -> str:
    """"did you mean <flag>?" for a flag or config key the dataclass `command` lacks: its flag of that name in
    another group (TRL's config files are flat: `temperature` is --rollout.temperature), else minirl's name for
    a TRL or verl one ('' if none)."""
    parts, loop = name.lstrip("-").split("=")[0].replace("_", "-").split("."), getattr(command, "LOOP", "")
    key, critic = parts[-1].replace("-", "_"), "critic" in parts[:-1]
    if critic and loop != "ppo" or FOREIGN & set(parts[:-1]) or parts[-2:] == ["rollout", "name"]:
        return ""  # no critic in GRPO; verl's other groups; its rollout engine's name (vllm)
    if "custom-reward-function" in parts[:-1]:
        return f"did you mean {REWARD}?"
    same = sorted(f"--{f}" for f in _flags(command) if f.split(".")[-1] == parts[-1])
    same = [f for f in same if f.endswith(".".join(parts[-2:]))] or same  # verl's model.path: --model.path
    hint = CRITIC.get(key, "") if critic else ""
    hint = hint or " or ".join(same) or ELSEWHERE.get(key, "")
    if isinstance(hint, dict):
        hint = hint.get(loop, "")
    return f"did you mean {hint.format(opt='ppo' if loop == 'ppo' else 'rl')}?" if hint else ""


def fill(instance, data: dict, where: str, lenient: bool = False, skip=frozenset(), path: str = "", command=None,
         unknown: list | None = None):
    """`instance` with the values of `data` (nested dicts), each checked as its flag's parser would; the keys
    the command lacks are refused all at once, each with what to write instead. `lenient`: skip them; `skip`:
    flags never taken from a file; `command`: the whole command's dataclass (default: `instance`'s), where
    the hint for an unknown key looks; `unknown`: the nested calls' share of those keys."""
    command = command or type(instance)
    top = unknown is None  # the outermost call reports every unknown key, nested ones included
    unknown = [] if top else unknown
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
            if not lenient:
                unknown += _instead(key, value, where, command)
            continue
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"--config: {where}{key} must be a mapping")
            fill(current, value, f"{where}{key}.", lenient, skip, f"{path}{name}.", command, unknown)
        else:
            setattr(instance, name, _typed(value, types[name], f"{where}{key}"))
    if top and unknown:
        raise ConfigError(_not_flags(unknown))
    return instance


def _instead(key: str, value, where: str, command) -> list[tuple[str, str]]:
    """(key, what to write instead) for a config key `command` lacks; for a group it lacks (verl's
    actor_rollout_ref), each key inside it, named as minirl names it where it has it."""
    if "." in key:
        return [(where + key, f"keys nest: write {key.split('.')[0]}: {{{key.split('.', 1)[1]}: ...}}")]
    return [(where + name, elsewhere(name, command)) for name in _leaves({key: value})]


def _leaves(data: dict, where: str = ""):
    """The dotted names of a nested mapping's values."""
    for key, value in data.items():
        yield from _leaves(value, f"{where}{key}.") if isinstance(value, dict) and value else [f"{where}{key}"]


def _not_flags(unknown: list[tuple[str, str]], source: str = "--config: ") -> str:
    """The error for keys that are not flags: (key, what to write instead) each."""
    names = " (TRL's and verl's names beside minirl's: docs/flags.md)" if any("?" in why for _, why in unknown) else ""
    if len(unknown) == 1:
        (key, why), = unknown
        return f"{source}{key} is not a flag of this command (see --help)" + (f"; {why}" if why else "") + names
    keys = ", ".join(f"{key} ({why})" if why else key for key, why in unknown)
    return f"{source}{len(unknown)} keys are not flags of this command (see --help): {keys}{names}"


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
    if origin in (list, tuple):  # one item may be written bare, as a flag takes it (`reward: m:f`)
        items = value if isinstance(value, (list, tuple)) else [value]
        return origin(_typed(v, args[0], where) for v in items)
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
    for i, a in enumerate(argv):  # TRL's reward_funcs is a list; tyro would say only "unrecognized"
        flag, eq, value = a.partition("=")
        given = ([value] if eq else []) + argv[i + 1:i + 3]  # the flag's value, then what follows it
        if flag == "--task.reward" and len(given) > 1 and not given[1].startswith("-"):
            raise ConfigError(f"--task.reward takes one function; repeat the flag for each: --task.reward "
                              f"{given[0]} --task.reward {given[1]}")
    # verl's Hydra overrides: key=value, no dashes (a value after a flag is that flag's, whatever it holds)
    hydra = [a.lstrip("+").split("=")[0] for i, a in enumerate(argv) if re.fullmatch(r"\+*[A-Za-z_][\w.]*=.*", a, re.S)
             and not (i and re.fullmatch(r"--[\w.-]+", argv[i - 1]))]
    if hydra:
        raise ConfigError("minirl takes flags (--name value), not Hydra's key=value: "
                          + _not_flags([(key, elsewhere(key, cls)) for key in hydra], ""))
    known = _flags(cls)
    for a in argv:  # a TRL or verl name: say minirl's (tyro would only list every flag)
        unknown = a.startswith("--") and a[2:].split("=")[0].replace("_", "-") not in known
        hint = elsewhere(a, cls) if unknown else ""
        if hint:
            raise ConfigError(_not_flags([(a.split("=")[0], hint)], ""))
    default, data = cls(), {}
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if len(at) > 1:  # tyro would record the last, after the first was read
        raise ConfigError("--config is given more than once; give one file (flags beside it override its values)")
    for i in at:
        path = argv[i].split("=", 1)[1] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else "")
        path = os.path.expanduser(path)  # `--config=~/r.yaml`: the shell leaves a ~ after = as it is
        data = _read(path)
        # this run's own switches, never another's (a config.json reruns a recipe), in either spelling
        default = fill(cls(), data, "", lenient, skip={"config", *PER_RUN})
        default.config = path
    main = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m minirl.grpo`: not the file's path
    prog = f"python -m {main.name}" if main is not None and main.name.startswith("minirl.") else \
        os.path.basename(sys.argv[0])  # a console script's name, not its path
    args = tyro.cli(cls, args=argv, default=default, description=description, prog=prog)
    _home(args)
    # a recipe's own run dir is not dropped without a word: said once, by rank 0 (the rehearsal's child parses again)
    if not lenient and int(os.environ.get("RANK", 0)) == 0 and os.environ.get("MINIRL_REHEARSAL_CHILD") != "1":
        for line in _not_taken(data, args, argv):
            print(f"--config {args.config}: {line}", file=sys.stderr, flush=True)
    return args


def _home(obj) -> None:
    """A value that starts with ~ (`--log.run-dir=~/runs/x`, a config file's `path: ~/models/m`) is under the
    home folder, as TRL's output_dir is: neither the shell (after `=`) nor a file expands it, and a folder
    named `~` in the working directory is one `rm -rf ~` away from the home folder itself."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _home(value)
        elif isinstance(value, str) and value.startswith("~"):
            setattr(obj, f.name, os.path.expanduser(value))
        elif isinstance(value, list):  # --task.reward ~/rewards.py:f
            setattr(obj, f.name, [os.path.expanduser(v) if isinstance(v, str) else v for v in value])


def _not_taken(data: dict, args, argv: list[str]) -> list[str]:
    """What to say of each run's own switch a config file sets to other than this run's, unless the command
    line gives that flag: it is not taken, and the flag that would set it."""
    given = {a.split("=")[0].replace("_", "-").replace(".no-", ".") for a in argv}
    lines = []
    for group, name in (key.split(".") for key in sorted(PER_RUN)):
        section = data.get(group) if isinstance(data.get(group), dict) else {}
        section = {k.replace("-", "_"): v for k, v in section.items()}  # either spelling
        flag = f"--{group}.{name.replace('_', '-')}"
        if name in section and section[name] != getattr(getattr(args, group), name) and flag not in given:
            value = "" if isinstance(section[name], bool) else f" {section[name]}"
            lines.append(f"{group}.{name}={section[name]!r} is not taken from a file (a run's own switches come from "
                         f"the command line only): give {flag}{value} to use it")
    return lines
