"""rewards.py: strict built-in rewards, the cap rule, plugged-in functions with weights."""

import json
import math
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from minirl import rewards
from minirl.logger import sample_metrics
from minirl.config import ConfigError, TaskConfig
from minirl.rewards import Scorer, count, gsm8k, gsm8k_flexible
from minirl.tasks import make_task


def test_count_reward_is_exactly_the_count():
    assert count("3", "3") == 1.0
    for hack in ("3p3p3p3p", "x3b", "3 ", "33", "03", "4"):  # the first number right is not enough
        assert count(hack, "3") == 0.0, hack
    assert count("__import__('os').system('false')", "3") == 0.0  # compared, never executed


def test_a_completion_cut_by_the_cap_earns_zero_from_every_reward():
    s = Scorer(["minirl.rewards:count", "minirl.rewards:gsm8k_flexible"], [1.0, 0.5])
    total, parts = s(["3", "3", "2"], ["3", "3", "3"], [False, True, False])
    assert total == [1.5, 0.0, 0.0] and parts == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_a_completion_cut_by_the_cap_keeps_its_penalties(tmp_path, monkeypatch):
    """TRL's quickstart reward is a length penalty, `-abs(20 - len(c))`: a cut completion's 0 was the best reward
    there is, so running to the cap paid. A term that costs still costs when cut, by its weight's sign too; one
    that pays is 0; a TRL None stays None."""
    (tmp_path / "pen_rw.py").write_text(
        "def reward_len(completions, **kwargs):\n    return [-abs(20 - len(c)) for c in completions]\n"
        "def length(completion, answer):\n    return float(len(completion))\n"
        "def maybe(completions, **kwargs):\n    return [None] + [1.0] * (len(completions) - 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    long, short = "x" * 40, "x" * 18
    s = Scorer(["pen_rw:reward_len", "pen_rw:length", "minirl.rewards:count", "pen_rw:maybe"], [1.0, -0.5, 1.0, 1.0])
    total, parts = s([long, short], [long, "3"], [True, True], [{}, {}])
    assert parts[:3] == [[-20.0, -2.0], [40.0, 18.0], [0.0, 0.0]] and total == [-40.0, -11.0]
    assert math.isnan(parts[3][0]) and parts[3][1] == 0.0
    uncut = s([long, short], [long, "3"], [False, False], [{}, {}])[1]
    assert uncut[2] == [1.0, 0.0] and uncut[3][1] == 1.0  # not cut: the count and `maybe` pay


def test_gsm8k_strict_reads_only_the_number_after_the_last_marker():
    assert gsm8k("so 40 + 2 = 42\n#### 42", "42") == 1.0
    assert gsm8k("#### 1,000", "1000") == 1.0 and gsm8k("#### 1,000.", "1000") == 0.0  # verl: "1000." != "1000"
    assert gsm8k("#### $1,000", "1000") == 0.0 and gsm8k("#### 42.0", "42") == 0.0  # and no "$" after the marker
    assert gsm8k("#### 41 wait\n#### 42", "42") == 1.0 and gsm8k("#### 42\n#### 41", "42") == 0.0
    assert gsm8k("the answer is 42", "42") == 0.0  # no marker: strict gives nothing (verl's strict mode)
    assert gsm8k("#### forty-two", "42") == 0.0
    assert gsm8k("####\n42", "42") == 0.0  # the answer is on the marker's line, not the next


def verl_strict(solution_str: str, ground_truth: str) -> float:
    """verl's strict GSM8K score, as verl/utils/reward_score/gsm8k.py (commit b178a3c) computes it:
    `extract_solution(method="strict")` then `compute_score`'s string comparison."""
    import re
    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
    final_answer = solutions[-1].replace(",", "").replace("$", "") if solutions else None
    return 0.0 if final_answer is None else float(final_answer == ground_truth)


VERL_CASES = [  # verl's own examples (its interaction tests and docs) and the ones minirl once scored differently
    ("#### 42", "42"), ("The answer is #### 42", "42"), ("#### 24", "42"), ("So the answer is 72.\n#### 72", "72"),
    ("####42", "42"), ("#### $42", "42"), ("#### 42.", "42"), ("#### 42.00", "42"), ("#### 42 apples", "42"),
    ("#### -3", "-3"), ("#### 1,234,567", "1234567"), ("#### 7 and later #### 8", "8"), ("x" * 400 + "#### 5", "5"),
    ("#### 5" + "x" * 296, "5"), ("#### 5" + "x" * 295, "5"), ("", "0"), ("#### .", "0"), ("#### 0.5", "0.5")]


@pytest.mark.parametrize("completion, answer", VERL_CASES)
def test_gsm8k_strict_is_verls_strict_score_on_its_cases(completion, answer):
    assert gsm8k(completion, answer) == verl_strict(completion, answer), (completion[-80:], answer)


def test_gsm8k_strict_is_verls_strict_score_on_generated_completions():
    """20,000 completions made of the pieces the pattern turns on (the marker with and without its space,
    digits, signs, commas, dots, dollars, words, newlines, long runs that push a marker out of the last
    300 characters), against numeric references that they hit often."""
    import random
    rng = random.Random(0)
    pieces = ["#### ", "####", "# ", " ", "\n", "-", ",", ".", "$", "answer", "x" * 120, *"0123456789"]
    for _ in range(20000):
        answer = rng.choice(["42", "-3", "1000", "0.5", "7", str(rng.randint(0, 99))])
        text = "".join(rng.choice(pieces + [f"#### {answer}", f"#### {answer}.", answer]) for _ in range(rng.randint(0, 12)))
        assert gsm8k(text, answer) == verl_strict(text, answer), (text, answer)


def test_gsm8k_flexible_takes_the_last_number():
    assert gsm8k_flexible("the answer is 42", "42") == 1.0
    assert gsm8k_flexible("42, or maybe 41", "42") == 0.0
    assert gsm8k_flexible("1,000 apples.", "1000") == 1.0 and gsm8k_flexible("none", "1") == 0.0


def test_text_answers_compare_as_normalised_text():
    assert gsm8k("so it is\n#### Paris.", "paris") == 1.0
    assert gsm8k("#### New  York", "new york") == 1.0 and gsm8k("#### Paris Texas", "paris") == 0.0
    assert gsm8k_flexible("The capital is PARIS!", "Paris") == 1.0
    assert gsm8k_flexible("Paris? no, Lyon", "Paris") == 0.0


def test_a_jsonl_text_reference_keeps_its_commas_and_a_number_loses_them(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": a})
                           for i, a in enumerate(["#### Paris, Texas", "#### 1,000"] * 5)))
    t = make_task(TaskConfig(name="jsonl", path=str(f), eval_prompts=0), 0)
    assert {p.answer for p in t.rows} == {"Paris, Texas", "1000"}
    assert t.scorer(["so: #### paris, texas.", "#### 1,000"], ["Paris, Texas", "1000"], [False, False])[0] == [1.0, 1.0]


