"""Prompt sets, deterministic prompt ids, and held-out scoring.

- `CountTask` (built in): "how many a's?" e.g. `abbab#a=` -> `2`; problems are a pure function of
  (seed, index), and a string is held out iff its hash says so, so eval accuracy is honest.
- `JsonlTask`: JSONL, Parquet or Arrow rows as TRL and verl users have them, from a file or from every file a
  pattern matches in name order (a hub dataset's shards); text or chat prompts under `prompt` or a named
  key, the answer under `answer`, `solution` or a named key, GSM8K's `#### 42` cut to the number.
- `make_task` gives every task its `scorer` (rewards.py); `held_out` scores greedy completions with it.
- `warm_start`: the built-in task's tiny model (models.build_tiny) taught the answer's format and a rough count.
- Prompt ids (B14): `prompt_id(shard, index)` is deterministic, monotonic and scoped by shard; the
  data-parallel partition deals contiguous whole groups sorted by (group_id, id).
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import random
import zlib
from dataclasses import dataclass, field

import jinja2
import torch

from minirl import dist, rewards
from minirl.config import ConfigError, TaskConfig, data_files, first_line

SHARD_BITS = 40  # up to 2**40 prompts per shard


def prompt_id(shard: int, index: int) -> int:
    """Deterministic, shard-scoped, monotonic prompt id (the group id of its G samples)."""
    assert 0 <= index < 2**SHARD_BITS
    return (shard << SHARD_BITS) | index


def dp_partition(keys: list[tuple[int, int]], rank: int, dp: int) -> list[int]:
    """Indices of rank's rows: sorted by `keys[i] = (group_id, id)`, in contiguous equal slices (whole
    groups: config.validate sizes batches so)."""
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    per = len(order) // dp
    assert per * dp == len(order), f"{len(order)} rows do not split over {dp} ranks"
    return order[rank * per:(rank + 1) * per]


@dataclass(frozen=True)
class Problem:
    prompt: str                                            # the text the engine is given (chat template applied)
    answer: str | list | dict                              # the reference, as the reward functions get it
    row: dict = field(default_factory=dict, compare=False)  # the data row, every column (rewards ask for them)


class CountTask:
    """Count one letter in a short string over {a, b}: learnable by a tiny model in minutes."""

    letters = "ab"
    max_len = 9

    def __init__(self, seed: int, eval_prompts: int):
        self.seed = seed
        self.eval_set = self._held_out_set(seed=-1 - seed, n=eval_prompts)

    @staticmethod
    def _held_out(s: str) -> bool:
        return hashlib.blake2b(s.encode(), digest_size=2).digest()[0] % 8 == 0

    def _problem(self, rng: random.Random) -> Problem:
        s = "".join(rng.choice(self.letters) for _ in range(rng.randint(1, self.max_len)))
        prompt, answer = f"{s}#a=", str(s.count("a"))
        return Problem(prompt, answer, {"prompt": prompt, "answer": answer})  # its columns, as a data row's

    def _held_out_set(self, seed: int, n: int) -> list[Problem]:
        out, i = [], 0
        while len(out) < n:
            p = self._problem(random.Random(f"{seed}:{i}"))
            i += 1
            if self._held_out(p.prompt[:-3]):
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


class JsonlTask:
    """Prompts and references from a JSONL or Parquet file, every row checked at load (a bad row is a
    ConfigError naming file:line and the flag). A prompt (the column --task.prompt-key names) is text or chat
    messages (through the chat template, as verl's dataset does); the answer is the first of --task.answer-key
    (dotted: nested), "answer", "solution", "reward_model.ground_truth", and may be missing when `needs_answer`
    is False (TRL's functions read their own columns). A list or an object (Search-R1's {"target": [...]}) is
    kept as it is for functions that read it, unless `text_answer` (a built-in reward compares text). Every row
    keeps its columns for the rewards."""

    ANSWER_KEYS = ("answer", "solution", "reward_model.ground_truth")

    def __init__(self, path: str, seed: int, eval_prompts: int, eval_path: str = "", tok=None, limit: int = 0,
                 answer_key: str = "", needs_answer: bool = True, template_kwargs: dict | None = None,
                 prompt_key: str = "prompt", filter_overlong: bool = False, text_answer: bool = True):
        keys = (answer_key,) if answer_key else self.ANSWER_KEYS
        self.tok, self.template_kwargs = tok, template_kwargs or {}  # the chat template's variables
        self.prompt_key, self.seed, self._orders, self.filter_overlong = prompt_key, seed, {}, filter_overlong
        rows = self._read(path, "--task.path", limit, keys, needs_answer, text_answer)
        random.Random(seed).shuffle(rows)
        if eval_path:  # a separate held-out file (e.g. GSM8K test): its first eval_prompts rows
            self.eval_set = self._read(eval_path, "--task.eval-path", limit, keys, needs_answer,
                                       text_answer)[:eval_prompts]
            self.rows = rows
        else:
            k = min(eval_prompts, len(rows) // 5)
            self.eval_set, self.rows = rows[:k], rows[k:]
        held = {p.prompt for p in self.eval_set}  # a prompt on both sides scores training, not held out
        overlap = sum(p.prompt in held for p in self.rows)
        if overlap and not eval_path:  # a line given twice: the split left a copy on each side
            self.rows = [p for p in self.rows if p.prompt not in held]
        if overlap and int(os.environ.get("RANK", 0)) == 0:
            why = (f" of --task.eval-path={eval_path!r}: eval_accuracy partly scores prompts the run trains on"
                   if eval_path else "; left out of training, so the held-out score stays honest")
            print(f"--task.path={path!r}: {overlap} training row(s) repeat a held-out prompt{why}", flush=True)
        if not self.rows:
            raise ConfigError(f"--task.path={path!r}: no training prompts")

    def _read(self, path: str, flag: str, limit: int, keys: tuple[str, ...], needed: bool, text: bool) -> list[Problem]:
        rows = []
        for file in data_files(path):  # a pattern's files, in name order
            for where, r in _records(file, flag):
                if not isinstance(r, dict):
                    raise ConfigError(f"{where}: expected an object {{\"prompt\": ..., \"answer\": ...}}, got a "
                                      f"{type(r).__name__}")
                prompt = _prompt_text(r, self.prompt_key, self.tok, self.template_kwargs, where)
                rows.append(Problem(prompt, self._reference(_answer(r, keys, where, needed, text)), r))
        lengths = []
        for i in range(0, len(rows) if self.tok is not None and limit else 0, 1024):
            # 1,024 prompts a tokenizer call: one call a row spent 0.3 ms in transformers, most of a big file's load
            lengths += map(len, prompt_ids(self.tok, [p.prompt for p in rows[i:i + 1024]]))
        over = [i for i, n in enumerate(lengths) if n > limit]
        if over and self.filter_overlong:
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"{flag}={path!r}: {len(over)} of the {len(rows)} prompts have more than "
                      f"--rollout.max-prompt-tokens={limit} tokens and are left out", flush=True)
            rows = [p for p, n in zip(rows, lengths) if n <= limit]
        elif over:  # the first one's place, found by reading again (not kept for a million rows on every rank)
            again = (record for f in data_files(path) for record in _records(f, flag))
            where, _ = next(itertools.islice(again, over[0], None))
            raise ConfigError(f"{where}: the prompt has more than --rollout.max-prompt-tokens={limit} tokens "
                              f"({len(over)} of the {len(rows)} prompts do; the longest has {max(lengths)}); raise "
                              "the flag, shorten the prompts, or leave them out with --task.filter-overlong-prompts")
        columns = dict.fromkeys(k for p in rows for k in p.row)
        for p in rows:  # every row has every column, None where its line has none, as `datasets` reads a file
            if len(p.row) < len(columns):
                p.row.update({k: None for k in columns if k not in p.row})
        return rows

    @staticmethod
    def _reference(answer):
        if not isinstance(answer, str):  # a list or an object, for the functions that read it
            return answer
        ref = answer.split("####")[-1].strip()
        return ref.replace(",", "") if rewards.is_number(ref) else ref  # "1,000" -> "1000"; "Paris, TX" stays

    def train_problem(self, index: int) -> Problem:
        """Training row `index`: each pass over the rows (an epoch) in an order of its own, a pure function of
        (seed, epoch), as TRL's and verl's samplers reshuffle every epoch (the same order each pass repeated
        every batch's mix of prompts)."""
        epoch, i = divmod(index, len(self.rows))
        if epoch not in self._orders:  # the two newest: a streamed run's rollout ranks work across a boundary
            order = list(range(len(self.rows)))
            if epoch:  # the first pass: the rows as the seed shuffled them at load
                random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1} | {epoch: order}
        return self.rows[self._orders[epoch][i]]


def _records(path: str, flag: str):
    """(where, row) for each row of a JSONL file (or `.jsonl.gz`), a JSON array of rows (`.json`, as `datasets`
    reads it), a Parquet file (by its name or magic bytes), or an Arrow file as `datasets` writes them
    (`save_to_disk`'s `data-00000-of-00001.arrow`, its cache's files: Arrow's stream format)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    parquet = path.endswith(".parquet") or magic == b"PAR1"
    kind = "Parquet" if parquet else "Arrow" if path.endswith(".arrow") else ""
    if kind:
        try:
            import pyarrow.ipc
            import pyarrow.parquet
        except ImportError:
            raise ConfigError(f"{flag}={path!r} is {'an' if kind == 'Arrow' else 'a'} {kind} file, which needs "
                              "pyarrow: pip install -e '.[parquet]'") from None
        try:
            if kind == "Parquet":
                table = pyarrow.parquet.read_table(path)
            else:
                with pyarrow.memory_map(path) as source:
                    table = pyarrow.ipc.open_stream(source).read_all()
        except pyarrow.ArrowException as e:  # cut short (a download that stopped), or another format
            why = first_line(e) or type(e).__name__
            raise ConfigError(f"{flag}={path!r}: not a readable {kind} file ({why})") from e
        for n, r in enumerate(table.to_pylist(), 1):
            yield f"{flag}: {path}: row {n}", r
        return
    gzipped = magic[:2] == b"\x1f\x8b"
    try:  # a byte-order mark, as Windows editors write, is dropped
        with (gzip.open if gzipped else open)(path, "rt", encoding="utf-8-sig") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag}={path!r}: not UTF-8 text ({e.reason} at byte {e.start}): a JSONL file is UTF-8 "
                          "text, one JSON object a line (a Parquet file is read as one when its name ends in "
                          ".parquet)") from e
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a download cut short
        raise ConfigError(f"{flag}={path!r}: not a readable gzip file ({e}); download it again") from e
    text = "".join(lines)
    if text.lstrip().startswith("["):  # one JSON array of rows
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: {path}: not a JSON array of rows, nor JSONL ({e})") from e
        for n, r in enumerate(rows, 1):
            yield f"{flag}: {path}: row {n}", r
        return
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield f"{flag}: {path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag}: {path}:{n}: not JSON ({e})") from e


def _prompt_text(row: dict, key: str, tok, template_kwargs: dict, where: str) -> str:
    """A row's prompt (its column `key`) as the engine's text: itself, or chat messages through the tokenizer's
    template (with --task.chat-template-kwargs, e.g. Qwen3's enable_thinking)."""
    prompt = row.get(key)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError(f"{where}: the prompt is empty")
        return prompt
    if not (isinstance(prompt, list) and prompt and all(map(_is_message, prompt))):
        got = f"a {type(prompt).__name__}" if key in row else \
            f"missing (the row's columns: {', '.join(row)}; name the prompt's with --task.prompt-key)"
        if isinstance(prompt, list) and prompt:  # which message is not one (OpenAI's list of content parts, say)
            n = next(i for i, m in enumerate(prompt) if not _is_message(m))
            got = f"message {n + 1} as {json.dumps(prompt[n])[:100]} (its role and content must be text or text parts)"
        raise ConfigError(f"{where}: \"{key}\" must be a string or a list of chat messages "
                          f"[{{\"role\": ..., \"content\": ...}}], got {got}")
    if tok is None or not getattr(tok, "chat_template", None):
        raise ConfigError(f"{where}: the prompt is chat messages, but the tokenizer of --model.path has no chat "
                          "template to render them; give the prompt as text, or a model with a template")
    if any(isinstance(m["content"], list) for m in prompt) and not _reads_parts(tok.get_chat_template()):
        prompt = [{**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list)
                  else m for m in prompt]  # as vLLM's chat API joins them for such a template
    prefill = prompt[-1]["role"] == "assistant"  # "<think>": continued, as trl.apply_chat_template does
    try:
        return tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=not prefill,
                                       continue_final_message=prefill, **template_kwargs)
    except jinja2.TemplateError as e:  # the template's own raise_exception: Gemma's "System role not supported"
        raise ConfigError(f"{where}: the chat template of --model.path refused these messages ({first_line(e)}); "
                          "write them as it takes them (Gemma's takes no system message: put it in the first "
                          "user message)") from e


def _reads_parts(template: str) -> bool:
    """Whether a chat template reads OpenAI's content parts, [{"type": "text", "text": ...}], itself (Gemma 3's loops
    over them), as vLLM's chat API decides (vllm/renderers/hf.py, `_detect_content_format`); for one that does not,
    vLLM joins a message's text parts by newlines (vllm/renderers/chat_utils.py). Imports vLLM: parts only."""
    from vllm.renderers.hf import _detect_content_format
    return _detect_content_format(template, default="string") == "openai"


def _is_message(m) -> bool:
    """A chat message: a role, and content that is text or OpenAI's text parts."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    content = m.get("content")
    return isinstance(content, str) or isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)


def _answer(row: dict, keys: tuple[str, ...], where: str, needed: bool, text: bool):
    """The row's reference under the first key present (dotted: nested): a number as text, a list or an object
    as it is unless `text` ("" if missing, not `needed`)."""
    for key in keys:
        value = row
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            break
    if value is None and not needed:
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(int(value)) if float(value).is_integer() else repr(value)
    if isinstance(value, (list, dict)) and not text:
        return value
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ConfigError(f"{where}: the answer ({' or '.join(keys)}) must be a string or a number, got {got}; "
                          "name its column with --task.answer-key" + (
                              " (a list or an object reaches a --task.reward function as it is; the built-in "
                              "reward compares text)" if isinstance(value, (list, dict)) else ""))
    return value


def warm_start(model, tok, steps: int, lr: float = 1e-3, batch: int = 32, off_by: int = 2) -> None:
    """A deliberately ROUGH supervised start on CountTask: answer + EOS, each label off by up to `off_by`.
    From random init the reward is too sparse for RL on 2 cores; exact labels left high counts so
    unlikely that GRPO never sampled them (the demo plateaued at 0.82). Rough ones teach the format and
    a count about right, and making it exact is RL's work."""
    task = CountTask(seed=12345, eval_prompts=0)
    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        probs = [task.train_problem(step * batch + i) for i in range(batch)]
        labels_text = [str(max(0, int(p.answer) + rng.randint(-off_by, off_by))) for p in probs]
        rows = [(tok(p.prompt, add_special_tokens=False).input_ids,
                 tok(a, add_special_tokens=False).input_ids + [tok.eos_token_id]) for p, a in zip(probs, labels_text)]
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


def prompt_ids(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of prompts as the engine is given them, each beginning once with the special tokens its tokenizer
    puts before a text (Llama's, Mistral's, Gemma's BOS; none for Qwen or GPT-2), whether a chat template wrote them
    or not: as vLLM encodes a text prompt (without them Gemma writes garbage: TRL's issue 3520)."""
    with_them, bare = tok("a").input_ids, tok("a", add_special_tokens=False).input_ids
    start = next((i for i in range(len(with_them)) if with_them[i:i + len(bare)] == bare), 0)
    lead = with_them[:start]  # the tokens before the text's own (any after them, an EOS, are not a prompt's)
    ids = tok(texts, add_special_tokens=False).input_ids if texts else []  # transformers fails on no texts
    return [x if x[:len(lead)] == lead else lead + x for x in ids]


def encode_prompts(tok, texts: list[str], limit: int) -> list[list[int]]:
    """`prompt_ids` of prompts; a prompt over the engine's prompt budget is an error, never cut."""
    ids = prompt_ids(tok, texts)
    longest = max(map(len, ids), default=0)
    if longest > limit:
        raise ValueError(f"a prompt has {longest} tokens, over --rollout.max-prompt-tokens={limit}")
    return ids


def scored(engine, task, tok, problems: list[Problem], ids: list[int], group_size: int, limit: int,
           greedy: bool = False, step: int = 0):
    """Prompts -> completions -> rewards, for both loops and the evals, at loop `step` (an eval's: the version
    it scores): (samples, rewards [row], each function's values [function][row]); row i*G + j is completion j
    of problem i."""
    prompts = encode_prompts(tok, [q.prompt for q in problems], limit)
    samples = engine.generate(prompts, ids, group_size, greedy=greedy)
    texts = tok.batch_decode(samples.completion_tokens, skip_special_tokens=True)
    rows = [q for q in problems for _ in range(group_size)]
    answers = [q.answer for q in rows]
    rewards, parts = task.scorer(texts, answers, samples.clipped, [q.row for q in rows], samples.completion_tokens,
                                 step)
    if not greedy:  # training batches: a function that never pays is said once
        task.scorer.watch(rewards, texts, answers, samples.clipped, parts)
    samples.texts = texts
    return samples, rewards, parts


def held_out(engine, task, tok, limit: int, rank: int = 0, world: int = 1, version: int = 0) -> dict:
    """Greedy completions of the held-out prompts scored by the training reward: `eval_accuracy` (the first
    function's mean over the prompts it scores: a TRL function's None scores none) and `eval_samples`
    (rank 0; each row with every function's value, None where it scored none). With world > 1 a
    collective over the ranks' slices."""

    share = task.eval_set[rank::world]
    rows, scores_first = [], []
    if share:
        out, scores, parts = scored(engine, task, tok, share, list(range(len(share))), 1, limit, True, version)
        scores_first = [v for v in parts[0] if v == v]  # None is NaN here
        rows = [{"prompt": p.prompt, "completion": t, "answer": p.answer, "reward": r, "clipped": c,
                 "rewards": {k: v[i] if v[i] == v[i] else None for k, v in zip(task.scorer.names, parts)}}
                for i, (p, t, r, c) in enumerate(zip(share, out.texts, scores, out.clipped))]
    # a CPU tensor on purpose: gloo reduces it beside NCCL (dist.backend_for); a rollout rank has no trainer card
    tot = torch.tensor([float(sum(scores_first)), float(len(scores_first))])
    if world > 1:
        dist.all_reduce(tot)
        got = dist.gather_json(rows)  # rank r scored prompts r, r + world, ...: back in the set's order
        rows = [got[j % world][j // world] for j in range(len(task.eval_set))]
    return {"eval_accuracy": (tot[0] / tot[1].clamp_min(1)).item(), "eval_samples": rows if rank == 0 else []}


def make_task(cfg: TaskConfig, seed: int, tok=None, limit: int = 0, evaluates: bool = False, steps: int = 0):
    """The task of a run of `steps`, every prompt checked against the prompt budget `limit` when `tok` is given.
    `evaluates` (--log.eval-every > 0): a held-out set must exist, or no eval_accuracy could mean anything."""
    scorer = rewards.scorer(cfg, steps)  # first: a run scored only by TRL functions (their own columns) needs no answer
    if cfg.name == "count":
        if limit and limit < CountTask.max_len + 3:
            raise ConfigError(f"--rollout.max-prompt-tokens={limit}: the built-in task's prompts take up to "
                              f"{CountTask.max_len + 3} tokens")
        task = CountTask(seed, cfg.eval_prompts)
    else:
        task = JsonlTask(cfg.path, seed, cfg.eval_prompts, cfg.eval_path, tok, limit, cfg.answer_key,
                         needs_answer=any(kind != "trl" for kind in scorer.kinds),
                         text_answer=any(spec in rewards.BUILT_IN.values() for spec in scorer.specs),
                         template_kwargs=cfg.template_kwargs(), prompt_key=cfg.prompt_key,
                         filter_overlong=cfg.filter_overlong_prompts)
    if evaluates and not task.eval_set:
        why = ("--task.eval-prompts is 0: raise it" if not cfg.eval_prompts else  # only a file can be too short
               f"--task.eval-path={cfg.eval_path!r} holds no prompt" if cfg.eval_path else
               f"--task.path={cfg.path!r} has too few prompts to hold one in five out: give --task.eval-path")
        raise ConfigError(f"no held-out prompts to score ({why}; a training run can also turn evaluation off: "
                          "--log.eval-every 0)")
    task.scorer = scorer
    task.scorer.check(task.train_problem(0))  # each reward function called once, before any model is built
    main = int(os.environ.get("RANK", 0)) == 0  # the lines below are said once, by the first rank
    sources = sorted({str(p.row["data_source"]) for p in getattr(task, "rows", ()) if p.row.get("data_source")})
    other = [s for s in sources if "gsm8k" not in s.lower()]  # verl scores GSM8K as the built-in reward does
    if other and not cfg.reward and main:
        print(f"--task.path={cfg.path!r}: its rows are of verl's data source {other[0]!r}, which verl scores by a "
              "function of its own, and the built-in reward reads GSM8K's `#### N`. verl's scorer runs here as it is "
              "(in verl/utils/reward_score/: math_reward.py for MATH, math_dapo.py for DAPO and AIME): --task.reward "
              "path/to/that/file.py:compute_score", flush=True)
    text = cfg.name == "jsonl" and isinstance(task.train_problem(0).row.get(cfg.prompt_key), str)
    if text and getattr(tok, "chat_template", None) and main:
        print(f"--task.path={cfg.path!r}: its prompts are text, which reach the model as they are (TRL's standard "
              "form); --model.path has a chat template, and an instruct model answers chat messages, "
              '[{"role": "user", "content": ...}] (TRL\'s conversational form, verl\'s prompts)', flush=True)
    return task
