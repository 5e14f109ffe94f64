"""The command line of every entrypoint: flags (with `--config FILE`) in, an exit code out.

- `parse(cls, argv, description)`: tyro's flags for the dataclass `cls`. `--config FILE` (YAML or
  JSON, nested like the flags: `{"rl": {"lr": 1e-5}}`) gives the defaults and the flags beside it
  win, so a run's own config.json reruns that run and `--config run/config.json --steps 800`
  continues the same recipe for longer. A key the dataclass does not have is an error naming it.
- `run(name, main, argv)`: the console scripts (`minirl-grpo`, ...) and `python -m` both go
  through it: exit 0 on success; 2 with one line on a bad flag, file or checkpoint; 3 with one
  line when a run stopped because it could no longer learn; 4 with one line when a rank lost a peer
  (another rank, its node, or the run's store; `dist.lost_peer`); and the process group is torn down
  before the process leaves (without the interpreter's teardown, see `run`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import tyro

from minirl.config import ConfigError


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config={path!r} is not a file")
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            data = yaml.safe_load(text)  # plain data only: never constructs objects
        else:
            data = json.loads(text)
    except Exception as e:
        raise ConfigError(f"--config={path!r}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config={path!r}: expected a mapping of flags, got a {type(data).__name__}")
    return data


def _fill(instance, data: dict, where: str, lenient: bool = False):
    """`instance` with the values of `data` (nested dicts for nested dataclasses). `lenient`: skip
    what this command does not have (another command's run config), instead of refusing it."""
    fields = {f.name: f for f in dataclasses.fields(instance)}
    for key, value in data.items():
        name = key.replace("-", "_")
        current = getattr(instance, name, None)
        if name not in fields or (lenient and isinstance(value, dict) != dataclasses.is_dataclass(current)):
            if lenient:
                continue
            raise ConfigError(f"--config: {where}{key} is not a flag of this command (see --help)")
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"--config: {where}{key} must be a mapping")
            _fill(current, value, f"{where}{key}.", lenient)
        else:
            setattr(instance, name, value)
    return instance


def parse(cls, argv: list[str] | None, description: str, lenient: bool = False):
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, why in getattr(cls, "REFUSED", {}).items():  # flags the command has retired or never had
        if any(a.startswith(flag) for a in argv):
            raise ConfigError(why)
    default = cls()
    for i, a in enumerate(argv):
        if a == "--config" or a.startswith("--config="):
            path = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            data = {k: v for k, v in _read(path).items() if k != "config"}
            default = _fill(cls(), data, "", lenient)
            default.config = path
            break
    return tyro.cli(cls, args=argv, default=default, description=description)


def run(name: str, main, argv: list[str] | None = None) -> None:
    """Run `main(argv)` as a command: exit codes and one-line errors (the module docstring)."""
    from minirl import checkpoint, dist
    from minirl.accumulator import StalledError
    code = 0
    try:
        main(argv)
    except (ConfigError, checkpoint.CheckpointError) as e:  # bad flag, file or checkpoint: say which, no traceback
        print(f"{name}: error: {e}", file=sys.stderr)
        code = 2
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
    # Everything minirl writes is closed by now (metrics, checkpoints, the engine). Leave without the
    # interpreter's teardown: C++ threads of the libraries underneath can abort there (seen once in
    # about ten 3-rank PPO runs: "terminate called without an active exception" on a train rank after
    # a complete run), which would turn a finished run into a failed one.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