def test_answer_format_picks_the_jsonl_tasks_built_in(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": f"#### {i}"}) for i in range(10)))
    strict = make_task(TaskConfig(name="jsonl", path=str(f)), 0)
    flexible = make_task(TaskConfig(name="jsonl", path=str(f), answer_format="flexible"), 0)
    assert strict.scorer(["it is 3"], ["3"], [False])[0] == [0.0]
    assert flexible.scorer(["it is 3"], ["3"], [False])[0] == [1.0]
    assert make_task(TaskConfig(), 0).scorer.specs == ["minirl.rewards:count"]


@pytest.fixture
def plug(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(
        "def ends_cleanly(completion, answer):\n    return float(completion.strip().isdigit())\n"
        "def boom(completion, answer):\n    raise KeyError('x')\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("myrewards", None)


def test_plugged_in_rewards_are_weighted_and_each_has_its_own_mean(plug):
    s = rewards.scorer(TaskConfig(reward=["minirl.rewards:count", "myrewards:ends_cleanly"], reward_weights=[1.0, 0.2]))
    assert s.names == ["count", "ends_cleanly"]
    total, parts = s(["3", "4", "x"], ["3", "3", "3"], [False] * 3)
    assert total == pytest.approx([1.2, 0.2, 0.0]) and parts == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


@pytest.mark.parametrize("cfg, says", [
    (TaskConfig(reward=["myrewards"]), "give module:function"),
    (TaskConfig(reward=["Qwen/Qwen2.5-Math-RM-72B"]), "names a model, not a function"),  # TRL's reward model id
    (TaskConfig(reward=["rewards/mine.py"]), "give module:function"),
    (TaskConfig(reward=["nosuchmodule_xyz:f"]), "cannot import nosuchmodule_xyz"),
    (TaskConfig(reward=["myrewards:missing"]), "has no missing"),
    (TaskConfig(reward=["myrewards:NOT_A_FUNCTION"]), "is not a function"),
    (TaskConfig(reward=["myrewards:ends_cleanly"], reward_weights=[1.0, 2.0]), "2 value(s) for 1 reward function"),
    (TaskConfig(reward=["myrewards:ends_cleanly"], reward_weights=[float("nan")]), "must be finite"),
])
def test_a_bad_reward_flag_is_refused_naming_it(plug, cfg, says):
    with pytest.raises(ConfigError, match="--task.reward") as e:
        rewards.scorer(cfg)
    assert says in str(e.value)


def test_a_reward_function_that_fails_names_itself_and_the_completion(plug):
    s = rewards.scorer(TaskConfig(reward=["myrewards:boom"]))
    with pytest.raises(RuntimeError, match="myrewards:boom failed on the completion '7'"):
        s(["7"], ["7"], [False])


def test_the_format_reward_in_forking_md_plugs_in_as_written(tmp_path, monkeypatch):
    from conftest import ROOT
    doc = open(f"{ROOT}/docs/forking.md").read()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]  # the first example: myrewards.py
    (tmp_path / "myrewards_doc.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    s = rewards.scorer(TaskConfig(name="jsonl", reward=["minirl.rewards:gsm8k", "myrewards_doc:ends_cleanly"],
                                  reward_weights=[1.0, 0.2]))
    total, parts = s(["so 6 * 7\n#### 42", "#### 42 and I could go on", "#### 41"], ["42"] * 3, [False] * 3)
    assert parts == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]] and total == pytest.approx([1.2, 1.0, 0.2])
    sys.modules.pop("myrewards_doc", None)


