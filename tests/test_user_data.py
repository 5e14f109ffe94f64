"""Datasets and reward functions as TRL and verl users have them, run unchanged (tasks.py, rewards.py).

Two GRPO runs of 2 steps with the real engine: a TRL conversational JSONL (a `solution` column) with
TRL's batched reward named as `path/file.py:function`, and a verl row file (Parquet to train on, JSONL
held out) with verl's `compute_score`. The tiny model gets a chat template for them: the user's
message, then `=` as the generation prompt, so `{"role": "user", "content": "abba#a"}` renders as the
built-in task's prompt `abba#a=`.
"""

import json
import shutil
import sys

import pytest

from conftest import run
from minirl.config import ConfigError, TaskConfig
from minirl.models import load_tokenizer
from minirl.tasks import CountTask, make_task

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"

TRL_REWARD = '''
def correct(completions, solution, **kwargs):
    """TRL's conversational form: each completion is a list of messages. Logs a number, as TRL 1.x lets it."""
    kwargs["log_metric"]("rows", float(len(completions)))
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]


def short(completions, completion_ids, solution, trainer_state, **kwargs):
    """None: "not applicable" (here to the count 0). Notes the step TRL's `trainer_state` gives it (a curriculum's)."""
    import os
    with open(os.path.join(os.path.dirname(__file__), "steps.txt"), "a") as f:
        f.write(f"{trainer_state.global_step} {trainer_state.max_steps} {len(completions)}\\n")
    return [None if s == "0" else float(len(ids) <= 2) for ids, s in zip(completion_ids, solution)]
'''

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "count" and extra_info["split"] in ("train", "test")
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}
'''


@pytest.fixture(scope="module")
def chat_model(tiny_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_path, d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


def problems(n, seed=3):
    task = CountTask(seed, 0)
    return [task.train_problem(i) for i in range(n)]


def trl_rows(n):
    return [{"prompt": [{"role": "user", "content": p.prompt[:-1]}], "solution": p.answer} for p in problems(n)]


def verl_rows(n, split):
    return [{"data_source": "count", "prompt": [{"role": "user", "content": p.prompt[:-1]}], "ability": "count",
             "reward_model": {"style": "rule", "ground_truth": p.answer}, "extra_info": {"split": split, "index": i}}
            for i, p in enumerate(problems(n, seed=3 if split == "train" else 4))]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(d):
    return [r for r in map(json.loads, open(d / "metrics.jsonl")) if "reward_mean" in r]


GRPO_2 = ["--steps", "2", "--log.eval-every", "2", "--rl.batch-per-replica", "16", "--rl.group-size", "4",
          "--task.name", "jsonl", "--task.eval-prompts", "8"]


def test_a_trl_conversational_dataset_with_trls_batched_reward_runs_unchanged(chat_model, tmp_path):
    data = write_jsonl(tmp_path / "trl.jsonl", trl_rows(60))
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARD)
    d = tmp_path / "run"
    p = run([sys.executable, "-m", "minirl.grpo", *GRPO_2, "--model.path", str(chat_model), "--task.path", str(data),
             "--task.reward", f"{tmp_path}/trl_rewards.py:correct", "--task.reward", f"{tmp_path}/trl_rewards.py:short",
             "--task.reward-weights", "1", "0.1", "--log.train-samples", "3", "--log.run-dir", str(d)])
    assert p.returncode == 0
    recs = records(d)
    assert [r["step"] for r in recs] == [0, 1]
    assert max(r["reward/correct"] for r in recs) > 0  # the conversational completions were read
    assert all(0 <= r["reward/short"] <= 1 for r in recs)  # its None is left out of its mean, not NaN
    assert [r["reward/correct/rows"] for r in recs] == [16.0, 16.0]  # what log_metric logged, averaged
    # trainer_state: the check on one row, the eval of version 0, steps 0 and 1, the eval of version 2
    assert (tmp_path / "steps.txt").read_text().split("\n") == ["0 2 1", "0 2 8", "0 2 16", "1 2 16", "2 2 8", ""]
    samples = [json.loads(line) for line in open(d / "samples.jsonl")]
    trained = [s for s in samples if s.get("split") == "train"]  # --log.train-samples 3
    assert [s["step"] for s in trained] == [0, 0, 0, 1, 1, 1]
    for s in trained:
        assert set(s) == {"step", "split", "prompt", "completion", "reward", "rewards", "clipped"}
        assert s["prompt"].endswith("#a=") and set(s["rewards"]) == {"correct", "short", "correct/rows"}
        short = 0.0 if s["rewards"]["short"] != s["rewards"]["short"] else s["rewards"]["short"]
        assert s["reward"] == pytest.approx(s["rewards"]["correct"] + 0.1 * short)
    samples = [s for s in samples if "split" not in s]
    assert samples[0]["prompt"].endswith("#a=")  # the chat template rendered the messages
    last = [s for s in samples if s["eval_version"] == recs[-1]["eval_version"]]
    assert recs[-1]["eval_accuracy"] == pytest.approx(  # the first function's mean
        sum(s["completion"] == s["answer"] and not s["clipped"] for s in last) / len(last))


def test_a_verl_row_file_parquet_and_jsonl_with_verls_compute_score_runs_unchanged(chat_model, tmp_path):
    import pyarrow
    import pyarrow.parquet
    train = tmp_path / "train.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(verl_rows(60, "train")), train)
    test = write_jsonl(tmp_path / "test.jsonl", verl_rows(8, "test"))
    (tmp_path / "verl_score.py").write_text(VERL_REWARD)
    d = tmp_path / "run"
    p = run([sys.executable, "-m", "minirl.grpo", *GRPO_2, "--model.path", str(chat_model), "--task.path", str(train),
             "--task.eval-path", str(test), "--task.reward", "verl_score:compute_score", "--log.run-dir", str(d)],
            env={"PYTHONPATH": str(tmp_path)})
    assert p.returncode == 0
    recs = records(d)
    assert [r["step"] for r in recs] == [0, 1] and max(r["reward_mean"] for r in recs) > 0
    assert all(r["reward_mean"] == r["reward/compute_score"] == r["reward/compute_score/acc"] for r in recs)


def test_parquet_json_and_jsonl_rows_load_alike_and_keep_every_column(chat_model, tmp_path):
    """A `.json` file that is one JSON array of rows (as `datasets` reads it) too: it was "not JSON"."""
    import pyarrow
    import pyarrow.parquet
    rows = verl_rows(10, "train")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "rows.parquet")
    write_jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=2))
    tok = load_tokenizer(str(chat_model))
    a, b, c = (make_task(TaskConfig(name="jsonl", path=str(tmp_path / f), eval_prompts=0), 0, tok, 32)
               for f in ("rows.parquet", "rows.jsonl", "rows.json"))
    assert [(p.prompt, p.answer, p.row) for p in a.rows] == [(p.prompt, p.answer, p.row) for p in b.rows] \
        == [(p.prompt, p.answer, p.row) for p in c.rows]
    assert a.rows[0].prompt.endswith("#a=") and a.rows[0].row["extra_info"]["split"] == "train"


def test_a_prompt_ending_in_an_assistant_message_is_continued_as_trl_continues_it(chat_model, tmp_path):
    """A prefill (`{"role": "assistant", "content": "<think>"}` last) is the start of the model's answer: TRL's
    dataset helper `trl.apply_chat_template` renders it with `continue_final_message`; it got a new assistant turn."""
    rows = [{"prompt": [{"role": "user", "content": p.prompt[:-3]}, {"role": "assistant", "content": "#a="}],
             "answer": p.answer} for p in problems(5)] + trl_rows(5)
    task = make_task(TaskConfig(name="jsonl", path=str(write_jsonl(tmp_path / "prefill.jsonl", rows)),
                                eval_prompts=0), 0, load_tokenizer(str(chat_model)), 32)
    assert sorted(p.prompt for p in task.rows) == sorted(q.prompt for q in problems(5) * 2)


def test_the_chat_templates_variables_reach_it_as_trl_and_verl_pass_them(chat_model, tmp_path):
    """Qwen3's template thinks unless `enable_thinking` is false: TRL's `chat_template_kwargs` and verl's
    `data.apply_chat_template_kwargs` set it, and minirl had no way to. A value that is not a JSON object, or one
    given to the built-in task (which renders no chat), fails at the check naming the flag."""
    (chat_model.parent / "think").mkdir(exist_ok=True)
    model = chat_model.parent / "think" / "model"
    if not model.exists():
        shutil.copytree(chat_model, model)
        (model / "chat_template.jinja").write_text(
            TEMPLATE + "{% if enable_thinking is defined and enable_thinking is false %}{% else %}#{% endif %}")
    data = write_jsonl(tmp_path / "chat.jsonl", trl_rows(5))
    tok = load_tokenizer(str(model))
    plain, quiet = (make_task(TaskConfig(name="jsonl", path=str(data), eval_prompts=0, chat_template_kwargs=kw), 0,
                              tok, 32) for kw in ("", '{"enable_thinking": false}'))
    assert sorted(p.prompt for p in quiet.rows) == sorted(q.prompt for q in problems(5))
    assert sorted(p.prompt for p in plain.rows) == sorted(q.prompt + "#" for q in problems(5))
    for kw in ("enable_thinking=false", "[1]"):
        with pytest.raises(ConfigError, match=r"--task.chat-template-kwargs=.* is not a JSON object; give one such"):
            TaskConfig(name="jsonl", path=str(data), chat_template_kwargs=kw).check()
    with pytest.raises(ConfigError, match="--task.chat-template-kwargs is for your own prompts"):
        TaskConfig(chat_template_kwargs='{"enable_thinking": false}').check()


def test_rows_of_a_verl_data_source_the_built_in_reward_does_not_score_name_verls_function(chat_model, tmp_path,
                                                                                           capsys, monkeypatch):
    """verl picks a row's score by its `data_source` (MATH's `\\boxed{}`, DAPO's `Answer:`); the built-in reward reads
    GSM8K's `#### N` and paid 0 on every row of such a file without a word until the tenth batch. The load says
    where verl's scorer is (math_reward.py and math_dapo.py of verl/utils/reward_score/ run here as they are);
    GSM8K rows, or a --task.reward, are told nothing, and a launch's other ranks say nothing."""
    tok = load_tokenizer(str(chat_model))
    for source, reward, rank, said in (("lighteval/MATH", [], "0", True), ("openai/gsm8k", [], "0", False),
                                       ("lighteval/MATH", ["minirl.rewards:gsm8k"], "0", False),
                                       ("lighteval/MATH", [], "1", False)):
        monkeypatch.setenv("RANK", rank)
        rows = [{**r, "data_source": source} for r in verl_rows(10, "train")]
        data = write_jsonl(tmp_path / "rows.jsonl", rows)
        make_task(TaskConfig(name="jsonl", path=str(data), eval_prompts=0, reward=reward), 0, tok, 32)
        out = capsys.readouterr().out
        assert ("its rows are of verl's data source 'lighteval/MATH'" in out and "math_reward.py for MATH" in out
                and "--task.reward path/to/that/file.py:compute_score" in out) == said, (source, reward, out)
    monkeypatch.setenv("RANK", "0")  # GSM8K rows, some without the column: None there, not a data source of its own
    rows = [{**r, "data_source": "openai/gsm8k"} if i % 2 else {k: v for k, v in r.items() if k != "data_source"}
            for i, r in enumerate(verl_rows(10, "train"))]
    make_task(TaskConfig(name="jsonl", path=str(write_jsonl(tmp_path / "rows.jsonl", rows)), eval_prompts=0), 0, tok, 32)
    assert "data source" not in capsys.readouterr().out


def test_text_prompts_for_a_model_with_a_chat_template_are_said_to_reach_it_as_they_are(chat_model, tmp_path,
                                                                                          capsys, monkeypatch):
    """An instruct model given a raw question (GSM8K as the hub keeps it, by --task.prompt-key question) answered
    nothing or noise (SmolLM2-135M-Instruct: '' and 'Quadratic equation: ...'), and no reward paid; the load says
    that text prompts get no chat template. Chat prompts, or a model without a template, are told nothing; the
    other ranks of a launch say nothing (the first says it once)."""
    tok = load_tokenizer(str(chat_model))
    texts = [{"prompt": p.prompt, "answer": p.answer} for p in problems(10)]
    for rows, template, rank, said in ((texts, True, "0", True), (trl_rows(10), True, "0", False),
                                       (texts, False, "0", False), (texts, True, "1", False)):
        monkeypatch.setenv("RANK", rank)
        data = write_jsonl(tmp_path / "rows.jsonl", rows)
        make_task(TaskConfig(name="jsonl", path=str(data), eval_prompts=0), 0, tok if template else None, 32)
        out = capsys.readouterr().out
        assert ("its prompts are text, which reach the model as they are" in out
                and "an instruct model answers chat messages" in out) == said, (rows[0], template, out)


def test_trls_quickstart_rows_without_an_answer_load_for_a_trl_function_alone(tmp_path):
    """TRL's GRPO quickstart trains on `trl-lib/tldr` (`prompt` and `completion` columns, no answer) with a length
    reward: a TRL function reads its own columns, so no answer is needed; minirl's and verl's forms need one."""
    (tmp_path / "tldr_rw.py").write_text("def reward_len(completions, **kwargs):\n"
                                         "    return [-abs(20 - len(c)) for c in completions]\n")
    f = write_jsonl(tmp_path / "tldr.jsonl", [{"prompt": f"POST: {i}\nTL;DR:", "completion": f" post {i}"}
                                              for i in range(10)])
    task = make_task(TaskConfig(name="jsonl", path=str(f), reward=[f"{tmp_path}/tldr_rw.py:reward_len"]), 0)
    assert {p.answer for p in task.rows + task.eval_set} == {""} and len(task.rows) == 8
    assert task.scorer(["x" * 22], [""], [False], [task.rows[0].row])[0] == [-2.0]
    for reward in ([], [f"{tmp_path}/tldr_rw.py:reward_len", "minirl.rewards:count"]):
        with pytest.raises(ConfigError, match=r"tldr\.jsonl:1: the answer .* got missing"):
            make_task(TaskConfig(name="jsonl", path=str(f), reward=reward), 0)


@pytest.mark.parametrize("row, key, answer", [
    ({"prompt": "q", "solution": "7"}, "", "7"),
    ({"prompt": "q", "answer": 7}, "", "7"),
    ({"prompt": "q", "answer": 2.5}, "", "2.5"),
    ({"prompt": "q", "reward_model": {"ground_truth": "#### 1,000"}}, "", "1000"),
    ({"prompt": "q", "meta": {"gold": 3}}, "meta.gold", "3"),
])
def test_the_answer_is_found_under_its_usual_names_or_the_named_key(tmp_path, row, key, answer):
    f = write_jsonl(tmp_path / "rows.jsonl", [row] * 5)
    task = make_task(TaskConfig(name="jsonl", path=str(f), eval_prompts=0, answer_key=key), 0)
    assert task.rows[0].answer == answer


def test_chat_messages_without_a_chat_template_are_refused_in_one_line(tiny_path, tmp_path):
    f = write_jsonl(tmp_path / "trl.jsonl", trl_rows(5))
    with pytest.raises(ConfigError, match=r"trl\.jsonl:1: the prompt is chat messages, but the tokenizer of "
                                          r"--model\.path has no chat template"):
        make_task(TaskConfig(name="jsonl", path=str(f), eval_prompts=0), 0, load_tokenizer(tiny_path), 32)


def test_a_parquet_file_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    f = tmp_path / "rows.parquet"
    f.write_bytes(b"PAR1" + b"\0" * 20)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as where it is not installed
    with pytest.raises(ConfigError, match=r"is a Parquet file, which needs pyarrow: pip install -e '\.\[parquet\]'"):
        make_task(TaskConfig(name="jsonl", path=str(f), eval_prompts=0), 0)


def test_a_mis_signatured_reward_exits_2_before_the_engine_and_one_failing_later_exits_1_naming_it(tmp_path):
    (tmp_path / "bad_rw.py").write_text("def one_arg(completion):\n    return 1.0\n"
                                        "def later(completion, answer):\n    if completion:\n        raise KeyError('k')\n"
                                        "    return 0.0\n"
                                        "import time\n"
                                        "def hangs(completion, answer):\n    while completion:\n        try:\n"
                                        "            time.sleep(100)\n        except Exception:\n            pass\n"
                                        "    return 0.0\n")
    base = [sys.executable, "-m", "minirl.grpo", "--steps", "1", "--rl.batch-per-replica", "8", "--rl.group-size", "4"]
    p = run([*base, "--task.reward", f"{tmp_path}/bad_rw.py:one_arg", "--log.run-dir", str(tmp_path / "a")])
    assert p.returncode == 2 and "building the vLLM engine" not in p.stdout
    assert p.stderr.strip().splitlines() == [
        f"minirl.grpo: error: --task.reward {tmp_path}/bad_rw.py:one_arg failed on an empty completion and the first "
        "training row: TypeError: one_arg() takes 1 positional argument but 2 were given; it is called as "
        "f(completion: str, answer: str) -> float"]
    p = run([*base, "--task.reward", f"{tmp_path}/bad_rw.py:later", "--log.run-dir", str(tmp_path / "b")])
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith(f"minirl.grpo: error: --task.reward {tmp_path}/bad_rw.py:later "
                                                 "failed on the completion ") and "KeyError: 'k'" in last
    # a call that never returns (and swallows every Exception): a line naming it, then exit 2 at the timeout
    p = run([*base, "--task.reward", f"{tmp_path}/bad_rw.py:hangs", "--task.reward-timeout", "3",
             "--log.run-dir", str(tmp_path / "c")])
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and f"warning: --task.reward {tmp_path}/bad_rw.py:hangs has not returned for 2 s, on " \
                                 "the completion " in p.stdout, p.stdout[-2000:]
    assert last.startswith(f"minirl.grpo: error: --task.reward {tmp_path}/bad_rw.py:hangs failed on the completion ")
    assert "no return within --task.reward-timeout=3 s" in last and "Traceback" not in p.stderr


SEARCH_R1_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's search_r1_like_qa_em.compute_score reads the targets as ground_truth["target"]."""
    return float(solution_str.strip().lower() in [t.lower() for t in ground_truth["target"]])


def aliases(completions, answer, **kwargs):
    """A TRL function reading a TriviaQA-style answer column, {"value": ..., "aliases": [...]}."""
    return [float(c in a["aliases"]) for c, a in zip(completions, answer)]
'''


