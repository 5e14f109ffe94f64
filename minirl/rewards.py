"""Rewards: text in, a float out. Model output is parsed or compared, never executed.

A reward function is `f(completion: str, answer: str) -> float`: the completion as decoded text
(special tokens dropped), the reference answer as the task holds it. `--task.reward module:function`
names one, imported by name when the flags are checked; repeat the flag for several, weighted by
`--task.reward-weights` (default 1 each). With none given, the task's own is used:
- `count`: the built-in task; exactly the count, nothing else.
- `gsm8k`: a JSONL task's default, `--task.answer-format strict`: for a numeric reference exactly verl's
  strict GSM8K score (verl/utils/reward_score/gsm8k.py): in the completion's last 300 characters, the
  last `#### ` followed by digits, `.`, `,` (and a leading `-`), commas dropped, equal to the reference
  as a string. So `#### 42.0` and `####42` score 0, as in verl, and numbers are comparable with its.
- `gsm8k_flexible`: `--task.answer-format flexible`, after verl's flexible mode: the last number anywhere,
  compared as a number (verl compares the string, commas and all).
Both compare a reference that is not a number as text, normalised (case, spaces, end punctuation), after
the last `####` on its line for `gsm8k`.

One rule holds on top of every function: a completion the token cap cut (finish reason "length")
never ended, so it earns 0. Before it, under a reward that read the first number, the built-in
task was won by writing the count and padding every completion to the cap.

`Scorer` applies the functions, their weights and the rule to a batch. It keeps each function's own
values (their means are `reward/<name>` in the metrics), as TRL's `reward_funcs`/`reward_weights` and
verl's `custom_reward_function` do. The first function is the one `eval_accuracy` reports on the
held-out prompts.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Callable

from minirl.config import ConfigError

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_STRICT = re.compile(r"####[ \t]*(\S[^\n]*)")  # a text answer on the marker's own line
_VERL_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's strict pattern, read in the last VERL_TAIL characters
VERL_TAIL = 300


def count(completion: str, answer: str) -> float:
    """The built-in task: the completion is exactly the count (the cap rule makes it end there)."""
    return float(completion == answer)


def gsm8k(completion: str, answer: str) -> float:
    """Strict `#### N`: verl's strict score for a numeric reference; a text one after the last `####`."""
    if is_number(answer):
        found = _VERL_STRICT.findall(completion[-VERL_TAIL:])
        return float(bool(found) and found[-1].replace(",", "").replace("$", "") == answer)
    found = _STRICT.findall(completion)
    return float(bool(found) and normalise(found[-1]) == normalise(answer))


def gsm8k_flexible(completion: str, answer: str) -> float:
    """The last number anywhere in the completion (or, for a text answer, how the completion ends)."""
    if is_number(answer):
        found = _NUM.findall(completion)
        return float(bool(found) and same_number(found[-1], answer))
    return float(bool(normalise(answer)) and normalise(completion).endswith(normalise(answer)))


def is_number(text: str) -> bool:
    return _NUM.fullmatch(text.strip()) is not None


def same_number(a: str, b: str) -> bool:
    try:
        return float(a.replace(",", "").rstrip(".")) == float(b.replace(",", ""))
    except ValueError:
        return False


def normalise(text: str) -> str:
    """Lower case, one space between words, no surrounding punctuation or quotes."""
    return " ".join(text.lower().split()).strip(" .,;:!?\"'`$")


BUILT_IN = {"count": "minirl.rewards:count", "strict": "minirl.rewards:gsm8k",
            "flexible": "minirl.rewards:gsm8k_flexible"}


def load(spec: str) -> Callable[[str, str], float]:
    """The callable that `module:function` names, imported by name; a ConfigError says what is wrong."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"--task.reward={spec!r}: give module:function, e.g. minirl.rewards:gsm8k")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"--task.reward={spec!r}: cannot import {module} ({e}); is it on PYTHONPATH?") from e
    except AttributeError:
        raise ConfigError(f"--task.reward={spec!r}: {module} has no {name}") from None
    if not callable(fn):
        raise ConfigError(f"--task.reward={spec!r} is not a function")
    return fn


class Scorer:
    """The run's reward functions with their weights (`specs`, `weights` as the flags give them)."""

    def __init__(self, specs: list[str], weights: list[float]):
        if weights and len(weights) != len(specs):
            raise ConfigError(f"--task.reward-weights has {len(weights)} value(s) for {len(specs)} reward function(s) "
                              "(--task.reward); give one weight per function")
        if not all(math.isfinite(w) for w in weights):
            raise ConfigError(f"--task.reward-weights={weights} must be finite numbers")
        self.specs, self.weights = specs, weights or [1.0] * len(specs)
        self.fns = [load(s) for s in specs]
        short = [s.partition(":")[2] for s in specs]
        self.names = [n if short.count(n) == 1 else s for n, s in zip(short, specs)]  # reward/<name>

    def __call__(self, texts: list[str], answers: list[str], clipped: list[bool]) -> tuple[list, list[list]]:
        """Rewards of a batch (the weighted sum), and each function's own values ([function][row]);
        a row the cap cut earns 0 from every function."""
        parts = [[0.0 if cut else self._one(spec, fn, t, a) for t, a, cut in zip(texts, answers, clipped)]
                 for spec, fn in zip(self.specs, self.fns)]
        return [sum(w * v for w, v in zip(self.weights, col)) for col in zip(*parts)], parts

    @staticmethod
    def _one(spec: str, fn, text: str, answer: str) -> float:
        try:
            return float(fn(text, answer))
        except Exception as e:
            raise RuntimeError(f"--task.reward {spec} failed on the completion {text[:200]!r}: "
                               f"{type(e).__name__}: {e}") from e


def scorer(cfg) -> Scorer:
    """The Scorer of the --task.* flags: --task.reward, or the task's built-in."""
    specs = cfg.reward or [BUILT_IN["count" if cfg.name == "count" else cfg.answer_format]]
    return Scorer(specs, cfg.reward_weights)