FORMS = '''
def trl_batched(completions, answer, **kwargs):
    return [None if a == "9" else float(c == a) for c, a in zip(completions, answer)]


def trl_prompts(completions, prompts, **kwargs):
    return [float(len(p)) for p in prompts]


async def trl_judge(completions, answer, **kwargs):
    """TRL runs an `async def` reward function (a judge that awaits a server) to its result."""
    import asyncio
    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, answer)]


async def verl_async(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "extra": data_source}


def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    """verl's `batch` reward manager's form: every row at once, a float or a dict each."""
    return [{"score": float(s == g), "row": e["i"]} if d == "gsm8k" else float(s == g)
            for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]


def verl_keywords(data_source=None, solution_str=None, ground_truth=None, **kw):
    """verl's keyword style: called positionally as f(completion, answer) it scored 0 on everything."""
    return float(solution_str == ground_truth)


def trl_curriculum(completions, trainer_state, **kwargs):
    """A curriculum as TRL's docs write one: the step and the run's length from `trainer_state`."""
    from transformers import TrainerState
    assert isinstance(trainer_state, TrainerState)
    return [trainer_state.global_step + trainer_state.max_steps / 100] * len(completions)


class Overlong:
    """TRL's length rewards as its factories build them (get_soft_overlong_punishment): an object called with
    `completion_ids` alone by name; called as minirl's f(completion, answer), it was refused."""

    def __call__(self, completion_ids, **kwargs):
        return [-float(len(ids) > 2) for ids in completion_ids]


overlong = Overlong()


def trl_prompt_lengths(prompts, **kwargs):
    return [float(len(p)) for p in prompts]


def makes_one(max_completion_len, soft_punish_cache):
    """A factory, as TRL's get_soft_overlong_punishment: named itself, it returned a function, "not a number"."""
    return Overlong()


def exits(completion, answer):
    raise SystemExit(0)


def wrong_arity(completion):
    return 1.0


def says_yes(completion, answer):
    return "yes"


def nan(completion, answer):
    return float("nan")


def never_pays(completion, answer):
    return 0.0
'''