def test_a_list_or_object_answer_reaches_verls_and_trls_functions_as_it_is(tmp_path):
    """verl's Search-R1 rows keep their targets as reward_model.ground_truth = {"target": [...]}, and TriviaQA's
    answer is an object of aliases: both were refused at load as "must be a string or a number, got a dict"."""
    import pyarrow
    import pyarrow.parquet
    rows = [{"data_source": "nq", "prompt": f"Who wrote book {i}?", "answer": {"value": f"A{i}", "aliases": [f"A{i}", "B"]},
             "reward_model": {"style": "rule", "ground_truth": {"target": [f"A{i}", f"a. {i}"]}}} for i in range(10)]
    data = tmp_path / "search_r1.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), data)
    (tmp_path / "sr1.py").write_text(SEARCH_R1_REWARD)
    verl = make_task(TaskConfig(name="jsonl", path=str(data), eval_prompts=0, answer_key="reward_model.ground_truth",
                                reward=[f"{tmp_path}/sr1.py:compute_score"]), 0)
    first = verl.rows[0]
    assert first.answer == first.row["reward_model"]["ground_truth"] and isinstance(first.answer["target"], list)
    target = first.answer["target"]
    assert verl.scorer([target[1].upper(), "C"], [first.answer] * 2, [False] * 2, [first.row] * 2)[0] == [1.0, 0.0]
    trl = make_task(TaskConfig(name="jsonl", path=str(data), eval_prompts=0, reward=[f"{tmp_path}/sr1.py:aliases"]), 0)
    assert trl.rows[0].answer == trl.rows[0].row["answer"] and "aliases" in trl.rows[0].answer
    assert trl.scorer(["B", "C"], [trl.rows[0].answer] * 2, [False] * 2, [trl.rows[0].row] * 2)[0] == [1.0, 0.0]
    for reward in ([], [f"{tmp_path}/sr1.py:aliases", "minirl.rewards:gsm8k"]):  # the built-in reward compares text
        with pytest.raises(ConfigError, match=r"search_r1\.parquet: row 1: the answer .* must be a string or a number, got "
                                              r"a dict; .* \(a list or an object reaches a --task\.reward function"):
            make_task(TaskConfig(name="jsonl", path=str(data), eval_prompts=0, reward=reward), 0)
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "q", "answer": True}] * 5)  # no list nor object
    with pytest.raises(ConfigError, match=r"bare\.jsonl:1: the answer .* must be a string or a number, got a bool"):
        make_task(TaskConfig(name="jsonl", path=str(bare), eval_prompts=0, reward=[f"{tmp_path}/sr1.py:compute_score"]), 0)


