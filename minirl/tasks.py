"""Prompt sets, deterministic prompt ids, and rewards that only parse text.

- `CountTask` (built in): "how many a's in this string?" e.g. prompt `abbab#a=`, answer `2`.
  Problems are a pure function of (seed, index); the held-out set is disjoint from training
  by construction (a string is held out iff its hash says so), so eval accuracy is honest.
- `JsonlTask`: {"prompt": ..., "answer": ...} per line; GSM8K answers (`... #### 42`) are cut
  to the number after `####`.
- Rewards: 1.0 when the answer number extracted from the completion equals the reference,
  else 0.0. A completion is parsed with a regex, never executed.
- Prompt ids (B14): `prompt_id(shard, index)` is
  deterministic, monotonic in the index, and scoped by shard so replicas never collide. The
  data-parallel partition sorts rows by (group_id, id) and deals contiguous whole groups.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass

from minirl.config import ConfigError, TaskConfig

SHARD_BITS = 40  # up to 2**40 prompts per shard


def prompt_id(shard: int, index: int) -> int:
    """Deterministic, shard-scoped, monotonic prompt id (the group id of its G samples)."""
    assert 0 <= index < 2**SHARD_BITS
    return (shard << SHARD_BITS) | index


def dp_partition(keys: list[tuple[int, int]], rank: int, dp: int) -> list[int]:
    """Indices of rank's rows: sort by (group_id, id), deal contiguous equal slices.

    `keys[i] = (group_id, id)`. Callers size batches in whole groups per rank (config.validate),
    so a slice boundary never splits a group.
    """
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    per = len(order) // dp
    assert per * dp == len(order), f"{len(order)} rows do not split over {dp} ranks"
    return order[rank * per:(rank + 1) * per]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_number(text: str, last: bool = False) -> str | None:
    """The first (or last) number in `text`, commas removed; None if there is none."""
    found = _NUM.findall(text)
    if not found:
        return None
    return found[-1 if last else 0].replace(",", "").rstrip(".")


def _same_number(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


class CountTask:
    """Count one letter in a short string over {a, b}: learnable by a tiny model in minutes."""

    letters = "ab"
    max_len = 9

    def __init__(self, seed: int, eval_prompts: int):
        self.seed = seed
        self.eval_set = self._draw(seed=-1 - seed, n=eval_prompts, held_out=True)

    @staticmethod
    def _held_out(s: str) -> bool:
        return hashlib.blake2b(s.encode(), digest_size=2).digest()[0] % 8 == 0

    def _problem(self, rng: random.Random) -> Problem:
        s = "".join(rng.choice(self.letters) for _ in range(rng.randint(1, self.max_len)))
        return Problem(f"{s}#a=", str(s.count("a")))

    def _draw(self, seed: int, n: int, held_out: bool, start: int = 0) -> list[Problem]:
        out, i = [], start
        while len(out) < n:
            p = self._problem(random.Random(f"{seed}:{i}"))
            i += 1
            if self._held_out(p.prompt[:-3]) == held_out:
                out.append(p)
        return out

    def train_problem(self, index: int) -> Problem:
        """Training problem `index`: a pure function of (seed, index), never a held-out string."""
        j = 0
        while True:
            p = self._problem(random.Random(f"{self.seed}:{index}:{j}"))
            if not self._held_out(p.prompt[:-3]):
                return p
            j += 1

    def reward(self, completion: str, answer: str) -> float:
        return float(_same_number(extract_number(completion), answer))


class JsonlTask:
    """Prompts and reference answers from a JSONL file; GSM8K-style answer extraction.

    Every line is checked when the task loads, before any model is built: a JSON object whose
    "prompt" and "answer" are strings (not null, a number, an object or a list), and, given the
    tokenizer, a prompt within --rollout.max-prompt-tokens. A bad line is a ConfigError naming
    file:line and the flag."""

    def __init__(self, path: str, seed: int, eval_prompts: int, eval_path: str = "", tok=None, limit: int = 0):
        rows = self._read(path, "--task.path", tok, limit)
        random.Random(seed).shuffle(rows)
        if eval_path:  # a separate held-out file (e.g. GSM8K test): its first eval_prompts rows
            self.eval_set, self.rows = self._read(eval_path, "--task.eval-path", tok, limit)[:eval_prompts], rows
        else:
            k = min(eval_prompts, len(rows) // 5)
            self.eval_set, self.rows = rows[:k], rows[k:]
        if not self.rows:
            raise ConfigError(f"--task.path={path!r}: no training prompts")

    @classmethod
    def _read(cls, path: str, flag: str, tok, limit: int) -> list[Problem]:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{flag}={path!r}: not UTF-8 text ({e.reason} at byte {e.start}); convert it, "
                              "e.g. iconv -t utf-8") from e
        rows = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{flag}: {path}:{n}"
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not JSON ({e})") from e
            if not isinstance(r, dict):
                raise ConfigError(f"{where}: expected an object {{\"prompt\": ..., \"answer\": ...}}, got a "
                                  f"{type(r).__name__}")
            for key in ("prompt", "answer"):
                if not isinstance(r.get(key), str):
                    got = "missing" if key not in r else f"a {type(r[key]).__name__}"
                    raise ConfigError(f"{where}: \"{key}\" must be a string, got {got}")
            if tok is not None and limit and len(tok(r["prompt"], add_special_tokens=False).input_ids) > limit:
                raise ConfigError(f"{where}: the prompt has more than --rollout.max-prompt-tokens={limit} tokens; "
                                  "raise the flag or shorten the prompt")
            rows.append(Problem(r["prompt"], cls._reference(r["answer"])))
        return rows

    @staticmethod
    def _reference(answer: str) -> str:
        return answer.split("####")[-1].strip().replace(",", "")

    def train_problem(self, index: int) -> Problem:
        return self.rows[index % len(self.rows)]

    def reward(self, completion: str, answer: str) -> float:
        text = completion.split("####")[-1] if "####" in completion else completion
        return float(_same_number(extract_number(text, last=True), answer))


def warm_start(model, tok, steps: int, lr: float = 1e-3, batch: int = 32) -> None:
    """A deliberately SHORT supervised start on CountTask (teacher-forced answer + EOS).

    From random init the count task's reward is too sparse for RL on 2 cores (accuracy stayed near 0.01 for 10 minutes);
    a few supervised steps teach the answer format and stop far below what supervision alone
    would reach, so the RL phase has real work left (the built-in model's role is that of an
    instruct model that is mediocre at the task).
    """
    import torch

    task = CountTask(seed=12345, eval_prompts=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        probs = [task.train_problem(step * batch + i) for i in range(batch)]
        rows = [(tok(p.prompt, add_special_tokens=False).input_ids,
                 tok(p.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]) for p in probs]
        T = max(len(q) + len(a) for q, a in rows)
        ids = torch.full((batch, T), tok.pad_token_id)
        labels = torch.full((batch, T), -100)
        for i, (q, a) in enumerate(rows):
            ids[i, :len(q) + len(a)] = torch.tensor(q + a)
            labels[i, len(q):len(q) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def encode_prompt(tok, text: str, limit: int) -> list[int]:
    """Token ids of a prompt; a prompt over the engine's prompt budget is an error, never cut."""
    ids = tok(text, add_special_tokens=False).input_ids
    if len(ids) > limit:
        raise ValueError(f"a prompt has {len(ids)} tokens, over --rollout.max-prompt-tokens={limit}")
    return ids