@pytest.fixture
def forms(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(FORMS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for m in ("userpkg", "userpkg.scores"):
        sys.modules.pop(m, None)


@pytest.mark.parametrize("spec", ["userpkg.scores:trl_batched", "userpkg.scores.trl_batched", "FILE:trl_batched"])
def test_trls_batched_form_is_called_once_per_batch_with_the_columns_and_its_none_adds_nothing(forms, spec):
    """Each way of naming it (module:function, TRL's dotted path, verl's file path); `answer` reaches it
    as a column; None (not applicable) is NaN in its own values and 0 in the weighted sum."""
    spec = spec.replace("FILE", str(forms / "userpkg" / "scores.py"))
    s = Scorer([spec, "minirl.rewards:count"], [1.0, 0.5])
    assert s.kinds == ["trl", "minirl"] and s.names == ["trl_batched", "count"]
    rows = [{"prompt": "q", "answer": a} for a in ("3", "9", "3")]
    total, parts = s(["3", "9", "4"], ["3", "9", "3"], [False] * 3, rows, [[1], [2], [3]])
    assert total == [1.5, 0.5, 0.0]
    assert parts[0][0] == 1.0 and math.isnan(parts[0][1]) and parts[0][2] == 0.0


def test_the_built_in_tasks_rows_give_a_trl_function_its_prompts_and_answer_column(forms):
    """The built-in task's problems carry a data row's columns, so a TRL function tried on it first gets
    `prompts` and `answer` as it would from a dataset (it once got no columns and prompts of None)."""
    task = make_task(TaskConfig(reward=["userpkg.scores:trl_batched", "userpkg.scores:trl_prompts"]), seed=0)
    rows = [task.train_problem(i) for i in range(3)]
    total, parts = task.scorer([q.answer for q in rows], [q.answer for q in rows], [False] * 3, [q.row for q in rows])
    assert parts[1] == [float(len(q.prompt)) for q in rows]
    assert all(v == 1.0 or math.isnan(v) for v in parts[0]) and any(v == 1.0 for v in parts[0])


def test_a_trl_function_gets_as_prompts_the_column_the_prompt_key_names(forms):
    """GSM8K as the hub keeps it, read with --task.prompt-key question: a TRL function's `prompts` were None
    (it read the column `prompt`), and one that reads them failed at the flags' check."""
    f = forms / "gsm8k.jsonl"
    f.write_text("".join(json.dumps({"question": "q" * i, "answer": f"#### {i}"}) + "\n" for i in range(1, 11)))
    task = make_task(TaskConfig(name="jsonl", path=str(f), prompt_key="question", eval_prompts=0,
                                reward=["userpkg.scores:trl_prompts"]), seed=0)
    rows = [task.train_problem(i) for i in range(3)]
    total, parts = task.scorer(["1"] * 3, [q.answer for q in rows], [False] * 3, [q.row for q in rows])
    assert parts == [[float(len(q.prompt)) for q in rows]] and sorted(parts[0]) != [1.0] * 3


def test_a_column_some_rows_lack_reaches_a_trl_function_as_none_in_those_rows(tmp_path, monkeypatch):
    """`datasets` gives every row every column of its file (None where a line has none), and TRL passes them all:
    a function that names a column only some lines have was refused at the check, or failed the run at the
    first batch whose first row lacked it."""
    (tmp_path / "hinted.py").write_text("def hinted(completions, hint, **kw):\n"
                                        "    return [float(h is not None) for h in hint]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i), **({"hint": "h"} if i % 3 else {})}) + "\n"
                         for i in range(12)))
    task = make_task(TaskConfig(name="jsonl", path=str(f), eval_prompts=0, reward=["hinted:hinted"]), seed=0)
    rows = sorted((task.train_problem(i) for i in range(12)), key=lambda q: int(q.answer) % 3 != 0)  # one without first
    values = task.scorer(["1"] * 12, [q.answer for q in rows], [False] * 12, [q.row for q in rows])[1][0]
    assert values == [float(int(q.answer) % 3 != 0) for q in rows] and 0 < sum(values) < 12
    assert next(q.row for q in rows if q.answer == "3") == {"prompt": "q3", "answer": "3", "hint": None}


def test_a_trl_function_gets_the_trainer_state_at_the_step_its_batch_was_sampled(forms):
    """TRL passes `trainer_state` to every reward function; a curriculum that names it was refused at the
    flags' check ("missing 1 required positional argument")."""
    task = make_task(TaskConfig(reward=["userpkg.scores:trl_curriculum"]), seed=0, steps=40)
    assert task.scorer(["1"], ["1"], [False], [{}], [[1]], step=7)[1] == [[7.4]]
    assert task.scorer(["1"], ["1"], [False])[1] == [[0.4]]  # the check before the first step: step 0


def test_a_trl_function_that_names_only_completion_ids_or_prompts_is_called_as_trl_calls_it(forms):
    s = Scorer(["userpkg.scores:overlong", "userpkg.scores:trl_prompt_lengths"], [])
    assert s.kinds == ["trl", "trl"]
    total, parts = s(["a", "abc"], ["", ""], [False, False], [{"prompt": "q"}, {"prompt": "qq"}], [[1, 2], [1, 2, 3]])
    assert parts == [[-0.0, -1.0], [1.0, 2.0]] and total == [1.0, 1.0]


def test_an_async_reward_function_is_run_to_its_result(forms):
    """It returned a coroutine, "not a list of 2 floats" (TRL awaits one: inspect.iscoroutinefunction)."""
    s = Scorer(["userpkg.scores:trl_judge", "userpkg.scores:verl_async"], [])
    assert s.kinds == ["trl", "verl"]
    rows = [{"prompt": "q", "answer": a} for a in ("3", "4")]
    total, parts = s(["3", "5"], ["3", "4"], [False, False], rows)
    assert parts == [[1.0, 0.0], [1.0, 0.0]] and total == [2.0, 0.0]


def test_verls_compute_score_gets_its_keywords_and_its_dict_score_is_read_one_row_or_a_batch_at_a_time(forms):
    s = Scorer(["userpkg.scores:verl_score", "userpkg.scores:verl_keywords"], [])
    assert s.kinds == ["verl", "verl"]
    rows = [{"data_source": "gsm8k", "extra_info": {"i": 0}}] * 2
    total, parts = s(["42", "41"], ["42", "42"], [False, False], rows)
    assert parts == [[1.0, 0.0], [1.0, 0.0]] and total == [2.0, 0.0]
    batched = Scorer(["userpkg.scores:verl_batch"], [])  # verl's `batch` reward manager's form
    assert batched.kinds == ["verl_batch"]
    rows = [{"data_source": "gsm8k", "extra_info": {"i": 5}}, {"data_source": "math", "extra_info": {"i": 6}}]
    total, parts = batched(["42", "42"], ["42", "41"], [False, False], rows)
    assert total == [1.0, 0.0] and parts[0] == [1.0, 0.0] and parts[1][0] == 5.0 and math.isnan(parts[1][1])
    assert batched.names == ["verl_batch", "verl_batch/row"]  # a dict's other numbers are logged by row


@pytest.mark.parametrize("name, says", [
    ("wrong_arity", "TypeError"), ("says_yes", "returned str 'yes', not a number"),
    ("nan", "not a finite number"), ("exits", "SystemExit"),
    ("makes_one", "'): name a function it makes, e.g. `overlong = get_soft_overlong_punishment(...)` in a file"),
])
def test_a_reward_that_cannot_be_called_so_is_refused_before_any_model_naming_it(forms, name, says):
    s = Scorer([f"userpkg.scores:{name}"], [])
    with pytest.raises(ConfigError, match=rf"--task.reward userpkg.scores:{name} failed on an empty completion and the first training row: "
                                          rf".*{re.escape(says)}.*it is called as f\(completion: str, answer: str\)"):
        s.check(rewards_row())


def rewards_row():
    from minirl.tasks import Problem
    return Problem("q", "3", {"prompt": "q", "answer": "3"})


def test_a_reward_that_exits_during_the_run_ends_it_naming_the_function(forms):
    """A library's exit() inside a reward must not end the run as if it had finished (exit 0, nothing saved)."""
    with pytest.raises(rewards.RewardError, match=r"userpkg.scores:exits failed on the completion '3'.*SystemExit"):
        Scorer(["userpkg.scores:exits"], [])(["3"], ["3"], [False])


def test_a_batched_function_that_fails_is_named_with_the_first_completion_of_its_batch(forms):
    """A TRL function is called once a batch: the line cannot say which row failed, and says so."""
    with pytest.raises(rewards.RewardError, match=re.escape("trl_batched failed on the completion '3' (the first of "
                                                            "the batch): TypeError")):
        Scorer(["userpkg.scores:trl_batched"], [])(["3", "4"], ["3", "3"], [False, False], [{}, {}])
    with pytest.raises(rewards.RewardError, match=re.escape("trl_batched failed on the completion '3': TypeError")):
        Scorer(["userpkg.scores:trl_batched"], [])(["3"], ["3"], [False], [{}])


def test_scoring_leaves_the_timeout_signals_handler_as_it_found_it():
    """The timeout's handler is set for each call and the one before put back, not the default."""
    def mine(signum, frame):
        pass
    before = signal.signal(rewards.LATE, mine)
    try:
        assert Scorer(["minirl.rewards:count"], [])(["3"], ["3"], [False])[0] == [1.0]
        assert signal.getsignal(rewards.LATE) is mine
    finally:
        signal.signal(rewards.LATE, before)


def test_a_reward_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rw.py").write_text("def f(c, a):\n    return 1.0 +\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"--task.reward='broken_rw:f': importing broken_rw failed: SyntaxError"):
        rewards.load("broken_rw:f")