def test_a_message_of_openais_text_parts_renders_as_vllms_chat_api_renders_it(chat_model, tmp_path):
    """OpenAI's content parts, [{"type": "text", "text": ...}], were refused as "its role and content must be
    text". vLLM's chat API joins a message's parts by newlines for a template that prints the content (this one;
    Qwen3's would drop a list), and hands them to a template that loops over them (Gemma 3's) as they are."""
    rows = [{"prompt": [{"role": "user", "content": [{"type": "text", "text": p.prompt[:3]},
                                                     {"type": "text", "text": p.prompt[3:-1]}]}], "answer": p.answer}
            for p in problems(5)]
    data = str(write_jsonl(tmp_path / "parts.jsonl", rows))
    tok = load_tokenizer(str(chat_model))
    task = make_task(TaskConfig(name="jsonl", path=data, eval_prompts=0), 0, tok, 32)
    assert sorted(p.prompt for p in task.rows) == sorted(q.prompt[:3] + "\n" + q.prompt[3:] for q in problems(5))
    assert task.rows[0].row["prompt"][0]["content"][0]["type"] == "text"  # the row, as TRL's functions get it
    tok.chat_template = {"default": "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
                                    "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
                                    "{% endfor %}{% if add_generation_prompt %}={% endif %}",
                         "tool_use": TEMPLATE}  # named templates, as Hermes' tokenizers keep them: the default is used
    task = make_task(TaskConfig(name="jsonl", path=data, eval_prompts=0), 0, tok, 32)
    assert sorted(p.prompt for p in task.rows) == sorted(q.prompt for q in problems(5))