def held_out_accuracy(engine, task, tok, limit: int, rank: int = 0, world: int = 1) -> float:
    """Greedy accuracy on the held-out prompts. With world > 1 every rank of the default group
    scores its slice and the counts are summed over ranks (a collective)."""
    import torch

    from minirl import dist

    share = task.eval_set[rank::world]
    hits = 0.0
    if share:
        prompts = [encode_prompt(tok, p.prompt, limit) for p in share]
        out = engine.generate(prompts, list(range(len(share))), 1, greedy=True)
        texts = tok.batch_decode(out.completion_tokens, skip_special_tokens=True)
        hits = sum(task.reward(t, p.answer) for t, p in zip(texts, share))
    tot = torch.tensor([float(hits), float(len(share))])
    if world > 1:
        dist.all_reduce(tot)
    return (tot[0] / tot[1].clamp_min(1)).item()


def make_task(cfg: TaskConfig, seed: int, tok=None, limit: int = 0, evaluates: bool = False):
    """The task, every prompt checked against the prompt budget `limit` when `tok` is given.
    `evaluates` (--log.eval-every > 0): a held-out set must exist, or no eval_accuracy could mean anything."""
    if cfg.name == "count":
        if limit and limit < CountTask.max_len + 3:
            raise ConfigError(f"--rollout.max-prompt-tokens={limit}: the built-in task's prompts take up to "
                              f"{CountTask.max_len + 3} tokens")
        task = CountTask(seed, cfg.eval_prompts)
    else:
        task = JsonlTask(cfg.path, seed, cfg.eval_prompts, cfg.eval_path, tok, limit)
    if evaluates and not task.eval_set:
        why = ("--task.eval-prompts is 0" if not cfg.eval_prompts else
               f"--task.path={cfg.path!r} has too few prompts to hold one in five out" if cfg.name == "jsonl" else "")
        raise ConfigError(f"no held-out prompts to score ({why}): give --task.eval-path, raise --task.eval-prompts, "
                          "or turn evaluation off with --log.eval-every 0")
    return task