def test_a_reward_file_is_imported_as_import_would_so_its_dataclasses_work_and_its_errors_are_its_own(tmp_path):
    """A file named by path was run as a module `import` never registers: a @dataclass in it under `from __future__
    import annotations` failed (dataclasses look the module up), and was reported as "has no f". It is imported
    once, registered, for every spec naming it; what its import raises is said as such."""
    (tmp_path / "dc_rw.py").write_text(
        "from __future__ import annotations\nimport dataclasses, typing\nruns = []\nruns.append(1)\n"
        "@dataclasses.dataclass\nclass Parsed:\n    limit: typing.ClassVar[int] = 3\n    text: str = ''\n"
        "def f(completion, answer):\n    return float(Parsed(completion).text == answer)\n"
        "def g(completion, answer):\n    return float(len(runs))\n")
    (tmp_path / "attr_rw.py").write_text("import os\nos.no_such_thing\ndef f(completion, answer):\n    return 1.0\n")
    s = Scorer([f"{tmp_path}/dc_rw.py:f", f"{tmp_path}/dc_rw.py:g"], [])
    assert s(["3", "4"], ["3", "3"], [False, False])[1] == [[1.0, 0.0], [1.0, 1.0]]  # imported once: one run
    with pytest.raises(ConfigError, match=r"importing .*attr_rw.py failed: AttributeError: module 'os' has no"):
        rewards.load(f"{tmp_path}/attr_rw.py:f")
    with pytest.raises(ConfigError, match=r"dc_rw.py has no h$"):
        rewards.load(f"{tmp_path}/dc_rw.py:h")


def test_a_reward_file_is_importable_by_name_in_a_spawned_process_pool(tmp_path):
    """A sandbox or a slow parser scored in a process pool: a spawned worker (forkserver is Python 3.14's
    default) imports the function it runs by its module's name, which a file named by path did not have."""
    (tmp_path / "pool_rw.py").write_text(
        "import multiprocessing\ndef one(text):\n    return float(text == '3')\n"
        "def f(completions, **kw):\n    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
        "        return pool.map_async(one, completions).get(30)\n")  # the old code's lost task: no hang
    (tmp_path / "json.py").write_text("def f(completion, answer):\n    return 1.0\n")  # another module's name
    assert Scorer([f"{tmp_path}/pool_rw.py:f"], [])(["3", "4"], ["3", "3"], [False, False])[0] == [1.0, 0.0]
    assert rewards.load(f"{tmp_path}/json.py:f")("", "") == 1.0 and "loads" in dir(sys.modules["json"])


