"""Rewards: text in, a float out. Model output is parsed or compared, never executed.

`--task.reward` names functions (`module:function`, `pkg.module.function`, `path/file.py:function`),
weighted by `--task.reward-weights`. Each is imported and called once on the first training row when
the flags are checked, before any model is built; its form is read once from its parameters (`kind`):
minirl's `f(completion, answer) -> float`, TRL's batched `f(completions, **columns) -> list[float |
None]` (or `completion_ids`, `prompts`), or verl's `compute_score(data_source, solution_str,
ground_truth, extra_info)` or its batched form (`solution_strs`, ...); TRL's and verl's may be `async def`.
The defaults:
`count` (the built-in task), `gsm8k` (verl's strict GSM8K score for a numeric reference) and
`gsm8k_flexible` (the last number anywhere).

`Scorer` applies them to a batch, keeping each function's values (`reward/<name>`) and the numbers it
logs beside them (`reward/<name>/<number>`: TRL's log_metric and log_extra, a verl dict's keys beside
"score"); a TRL function also gets `trainer_state` (transformers' TrainerState: `global_step` the loop
step, `max_steps` --steps), as a curriculum reads it. One rule on top: a completion cut at the token cap
gains nothing from any function (otherwise padding to the cap after the answer wins the built-in task),
and keeps its penalties (a negative length penalty must not turn into 0 for running to the cap). A
function that raises, exits, returns a non-finite number (a TRL function's NaN is its None) or outlives
`--task.reward-timeout` ends the run with one line naming it (`RewardError`); a silent one is reported
after a minute, and a run whose first 10 batches earn 0 on every row is warned about (`Scorer.watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import math
import os
import pkgutil
import re
import signal
import sys
import threading
import time
from typing import Callable

from minirl.config import ConfigError, hub_name

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
    """Two numbers `_NUM` matched (each a float once its thousands commas go) hold the same value."""
    return float(a.replace(",", "")) == float(b.replace(",", ""))


def normalise(text: str) -> str:
    """Lower case, one space between words, no surrounding punctuation or quotes."""
    return " ".join(text.lower().split()).strip(" .,;:!?\"'`$")


BUILT_IN = {"count": "minirl.rewards:count", "strict": "minirl.rewards:gsm8k",
            "flexible": "minirl.rewards:gsm8k_flexible"}

FORMS = {  # how each kind of reward function is called, as the errors describe it
    "minirl": "f(completion: str, answer: str) -> float",
    "trl": "TRL's f(completions, prompts=..., completion_ids=..., trainer_state=..., log_metric=..., log_extra=..., "
           "**columns) -> list[float | None]",
    "verl": "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float or "
            "{'score': float, ...}",
    "verl_batch": "verl's batched compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> a list "
                  "of floats or {'score': float, ...}"}


class RewardError(RuntimeError):
    """A reward function failed or returned what is not a reward: (its spec, what it was given, why)."""

    code = 1  # the run's exit code (launch.run)

    def __str__(self) -> str:
        spec, on, why = self.args
        return f"--task.reward {spec} failed on {on}: {why}"


class RewardTimeout(RewardError):
    """A reward function that did not return within --task.reward-timeout: a setting to change, exit 2."""

    code = 2


class _Late(BaseException):
    """Raised into a reward function at --task.reward-timeout (not an Exception: its `except Exception` lets
    it through)."""


WARN_S = 60.0  # a reward function that has not returned for this long gets a line naming it
GRACE_S = 10.0  # how long one may go on catching the timeout's stops before the process exits
LATE = signal.SIGRTMIN  # what ends one at --task.reward-timeout: a signal no library or scheduler sends


def load(spec: str) -> Callable:
    """The callable `spec` names (`module:function`, `pkg.module.function`, `path/file.py:function`),
    imported with the working directory on the path; a ConfigError says what is wrong."""
    module, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    # TRL also takes a reward model by its hub name
    if ":" not in spec and not spec.endswith(".py") and hub_name(spec):
        raise ConfigError(f"--task.reward={spec!r} names a model, not a function: minirl runs reward functions; "
                          "score with the model inside a function of your own (module:function)")
    if not module or not name or spec.endswith(".py"):
        raise ConfigError(f"--task.reward={spec!r}: give module:function, e.g. minirl.rewards:gsm8k (or "
                          "pkg.module.function, or path/to/file.py:function)")
    if os.getcwd() not in sys.path:  # console scripts do not put it there; `python -m` does
        sys.path.insert(0, os.getcwd())
    as_name = _file_module(module) if module.endswith(".py") else module
    try:
        if as_name not in sys.modules and module.endswith(".py"):  # a file: imported once, as `import` would
            found = importlib.util.spec_from_file_location(as_name, module)
            sys.modules[as_name] = importlib.util.module_from_spec(found)  # first: dataclasses look it up there
            try:
                found.loader.exec_module(sys.modules[as_name])
            except BaseException:
                del sys.modules[as_name]
                raise
        importlib.import_module(as_name)
    except (ImportError, FileNotFoundError) as e:
        raise ConfigError(f"--task.reward={spec!r}: cannot import {module} ({e}); is it on PYTHONPATH?") from e
    except (Exception, SystemExit) as e:  # a syntax error, or the module raised while it was imported
        raise ConfigError(f"--task.reward={spec!r}: importing {module} failed: {type(e).__name__}: {e}") from e
    try:
        fn = pkgutil.resolve_name(f"{as_name}:{name}")
    except AttributeError:
        raise ConfigError(f"--task.reward={spec!r}: {module} has no {name}") from None
    if not callable(fn):
        raise ConfigError(f"--task.reward={spec!r} is not a function")
    return fn


def _file_module(path: str) -> str:
    """The name a reward file is imported by: its own, its folder put last on the path, so that a process
    pool's spawned workers (forkserver is Python 3.14's default), which import what they run by name, find it;
    a name of minirl's where its own is another module's (`json.py`, a second `score.py`)."""
    path = os.path.abspath(path)
    folder, name = os.path.dirname(path), os.path.basename(path)[:-3]
    if folder not in sys.path:
        sys.path.append(folder)
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # not a module name (`my-reward`), or a module without a spec
        found = None
    return name if found is not None and found.origin == path else f"minirl_reward_{abs(hash(path))}"


def kind(fn: Callable) -> str:
    """Which way a reward function is called, decided once from its parameters' names: verl's
    compute_score (`solution_str`), TRL's batched form (any of the names TRL passes every function:
    `completions`, `completion_ids`, `prompts`; TRL's length rewards read only `completion_ids`), or
    minirl's, by position (as verl calls its own scorers of a data source, which name the completion
    otherwise: geo3k.py's `predict_str`, math_verify.py's `model_output`)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: called as minirl's
        return "minirl"
    if "solution_strs" in params:  # verl's `batch` reward manager's
        return "verl_batch"
    trl = any(name in params for name in ("completions", "completion_ids", "prompts"))
    return "verl" if "solution_str" in params else "trl" if trl else "minirl"