def test_a_reward_module_in_the_working_directory_is_found_as_with_python_m(tmp_path, monkeypatch):
    (tmp_path / "here_rw.py").write_text("def f(completion, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert rewards.load("here_rw:f")("", "") == 1.0
    sys.modules.pop("here_rw", None)


def test_a_reward_that_never_pays_is_warned_about_once_after_ten_batches(forms):
    s = Scorer(["userpkg.scores:never_pays"], [])
    said = []
    s.say = said.append
    for _ in range(9):
        s.watch(s(["7"], ["3"], [False])[0], ["7"], ["3"], [False], [[0.0]])
    assert said == []  # nine all-zero batches: not yet
    s.watch(s(["7"], ["3"], [False])[0], ["7"], ["3"], [False], [[0.0]])
    assert len(said) == 1 and "first 10 steps" in said[0] and "'7' against the answer '3'" in said[0]  # the tenth
    assert "the format" in said[0] and "--rollout.max-tokens" not in said[0]
    for _ in range(15):
        s.watch(s(["7"], ["3"], [False])[0], ["7"], ["3"], [False], [[0.0]])
    assert len(said) == 1  # once
    paid = Scorer(["minirl.rewards:count"], [])
    paid.say = said.append
    for r in ([0.0], [1.0]) + ([0.0],) * 12:
        paid.watch(r, ["x"], ["3"], [False], [r])
    assert len(said) == 1  # a run that paid once is never warned


def test_a_run_whose_completions_the_cap_cuts_is_told_to_raise_the_cap():
    """The right answer cut at the cap earns 0 from every function: the warning names the flag, not the format."""
    s = Scorer(["minirl.rewards:count"], [])
    said = []
    s.say = said.append
    for _ in range(10):
        rewards, _ = s(["3", "3", "2"], ["3"] * 3, [True, True, False])
        s.watch(rewards, ["3"] * 3, ["3"] * 3, [True, True, False], [[0.0] * 3])
    assert len(said) == 1 and "2 of this batch's 3 completions were cut at --rollout.max-tokens" in said[0]
    half = Scorer(["minirl.rewards:count"], [])  # "most" is more than half: two of four cut is the format's turn
    half.say = said.append
    for _ in range(10):
        half.watch([0.0] * 4, ["2"] * 4, ["3"] * 4, [True, True, False, False], [[0.0] * 4])
    assert len(said) == 2 and "Check the function and the format" in said[1]


def test_two_functions_of_one_name_are_logged_by_their_full_names(tmp_path):
    """reward/<name> must not merge two functions: the same name in two files is logged by each spec."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "score.py").write_text(f"def f(completion, answer):\n    return {1.0 if d == 'a' else 0.5}\n")
    specs = [f"{tmp_path}/a/score.py:f", f"{tmp_path}/b/score.py:f", "minirl.rewards:count"]
    s = Scorer(specs, [])
    assert s.names == specs[:2] + ["count"]
    assert s(["1"], ["1"], [False])[1] == [[1.0], [0.5], [1.0]]  # each file's own function


@pytest.mark.parametrize("answer, right, wrong", [
    ("3rd street", "#### 3rd Street.", "#### 3"),  # a text reference that begins with a digit stays text
    ("1000", "#### 1,000", "#### 100"),
])
def test_a_reference_is_compared_as_a_number_only_when_it_is_one(tmp_path, answer, right, wrong):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": f"#### {answer}"}) + "\n" for i in range(5)))
    t = make_task(TaskConfig(name="jsonl", path=str(f), eval_prompts=0), 0)
    assert t.rows[0].answer == answer
    assert t.scorer([right, wrong], [answer] * 2, [False, False])[0] == [1.0, 0.0]


@pytest.mark.serial  # its bound on the wall clock is tight: it runs with no other test beside it
def test_a_reward_that_has_not_returned_is_named_and_the_timeout_ends_it_even_through_except_exception(
        tmp_path, monkeypatch):
    """A judge call without a timeout: a line names the function and the completion it is on, and
    --task.reward-timeout ends it (RewardTimeout: exit 2) though the function catches every Exception."""
    (tmp_path / "slow_rw.py").write_text(
        "import time\n"
        "def slow(completion, answer):\n    if completion == '7':\n        time.sleep(0.6)\n    return 1.0\n"
        "def stuck(completion, answer):\n    while completion == '7':\n        try:\n            time.sleep(100)\n"
        "        except Exception:\n            pass\n    return 1.0\n")
    monkeypatch.setattr(rewards, "WARN_S", 0.2)
    said, threads = [], threading.active_count()
    s = Scorer([f"{tmp_path}/slow_rw.py:slow"], [])
    s.say = said.append
    assert s(["3", "7"], ["3", "3"], [False, False])[0] == [1.0, 1.0]  # slow but within no limit: it goes on
    assert said and said[0].startswith(f"warning: --task.reward {tmp_path}/slow_rw.py:slow has not returned for 0 s, "
                                       "on the completion '7'") and "--task.reward-timeout" in said[0]
    monkeypatch.setattr(rewards, "WARN_S", 60.0)  # as shipped: the one line comes at half the timeout
    s = Scorer([f"{tmp_path}/slow_rw.py:stuck"], [], timeout=1.0)
    said.clear()
    s.say = said.append
    t0 = time.monotonic()
    with pytest.raises(rewards.RewardTimeout, match=r"slow_rw.py:stuck failed on the completion '7': no return "
                                                    r"within --task.reward-timeout=1 s") as e:
        s(["3", "7"], ["3", "3"], [False, False])
    assert e.value.code == 2 and 0.9 < time.monotonic() - t0 < 1.4  # at the timeout, not later
    assert len(said) == 1 and re.search(r"has not returned for [01] s, on the completion '7'$", said[0])
    assert signal.getsignal(rewards.LATE) in (signal.SIG_DFL, None) and threading.active_count() == threads


def test_the_timeout_holds_for_a_reward_that_cancels_an_alarm_of_its_own_or_catches_the_first_stop(tmp_path):
    """math_verify (under TRL's accuracy_reward and verl's math_verify.py) bounds each parse by SIGALRM and
    ends with alarm(0), which cancelled the timer minirl once kept on the same alarm: the function then ran
    unwatched. Its own alarm still reaches its own handler, and the timeout still ends it; so it does a judge
    whose bare `except:` catches the first stop."""
    (tmp_path / "alarm_rw.py").write_text(
        "import signal, time\n"
        "def parse_then_hang(completion, answer):\n"
        "    def handler(signum, frame):\n        raise TimeoutError('its own')\n"
        "    old = signal.signal(signal.SIGALRM, handler)\n    signal.alarm(1)\n"
        "    try:\n        time.sleep(5)\n        ended = 'slept'\n    except TimeoutError:\n        ended = 'alarm'\n"
        "    finally:\n        signal.alarm(0)\n        signal.signal(signal.SIGALRM, old)\n"
        "    if completion == '7':\n        time.sleep(20)\n    return float(ended == 'alarm')\n"
        "def swallows_one(completion, answer):\n    try:\n        time.sleep(20)\n    except BaseException:\n"
        "        time.sleep(20)\n    return 1.0\n")
    s = Scorer([f"{tmp_path}/alarm_rw.py:parse_then_hang"], [], timeout=2.5)
    s.say = lambda line: None
    t0 = time.monotonic()
    assert s(["3"], ["3"], [False])[0] == [1.0]  # its alarm ended its sleep, as it meant to
    with pytest.raises(rewards.RewardTimeout, match="no return within --task.reward-timeout=2.5 s"):
        s(["3", "7"], ["3", "3"], [False, False])
    assert time.monotonic() - t0 < 8  # ended at the timeout, not after the 20 s sleep
    s = Scorer([f"{tmp_path}/alarm_rw.py:swallows_one"], [], timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(rewards.RewardTimeout):
        s(["3"], ["3"], [False])
    assert time.monotonic() - t0 < 5  # the stop came again


def test_a_reward_that_catches_every_stop_of_the_timeout_ends_the_process_naming_it(tmp_path):
    """A judge whose retry loop catches BaseException catches each stop the timeout sends: the run hung
    for ever under --task.reward-timeout. After GRACE_S more of stops the process exits 2 with the line."""
    (tmp_path / "deaf_rw.py").write_text(
        "import time\n"
        "def deaf(completion, answer):\n    while True:\n        try:\n            time.sleep(20)\n"
        "        except BaseException:\n            pass\n")
    code = ("import sys; from minirl import rewards; rewards.GRACE_S = 1.0\n"
            f"s = rewards.Scorer([{str(tmp_path / 'deaf_rw.py')!r} + ':deaf'], [], timeout=1.0)\n"
            "s(['3'], ['3'], [False])\nprint('SCORED')\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "SCORED" not in done.stdout, done.stderr[-2000:]
    assert re.search(r"minirl: error: --task.reward .*deaf_rw.py:deaf failed on the completion '3': no return within "
                     r"--task.reward-timeout=1 s, nor in 1 s of stops it caught; the process exits", done.stderr)
    assert time.monotonic() - t0 < 30  # the timeout and the grace, and the interpreter's start


def test_each_form_gets_the_keywords_it_takes_and_numbers_of_any_kind_count(tmp_path, monkeypatch):
    """A TRL function that reads its columns through **kwargs gets them all; a verl function without
    `extra_info` is not handed one; verl's scorer of a data source that names the completion otherwise
    (geo3k.py's `predict_str`: verl calls it by position) is called by position, it was refused for a
    missing `predict_str`; a reward returned as a numpy or torch scalar is a number."""
    (tmp_path / "kw_rw.py").write_text(
        "import numpy, torch\n"
        "def trl_kwargs(completions, **kwargs):\n    return [float(c == a) for c, a in zip(completions, kwargs['answer'])]\n"
        "def verl_plain(data_source, solution_str, ground_truth):\n    return float(solution_str == ground_truth)\n"
        "def as_numpy(completion, answer):\n    return numpy.float32(completion == answer)\n"
        "def as_torch(completion, answer):\n    return torch.tensor(float(completion == answer))\n"
        "def geo3k(predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:\n"
        "    return float(predict_str == ground_truth)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = Scorer(["kw_rw:trl_kwargs", "kw_rw:verl_plain", "kw_rw:as_numpy", "kw_rw:as_torch", "kw_rw:geo3k"], [])
    rows = [{"prompt": "q", "answer": a} for a in ("3", "4")]
    total, parts = s(["3", "5"], ["3", "4"], [False, False], rows)
    assert parts == [[1.0, 0.0]] * 5 and total == [5.0, 0.0] and s.kinds[1:] == ["verl", "minirl", "minirl", "minirl"]
    assert rewards.RewardError("f", "on", "why").code == 1 and rewards.RewardTimeout("f", "on", "why").code == 2


def test_a_trl_function_returning_a_list_of_the_wrong_length_is_refused(tmp_path, monkeypatch):
    (tmp_path / "short_rw.py").write_text("def short(completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(rewards.RewardError, match=r"returned list '\[1.0\]', not a list of 2 floats"):
        Scorer(["short_rw:short"], [])(["3", "4"], ["3", "4"], [False, False])


def test_a_trl_function_may_return_any_sequence_trl_iterates(tmp_path, monkeypatch):
    """TRL reads a reward function's result by iterating it, so a NumPy array, a tensor or a generator
    runs there; they were refused as "not a list of 2 floats". A text or a dict still is."""
    (tmp_path / "seq_rw.py").write_text(
        "import numpy, torch\n"
        "def as_array(completions, answer, **kw):\n    return numpy.array([c == a for c, a in zip(completions, answer)])\n"
        "def as_tensor(completions, answer, **kw):\n    return torch.tensor([float(c == a) for c, a in zip(completions, answer)])\n"
        "def as_generator(completions, answer, **kw):\n    return (float(c == a) for c, a in zip(completions, answer))\n"
        "def as_objects(completions, answer, **kw):\n    return numpy.array([None, 1.0], dtype=object)\n"
        "def as_text(completions, **kw):\n    return '10'\n"
        "def as_dict(completions, **kw):\n    return {'a': 1.0, 'b': 0.0}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = Scorer([f"seq_rw:as_{k}" for k in ("array", "tensor", "generator", "objects")], [])
    rows = [{"prompt": "q", "answer": a} for a in ("3", "4")]
    total, parts = s(["3", "5"], ["3", "4"], [False, False], rows)
    assert parts[:3] == [[1.0, 0.0]] * 3 and math.isnan(parts[3][0]) and parts[3][1] == 1.0 and total == [3.0, 1.0]
    for kind, shown in (("text", "str '10'"), ("dict", "dict")):
        with pytest.raises(rewards.RewardError, match=rf"returned {shown}.*, not a list of 2 floats"):
            Scorer([f"seq_rw:as_{kind}"], [])(["3", "4"], ["3", "4"], [False, False], rows)


def test_a_trl_functions_nan_is_its_none_and_it_gets_the_columns_trl_passes(tmp_path, monkeypatch):
    """TRL turns a None into NaN and adds neither, so a TRL function's NaN runs there (it ended the run here);
    inf still does. TRL passes every column but `prompt`, `completion` and `completion_ids`: the model's ids,
    never the dataset's (a `completion_ids` column was "got multiple values for keyword argument")."""
    (tmp_path / "nan_rw.py").write_text(
        "def nan_for_nine(completions, answer, completion_ids, **kw):\n"
        "    assert 'completion' not in kw and completion_ids == [[3], [9]]\n"
        "    return [float('nan') if a == '9' else 1.0 for a in answer]\n"
        "def inf(completions, **kw):\n    return [float('inf')] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": "q", "answer": a, "completion": "a reference", "completion_ids": [0]} for a in ("3", "9")]
    total, parts = Scorer(["nan_rw:nan_for_nine", "minirl.rewards:count"], [])(["3", "9"], ["3", "9"], [False, False],
                                                                              rows, [[3], [9]])
    assert parts[0][0] == 1.0 and math.isnan(parts[0][1]) and parts[1] == [1.0, 1.0] and total == [2.0, 1.0]
    with pytest.raises(rewards.RewardError, match="returned inf, not a finite number"):
        Scorer(["nan_rw:inf"], [])(["3"], ["3"], [False], rows[:1], [[3]])


def test_a_trl_function_sees_a_continued_prefill_open_the_completion_and_leave_the_prompt(tmp_path, monkeypatch):
    """A chat prompt's closing assistant message is continued, so the model's text follows it: TRL's GRPO, when it
    continued one, gave its functions the prefill at the completion's start and the prompt without it (a format
    reward for `^<think>` paid nothing here)."""
    (tmp_path / "think_rw.py").write_text(
        "def think(completions, prompts, **kw):\n"
        "    assert [p[-1]['role'] for p in prompts] == ['user', 'user', 'user']\n"
        "    return [float(c[0]['content'].startswith('<think>')) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ask = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "2+2?"}]
    rows = [{"prompt": ask + [{"role": "assistant", "content": "<think>"}]}, {"prompt": ask},
            {"prompt": ask + [{"role": "assistant", "content": [{"type": "text", "text": "<think>"}]}]}]  # its parts
    total, parts = Scorer(["think_rw:think"], [])(["4</think>4", "4", "4</think>4"], ["", "", ""], [False] * 3, rows)
    assert parts == [[1.0, 0.0, 1.0]] and total == [1.0, 0.0, 1.0]


def test_a_row_no_function_scores_is_said_once_as_trl_warns():
    """A row every function returned None (or NaN) for has reward 0, as in TRL, which warns of it; it was silent
    here. Said once, with the first such completion; a row one function scores is not such a row."""
    s = Scorer(["minirl.rewards:count", "minirl.rewards:gsm8k"], [])
    said = []
    s.say = said.append
    s.watch([1.0, 0.0], ["3", "4"], ["3", "5"], [False, False], [[1.0, float("nan")], [float("nan"), 0.0]])
    assert said == []
    for _ in range(3):
        s.watch([1.0, 0.0], ["3", "4"], ["3", "5"], [False, False], [[1.0, float("nan")], [1.0, float("nan")]])
    assert said == ["warning: every --task.reward returned None for '4' (answer '5'); a row no function scores has "
                    "reward 0, as in TRL"]


def test_the_numbers_a_function_logs_beside_its_reward_are_plotted_as_trl_and_verl_keep_them(tmp_path, monkeypatch):
    """TRL 1.x passes `log_metric` (a number per call, the calls' mean) and `log_extra` (a column by row); verl's
    compute_score may return a dict beside "score" (verl's `acc` is a bool). A function using TRL's failed at the
    check (KeyError: 'log_metric'); verl's were dropped. Each is now a value by row, `reward/<function>/<name>`,
    never in the reward's sum; text is not plotted, and a name the first call did not log is said once."""
    (tmp_path / "logs_rw.py").write_text(
        "def f(completions, log_metric, **kw):\n"
        "    log_metric('len', 2.0)\n    log_metric('len', 4.0)\n"
        "    kw['log_extra']('hits', [c.count('3') for c in completions])\n"
        "    kw['log_extra']('said', list(completions))\n"
        "    if completions[0] == 'late':\n        log_metric('new', 1.0)\n"
        "    return [1.0] * len(completions)\n"
        "def v(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'acc': solution_str == ground_truth, 'pred': solution_str}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = Scorer(["logs_rw:f", "logs_rw:v"], [1.0, 2.0])
    said = []
    s.say = said.append
    s.check(rewards_row())
    assert s.names == ["f", "v", "f/hits", "f/len", "v/acc"]
    total, parts = s(["33", "4"], ["33", "3"], [False, False], [{}, {}])
    assert total == [2.0, 2.0] and parts == [[1.0, 1.0], [0.5, 0.5], [2.0, 0.0], [3.0, 3.0], [1.0, 0.0]]
    metrics = sample_metrics(torch.tensor(total), 2, [1, 1], [False, False], dict(zip(s.names, parts)))
    assert (metrics["reward/f/len"], metrics["reward/f/hits"], metrics["reward/v/acc"]) == (3.0, 1.0, 0.5)
    assert said == []
    for _ in range(2):
        s(["late"], ["3"], [False], [{}])
    assert said == ["warning: logs_rw:f 'new' not plotted: a function's numbers are those its first call logs"]
    sys.modules.pop("logs_rw", None)