class Scorer:
    """The run's reward functions with their weights (`specs`, `weights` as the flags give them)."""

    def __init__(self, specs: list[str], weights: list[float], timeout: float = 0.0, steps: int = 0,
                 prompt_key: str = "prompt"):
        if weights and len(weights) != len(specs):
            raise ConfigError(f"--task.reward-weights has {len(weights)} value(s) for {len(specs)} reward function(s) "
                              "(--task.reward); give one weight per function")
        if not all(math.isfinite(w) for w in weights):
            raise ConfigError(f"--task.reward-weights={weights} must be finite numbers")
        self.specs, self.weights = specs, weights or [1.0] * len(specs)
        self.fns = [load(s) for s in specs]
        self.kinds = [kind(fn) for fn in self.fns]
        short = [s.replace(":", ".").rpartition(".")[2] for s in specs]
        self.names = [n if short.count(n) == 1 else s for n, s in zip(short, specs)]  # reward/<name>
        # The numbers a function logs beside its reward (TRL's log_metric and log_extra, verl's dict beside
        # "score"), as (function, name): those of the first call (the check's), so every rank has the same.
        self.logs: list[tuple[int, str]] | None = None
        self.say, self.zero_batches = print, 0  # the run's console (run.Run sets it); all-zero batches so far
        self.told_unscored = self.told_late = False  # a row no function scored, a number logged late, was said
        self.timeout = timeout  # --task.reward-timeout: seconds a call may take (0: no limit)
        self.steps = steps  # --steps: TRL's trainer_state.max_steps
        self.prompt_key = prompt_key  # --task.prompt-key: the column a TRL function gets as `prompts`

    def __call__(self, texts: list[str], answers: list[str], clipped: list[bool], rows: list | None = None,
                 completion_ids: list | None = None, step: int = 0) -> tuple[list, list[list]]:
        """Rewards of a batch sampled at loop `step` (the weighted sum) and each function's own values
        ([function][row]), then the numbers of `logs` (NaN in a row without one); a row the cap cut gains nothing
        (a term that would pay is 0, a penalty stays). A TRL function's None is NaN in its values and adds nothing
        to the sum."""
        rows = rows or [{} for _ in texts]
        parts, logged = [], []
        for i, w in enumerate(self.weights):
            values, numbers = self._values(i, texts, answers, rows, completion_ids, step)
            parts.append([0.0 if cut and w * v > 0 else v for v, cut in zip(values, clipped)])
            logged.append(numbers)
        if self.logs is None:
            self.logs = [(i, name) for i, numbers in enumerate(logged) for name in sorted(numbers)]
            self.names += [f"{self.names[i]}/{name}" for i, name in self.logs]  # reward/<function>/<name>
        late = [f"{self.specs[i]} {name!r}" for i, numbers in enumerate(logged) for name in numbers
                if (i, name) not in self.logs]
        if late and not self.told_late:
            self.say(f"warning: {', '.join(late)} not plotted: a function's numbers are those its first call logs")
            self.told_late = True
        rewards = [sum(w * v for w, v in zip(self.weights, col) if v == v) for col in zip(*parts)]
        return rewards, parts + [logged[i].get(name, [math.nan] * len(texts)) for i, name in self.logs]

    def _values(self, i: int, texts, answers, rows, completion_ids, step: int) -> tuple[list[float], dict]:
        """Function `i`'s values of the batch, and the numbers it logged beside them (name -> value by row)."""
        fn, form = self.fns[i], self.kinds[i]
        on = [f"the completion {texts[0][:200]!r}" + (" (the first of the batch)" if len(texts) > 1 else "")]
        logged, metrics = {}, {}

        def log(name: str, row: int, value) -> None:  # a number by row (a bool is 1 or 0); text is not plotted
            if hasattr(value, "__float__") and math.isfinite(float(value)):
                logged.setdefault(name, [math.nan] * len(texts))[row] = float(value)
        try:
            with self._watched(i, on):
                if form == "trl":
                    prompts, completions = _trl_inputs(rows, texts, self.prompt_key)
                    columns = {k: [r.get(k) for r in rows] for r in rows[:1] for k in r  # all but, as TRL:
                               if k not in ("prompt", "completion", "completion_ids")}
                    from transformers import TrainerState  # 2 s to import: only for a TRL function
                    got = _call(fn, prompts=prompts, completions=completions, completion_ids=completion_ids,
                                trainer_state=TrainerState(global_step=step, max_steps=self.steps), **columns,
                                log_metric=lambda name, value: metrics.setdefault(name, []).append(value),
                                log_extra=lambda name, values: [log(name, r, v) for r, v in enumerate(values)])
                    for name, values in metrics.items():  # TRL's log_metric: a number per call, the calls' mean
                        mean = sum(values) / len(values)
                        for r in range(len(texts)):
                            log(name, r, mean)
                    return [math.nan if v is None else _reward(v, nan_is_none=True)
                            for v in _listed(got, len(texts))], logged
                if form == "verl_batch":
                    batch = _listed(_call(fn, data_sources=[r.get("data_source") for r in rows], solution_strs=texts,
                                          ground_truths=answers, extra_infos=[r.get("extra_info") for r in rows]),
                                    len(texts))
                out = []
                for t, a, r in zip(texts, answers, rows):  # one row at a time: `on` names the one being scored
                    if form == "verl_batch":
                        got = batch[len(out)]
                    else:
                        on[0] = f"the completion {t[:200]!r}"
                        got = _call(fn, data_source=r.get("data_source"), solution_str=t, ground_truth=a,
                                    extra_info=r.get("extra_info")) if form == "verl" else fn(t, a)
                    for name, value in got.items() if isinstance(got, dict) else ():
                        if name != "score":
                            log(name, len(out), value)
                    out.append(_reward(got))
                return out, logged
        except _Late:
            raise RewardTimeout(self.specs[i], on[0], f"no return within --task.reward-timeout={self.timeout:g} s; "
                                "give it a timeout of its own, or raise the flag") from None
        except (Exception, SystemExit) as e:  # a library's exit() too: the run must not end as if it had finished
            raise RewardError(self.specs[i], on[0], f"{type(e).__name__}: {e}; it is called as {FORMS[form]}") from e

    @contextlib.contextmanager
    def _watched(self, i: int, on: list[str]):
        """While function `i` runs, a thread keeps the time: a line after WARN_S (or half the timeout), then
        `_Late` at the timeout, raised in the function by a signal of minirl's own (LATE), which also breaks a
        blocking sleep or read (again until it returns; one that catches them all for GRACE_S more ends the
        process, exit 2). Not SIGALRM: reward libraries set and cancel that alarm themselves (math_verify's
        parse timeout, under TRL's accuracy_reward, ends with alarm(0)). Python handles signals in the main
        thread only."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        done, main, ended = threading.Event(), threading.get_ident(), []

        def keep_time():
            started, wait = time.monotonic(), min(WARN_S, self.timeout / 2) if self.timeout else WARN_S
            while not done.wait(wait):
                waited = time.monotonic() - started
                if self.timeout and waited >= self.timeout * 0.999:
                    until = time.monotonic() + GRACE_S
                    while not done.is_set():  # again until it ends: a function may catch one BaseException
                        if time.monotonic() > until:  # it catches every one: the run can neither go on nor hang
                            error = RewardTimeout(self.specs[i], on[0], f"no return within --task.reward-timeout="
                                                  f"{self.timeout:g} s, nor in {GRACE_S:g} s of stops it caught")
                            print(f"minirl: error: {error}; the process exits", file=sys.stderr, flush=True)
                            os._exit(error.code)
                        signal.pthread_kill(main, LATE)
                        done.wait(0.1)
                    return
                self.say(f"warning: --task.reward {self.specs[i]} has not returned for {waited:.0f} s, on {on[0]}"
                         + ("" if self.timeout else "; --task.reward-timeout S ends the run after S seconds"))
                wait = min(WARN_S, self.timeout - waited) if self.timeout else WARN_S

        def late(signum, frame):  # raised in the function's own code: never in minirl's, nor once it ended
            ours = (Scorer._values.__code__, Scorer._watched.__wrapped__.__code__, _call.__code__)
            if not ended and frame.f_code not in ours and frame.f_code.co_filename != contextlib.__file__:
                raise _Late()

        before = signal.signal(LATE, late)
        clock = threading.Thread(target=keep_time, daemon=True)
        clock.start()
        try:
            yield
        finally:
            ended.append(True)  # first: a stop that lands from here on is ignored
            done.set()
            clock.join()  # no signal is sent after this
            signal.signal(LATE, signal.SIG_DFL if before is None else before)  # None: set outside Python

    def check(self, problem) -> None:
        """Call every function once on `problem` with an empty completion (before any model is built): one
        that cannot be called that way, or returns what is not a reward, is a ConfigError naming it."""
        try:
            self([""], [problem.answer], [False], [problem.row], [[]])
        except RewardError as e:
            spec, _, why = e.args
            raise ConfigError(f"--task.reward {spec} failed on an empty completion and the first training row: {why}"
                              ) from None

    def watch(self, rewards: list[float], texts: list[str], answers: list[str], clipped: list[bool],
              parts: list[list]) -> None:
        """Say once if every reward of the first 10 training batches was 0: a function that never pays
        (a wrong signature, a format the model does not write) or completions the cap cuts (each earns nothing)
        look like a run that does not learn. And once the first row that no function scored (each said None),
        as TRL warns: its reward is 0, as if it had failed."""
        unscored = next((i for i, col in enumerate(zip(*parts[:len(self.fns)])) if all(v != v for v in col)), None)
        if unscored is not None and not self.told_unscored:
            self.say(f"warning: every --task.reward returned None for {texts[unscored][:200]!r} (answer "
                     f"{answers[unscored]!r}); a row no function scores has reward 0, as in TRL")
            self.told_unscored = True
        if self.zero_batches < 0:
            return
        self.zero_batches = -1 if any(rewards) else self.zero_batches + 1
        if self.zero_batches == 10:
            why = (f"{sum(clipped)} of this batch's {len(clipped)} completions were cut at --rollout.max-tokens, "
                   "and a cut one earns nothing: raise the flag" if sum(clipped) * 2 > len(clipped) else
                   "Check the function and the format")
            self.say(f"warning: every reward of the first 10 steps' batches was 0 ({', '.join(self.specs)}); e.g. "
                     f"{texts[0][:200]!r} against the answer {answers[0]!r}. {why}")
            self.zero_batches = -1


def _call(fn, **kwargs):
    """fn with the keywords it takes (all of them to a **kwargs); an `async def` one run to its result, as
    TRL runs one (a judge that awaits a server)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    out = fn(**kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _listed(got, n: int) -> list:
    """A batched function's values: any sequence TRL iterates (a list, a tuple, a NumPy array, a tensor, a
    generator), of one value per row."""
    values = list(got) if hasattr(got, "__iter__") and not isinstance(got, (str, bytes, dict)) else []
    if len(values) != n:
        raise TypeError(f"returned {_shown(got)}, not a list of {n} floats")
    return values


def _trl_inputs(rows: list[dict], texts: list[str], key: str) -> tuple[list, list]:
    """`prompts` (column `key`'s) and `completions` as TRL's GRPO gives them: a chat row's completion is one
    assistant message, and a prefill (the prompt's last message the assistant's, which is continued) opens the
    completion and leaves the prompt, as TRL gave them when it continued one."""
    prompts, completions = [], []
    for row, text in zip(rows, texts):
        prompt = row.get(key)
        if not isinstance(prompt, list):
            prompts.append(prompt)
            completions.append(text)
            continue
        prefill = prompt[-1]["content"] if prompt[-1].get("role") == "assistant" else None
        if isinstance(prefill, list):  # OpenAI's text parts, joined by newlines as vLLM joins a message's
            prefill = "\n".join(part["text"] for part in prefill)
        prompts.append(prompt if prefill is None else prompt[:-1])
        completions.append([{"role": "assistant", "content": (prefill or "") + text}])
    return prompts, completions


def _reward(value, nan_is_none: bool = False) -> float:
    """A finite float from what a reward function returned (verl's dict: its "score"); `nan_is_none`: a NaN
    stays NaN (TRL turns a None into NaN and adds neither, so a TRL function's NaN is its None)."""
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if callable(value):  # TRL's get_soft_overlong_punishment(...) and its other factories make the function
        raise TypeError(f"returned a function ({_shown(value)}): name a function it makes, e.g. "
                        "`overlong = get_soft_overlong_punishment(...)` in a file of your own, as file.py:overlong")
    if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):  # a bool is a number: 1 or 0
        raise TypeError(f"returned {_shown(value)}, not a number")
    if not math.isfinite(float(value)) and not (nan_is_none and math.isnan(float(value))):
        raise ValueError(f"returned {value}, not a finite number")
    return float(value)


def _shown(value) -> str:
    return f"{type(value).__name__} {str(value)[:60]!r}"


def scorer(cfg, steps: int = 0) -> Scorer:
    """The Scorer of the --task.* flags (--task.reward, or the task's built-in) for a run of `steps`."""
    specs = cfg.reward or [BUILT_IN["count" if cfg.name == "count" else cfg.answer_format]]
    return Scorer(specs, cfg.reward_weights, cfg.reward_timeout, steps, cfg.prompt_key)
