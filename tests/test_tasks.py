"""tasks.py: deterministic prompt ids and partition (B14), held-out data, the task's scorer."""

import json
import os
import re

import pytest

from minirl.config import ConfigError, TaskConfig, data_files
from minirl.tasks import CountTask, JsonlTask, dp_partition, make_task, prompt_id


def test_prompt_ids_are_deterministic_monotonic_and_shard_scoped():
    ids = [prompt_id(0, i) for i in range(100)]
    assert ids == sorted(ids) and len(set(ids)) == 100
    assert ids == [prompt_id(0, i) for i in range(100)]
    assert not set(ids) & {prompt_id(1, i) for i in range(100)}


def test_dp_partition_sorts_by_group_then_id_and_keeps_groups_whole():
    keys = [(g, j) for g in (5, 3, 9, 1) for j in (2, 0, 1)]
    parts = [dp_partition(keys, r, 2) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(12))
    assert [keys[i] for i in parts[0]] == [(1, 0), (1, 1), (1, 2), (3, 0), (3, 1), (3, 2)]
    shuffled = keys[::-1]  # arrival order does not matter: the same rows land on the same rank
    assert {shuffled[i] for i in dp_partition(shuffled, 1, 2)} == {keys[i] for i in parts[1]}


def test_count_task_is_a_pure_function_of_seed_and_index_and_held_out_is_disjoint():
    a, b = CountTask(0, 64), CountTask(0, 64)
    assert [a.train_problem(i) for i in range(50)] == [b.train_problem(i) for i in range(50)]
    held = {p.prompt for p in a.eval_set}
    assert len(a.eval_set) == 64
    assert not held & {a.train_problem(i).prompt for i in range(3000)}
    p = a.train_problem(7)
    assert p.answer == str(p.prompt.split("#")[0].count("a"))


def test_jsonl_task_gsm8k_answers(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": f"q{i}", "answer": f"work... #### {i},000"} for i in range(20)]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    t = JsonlTask(str(f), seed=0, eval_prompts=4)
    assert len(t.eval_set) == 4 and len(t.rows) == 16
    p = t.train_problem(0)
    n = p.prompt[1:]
    assert p.answer == f"{n}000"


def test_jsonl_task_takes_held_out_prompts_from_a_separate_file(tmp_path, capsys):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(10)))
    test.write_text("\n".join(json.dumps({"prompt": f"t{i}", "answer": f"#### {i}"}) for i in range(6)))
    t = JsonlTask(str(train), seed=0, eval_prompts=4, eval_path=str(test))
    assert len(t.rows) == 10 and [p.prompt for p in t.eval_set] == ["t0", "t1", "t2", "t3"]
    assert "repeat a held-out prompt" not in capsys.readouterr().out


def test_held_out_prompts_that_are_also_training_prompts_are_said(tmp_path, capsys):
    """--task.eval-path given the training file (or a test set holding training prompts): eval_accuracy then
    scores prompts the run trains on, and a line says so; the training rows are the file's, as given."""
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(10)))
    t = JsonlTask(str(train), seed=0, eval_prompts=4, eval_path=str(train))
    assert len(t.rows) == 10 and len(t.eval_set) == 4
    assert (f"--task.path={str(train)!r}: 4 training row(s) repeat a held-out prompt of --task.eval-path="
            f"{str(train)!r}: eval_accuracy partly scores prompts the run trains on") in capsys.readouterr().out


def test_prompt_over_the_budget_is_an_error_not_cut():
    from minirl.launch import resolve_path
    from minirl.models import load_tokenizer
    from minirl.config import ModelConfig
    from minirl.tasks import encode_prompts
    import pytest
    tok = load_tokenizer(resolve_path(ModelConfig()))
    assert encode_prompts(tok, ["ab#a="], 5) == [tok("ab#a=", add_special_tokens=False).input_ids]
    assert encode_prompts(tok, [], 5) == []  # a rank with no prompts this call
    with pytest.raises(ValueError, match="--rollout.max-prompt-tokens=4"):
        encode_prompts(tok, ["ab", "ab#a="], 4)


@pytest.mark.parametrize("line, says", [
    ('{"prompt": null, "answer": "1"}', '"prompt" must be a string or a list of chat messages'),
    ('{"prompt": "q", "answer": true}', 'the answer (answer or solution or reward_model.ground_truth) must be a '
                                        'string or a number, got a bool; name its column with --task.answer-key'),
    ('{"prompt": {"text": "q"}, "answer": "1"}', '"prompt" must be a string or a list of chat messages'),
    ('{"prompt": [{"role": "user"}], "answer": "1"}', '"prompt" must be a string or a list of chat messages'),
    ('{"prompt": [{"content": "q"}], "answer": "1"}', 'got message 1 as {"content": "q"} (its role and content'),
    ('{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "image_url", '
     '"image_url": {"url": "a.png"}}]}], "answer": "1"}', 'got message 2 as {"role": "user", "content": [{"type": '
                                                         '"image_url", "image_url": {"url": "a.png"}}]} (its role and '
                                                         'content must be text or text parts)'),  # an image part
    ('{"prompt": "q"}', 'the answer (answer or solution or reward_model.ground_truth) must be a string or a number, '
                        'got missing'),
    ('{"prompt": "q", "answer": {"target": ["1"]}}', 'must be a string or a number, got a dict; name its column with '
                                                     '--task.answer-key (a list or an object reaches a --task.reward'),
    ('{"answer": "1"}', '"prompt" must be a string or a list of chat messages [{"role": ..., "content": ...}], '
                        'got missing'),
    ('[1, 2]', "expected an object"),
    ('{"prompt": "q", ', "not JSON"),
    ('{"prompt": "  ", "answer": "1"}', "the prompt is empty"),  # it crashed the step that reached it, each resume
])
def test_a_bad_jsonl_line_is_refused_naming_file_and_line(tmp_path, line, says):
    """Not turned into the string "None" (which could never earn a reward), nor found at step 0."""
    f = tmp_path / "train.jsonl"
    f.write_text('{"prompt": "ab#a=", "answer": "1"}\n' * 3 + line + "\n")
    with pytest.raises(ConfigError, match=rf"--task\.path: {f}:4: .*{re.escape(says)}"):
        JsonlTask(str(f), seed=0, eval_prompts=0)


@pytest.mark.parametrize("text, says", [
    ('[{"prompt": "ab#a=", "answer": "1"},\n 5]', "row 2: expected an object"),
    ('[{"prompt": "ab#a=", "answer": "1"},', "not a JSON array of rows, nor JSONL"),
])
def test_a_bad_json_array_is_refused_naming_the_file_and_row(tmp_path, text, says):
    f = tmp_path / "train.json"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"--task\.path: {f}: {re.escape(says)}"):
        JsonlTask(str(f), seed=0, eval_prompts=0)


def test_a_prompt_over_the_budget_is_found_when_the_task_loads(tmp_path, tiny_path):
    from minirl.models import load_tokenizer
    f, held = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    f.write_text('{"prompt": "ab#a=", "answer": "1"}\n' * 3)
    held.write_text('{"prompt": "ab#a=", "answer": "1"}\n{"prompt": "' + "ab" * 20 + '#a=", "answer": "1"}\n')
    cfg = TaskConfig(name="jsonl", path=str(f), eval_path=str(held))
    with pytest.raises(ConfigError, match=rf"--task\.eval-path: {held}:2: the prompt has more than "
                                          r"--rollout\.max-prompt-tokens=32 tokens"):
        make_task(cfg, 0, load_tokenizer(tiny_path), 32)
    with pytest.raises(ConfigError, match=r"--rollout\.max-prompt-tokens=8: the built-in task's prompts take up to 12"):
        make_task(TaskConfig(), 0, load_tokenizer(tiny_path), 8)
    rows = [{"prompt": format(i, "012b").translate({48: "a", 49: "b"}) + "#a=", "answer": "1"} for i in range(2500)]
    for line in (1500, 2100):  # tokenized 1,024 to a call: the first too long is named, then how many, the longest
        rows[line - 1]["prompt"] = "ab" * 20 + "#a="
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=rf"--task\.path: {f}:1500: the prompt has more than --rollout\.max-prompt-"
                                          r"tokens=32 tokens \(2 of the 2500 prompts do; the longest has 43\); raise"):
        make_task(TaskConfig(name="jsonl", path=str(f)), 0, load_tokenizer(tiny_path), 32)
    rows[1499]["prompt"] = rows[2099]["prompt"] = "a" * 29 + "#a="  # 32 tokens: the budget holds it
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok, calls = load_tokenizer(tiny_path), []

    class Counted:  # the tokenizer, counting its calls: one a row took 0.3 ms each in transformers alone
        def __call__(self, text, **kwargs):
            if isinstance(text, list):  # not the one-word probe of the tokenizer's leading tokens
                calls.append(len(text))
            return tok(text, **kwargs)

        def __getattr__(self, name):
            return getattr(tok, name)
    assert len(make_task(TaskConfig(name="jsonl", path=str(f)), 0, Counted(), 32).rows) > 2000
    assert calls == [1024, 1024, 452]


def test_prompts_over_the_budget_are_left_out_as_the_task_loads_when_asked_saying_how_many(tmp_path, tiny_path,
                                                                                             capsys):
    """verl's data.filter_overlong_prompts: --task.filter-overlong-prompts leaves the prompts over
    --rollout.max-prompt-tokens out of both sets, a line for each file; without it, the error names the flag."""
    from minirl.models import load_tokenizer
    f, held = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    long, full = "ab" * 20 + "#a=", "a" * 29 + "#a="  # 43 tokens, and 32: the budget holds it
    f.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in ["ab#a=", long, full, long]))
    held.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in [long, "a#a="]))
    cfg = TaskConfig(name="jsonl", path=str(f), eval_path=str(held))
    with pytest.raises(ConfigError, match=r"raise the flag, shorten the prompts, or leave them out with "
                                          r"--task\.filter-overlong-prompts$"):
        make_task(cfg, 0, load_tokenizer(tiny_path), 32)
    with pytest.raises(ConfigError, match=r"--task\.filter-overlong-prompts$"):  # the task's own default: refused
        JsonlTask(str(f), 0, 0, tok=load_tokenizer(tiny_path), limit=32)
    cfg.filter_overlong_prompts = True
    task = make_task(cfg, 0, load_tokenizer(tiny_path), 32)
    assert sorted(p.prompt for p in task.rows) == sorted(["ab#a=", full])
    assert [p.prompt for p in task.eval_set] == ["a#a="]
    said = capsys.readouterr().out
    assert (f"--task.path={str(f)!r}: 2 of the 4 prompts have more than --rollout.max-prompt-tokens=32 tokens and "
            "are left out") in said
    assert f"--task.eval-path={str(held)!r}: 1 of the 2 prompts have more than" in said


def test_a_prompt_given_twice_is_never_both_trained_on_and_held_out(tmp_path, capsys):
    """Duplicate lines in one file: every copy of a held-out prompt leaves the training rows, with a line."""
    f = tmp_path / "train.jsonl"
    f.write_text("".join(f'{{"prompt": "q{i % 10}", "answer": "{i % 10}"}}\n' for i in range(40)))
    task = JsonlTask(str(f), seed=0, eval_prompts=8)
    held = {p.prompt for p in task.eval_set}
    assert held and not held & {p.prompt for p in task.rows}
    assert len(task.rows) == 40 - 4 * len(held)  # each prompt is 4 of the 40 lines
    assert f"{3 * len(held)} training row(s) repeat a held-out prompt; left out of training" in capsys.readouterr().out


def test_a_file_whose_every_line_repeats_a_held_out_prompt_has_no_training_prompts(tmp_path):
    """Ten copies of one line: two are held out, and the other eight repeat them, so nothing is left
    to train on; refused naming the file, rather than a run of empty steps."""
    f = tmp_path / "same.jsonl"
    f.write_text('{"prompt": "abba#a=", "answer": "2"}\n' * 10)
    with pytest.raises(ConfigError, match=r"--task\.path=.*same\.jsonl.*: no training prompts"):
        JsonlTask(str(f), seed=0, eval_prompts=2)


def test_a_jsonl_file_that_is_not_utf8_is_refused_naming_it(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes('{"prompt": "caf\u00e9 #a=", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"--task\.path=.*latin1\.jsonl.*not UTF-8 text"):
        JsonlTask(str(f), seed=0, eval_prompts=0)


def test_a_run_that_evaluates_needs_held_out_prompts(tmp_path):
    """Four prompts hold none out (one in five): a run that evaluates is refused naming the fix,
    instead of logging eval_accuracy 0 on no prompts; without evaluation it runs."""
    f = tmp_path / "four.jsonl"
    f.write_text('{"prompt": "ab#a=", "answer": "1"}\n' * 4)
    cfg = TaskConfig(name="jsonl", path=str(f))
    says = r"no held-out prompts .*too few prompts.*--task\.eval-path.*--log\.eval-every 0"
    with pytest.raises(ConfigError, match=says):
        make_task(cfg, 0, evaluates=True)
    assert make_task(cfg, 0).eval_set == [] and len(make_task(cfg, 0).rows) == 4
    (tmp_path / "empty.jsonl").write_text("\n")  # a held-out file without a row: that file is named
    with pytest.raises(ConfigError, match=r"--task\.eval-path=.*empty\.jsonl' holds no prompt; .*--log\.eval-every 0"):
        make_task(TaskConfig(name="jsonl", path=str(f), eval_path=str(tmp_path / "empty.jsonl")), 0, evaluates=True)


def test_a_jsonl_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Windows editors and spreadsheet exports begin UTF-8 text with a byte-order mark; its first line
    was refused as not JSON ("Unexpected UTF-8 BOM"). A JSON array of rows too."""
    rows = [{"prompt": f"{'a' * n}#a=", "answer": str(n)} for n in range(1, 11)]
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    for name in ("bom.jsonl", "bom.json"):
        task = JsonlTask(str(tmp_path / name), seed=0, eval_prompts=0)
        assert sorted(p.prompt for p in task.rows) == sorted(r["prompt"] for r in rows)


def test_a_gzipped_jsonl_file_reads_as_its_rows_and_one_cut_short_is_named(tmp_path):
    """`.jsonl.gz`, as datasets are often kept and `datasets` reads them, was "not UTF-8 text"."""
    import gzip
    rows = [{"prompt": f"{'a' * n}#a=", "answer": str(n)} for n in range(1, 11)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
    (tmp_path / "rows.jsonl.gz").write_bytes(data)
    task = JsonlTask(str(tmp_path / "rows.jsonl.gz"), seed=0, eval_prompts=0)
    assert sorted(p.prompt for p in task.rows) == sorted(r["prompt"] for r in rows)
    (tmp_path / "cut.jsonl.gz").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match=r"--task\.path=.*cut\.jsonl\.gz.*: not a readable gzip file \(.*\); download "):
        JsonlTask(str(tmp_path / "cut.jsonl.gz"), seed=0, eval_prompts=0)
    shard = tmp_path / "shards" / "train-00000-of-00001.jsonl.gz"  # a folder of them is told to name one
    shard.parent.mkdir()
    shard.write_bytes(data)
    with pytest.raises(ConfigError, match=re.escape(f"is a folder: name a file in it ({str(shard)!r})")):
        TaskConfig(name="jsonl", path=str(shard.parent)).check()


def test_the_tiny_model_builds_into_an_empty_cache_and_loads(tmp_path, monkeypatch, capfd):
    """What a fresh machine does first (`make demo`, the suite's first fixture): build the built-in model
    into an empty cache folder, warm start included, and load it back; a second call finds it. The build
    writes nothing to stderr (transformers' "Writing model shards" bar once broke a first run's one-line
    error)."""
    from transformers.utils import logging as hf_logging
    from minirl.config import TinyModelConfig
    from minirl.models import load_policy, load_tokenizer
    from minirl.models import build_tiny
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path / "cache"))
    hf_logging.enable_progress_bar()  # as in a fresh process: an earlier load in this one turned the bars off
    capfd.readouterr()
    shape = TinyModelConfig(hidden_size=64, num_heads=1, intermediate_size=64, warm_start_steps=1)
    path = build_tiny(shape)
    assert capfd.readouterr().err == ""
    assert path.startswith(str(tmp_path / "cache")) and build_tiny(shape) == path
    policy = load_policy(path)
    assert policy.config.hidden_size == 64 and load_tokenizer(path)("ab#a=").input_ids
    written = json.loads(open(f"{path}/config.json").read())
    assert written["tie_word_embeddings"] and written.get("rope_parameters", written)["rope_theta"] == 10000.0
    wider = TinyModelConfig(hidden_size=128, num_heads=1, intermediate_size=64, warm_start_steps=0)
    assert build_tiny(wider) != path  # a second shape beside the first, in the folder that exists now
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path / "file" / "cache"))  # as a read-only home's would be
    with pytest.raises(ConfigError, match=r"built once into .*file/cache, which cannot be written \(Not a directory\); "
                                          "set MINIRL_CACHE to a folder you can write"):
        build_tiny(wider)


def test_eval_accuracy_is_the_first_reward_functions_mean_whatever_the_others_and_weights(tiny_path, tmp_path,
                                                                                          monkeypatch):
    """Several weighted rewards: eval_accuracy is the first function's own held-out mean (the strict
    scorer), never the weighted sum nor another function's; each row's `reward` is the sum."""
    from types import SimpleNamespace

    from minirl.models import load_tokenizer
    from minirl.rewards import Scorer
    from minirl.tasks import held_out
    (tmp_path / "always.py").write_text("def one(completion, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    tok = load_tokenizer(tiny_path)
    task = make_task(TaskConfig(eval_prompts=8), 0, tok, 32)
    task.scorer = Scorer(["minirl.rewards:count", "always.py:one"], [1.0, 0.5])

    class Engine:  # the right count for the first three prompts, a wrong one for the rest
        def generate(self, prompts, ids, group_size, greedy=False):
            texts = [p.answer if i < 3 else "99" for i, p in enumerate(task.eval_set)]
            return SimpleNamespace(completion_tokens=[tok(t, add_special_tokens=False).input_ids for t in texts],
                                   clipped=[False] * len(texts))
    out = held_out(Engine(), task, tok, 32)
    assert out["eval_accuracy"] == 3 / 8
    assert [r["reward"] for r in out["eval_samples"]] == [1.5] * 3 + [0.5] * 5
    # a TRL function first that scores none of the last two prompts (its None; TRL's accuracy_reward gives one
    # for a reference it cannot parse): its mean over the six it scores (it was NaN)
    (tmp_path / "trl.py").write_text("def some(completions, answer, **kw):\n"
                                     "    return [float(c == a) for c, a in zip(completions, answer)][:6] + [None] * 2\n")
    assert [r["rewards"] for r in out["eval_samples"]][2:4] == [{"count": 1.0, "one": 1.0},
                                                                 {"count": 0.0, "one": 1.0}]
    task.scorer = Scorer(["trl.py:some"], [])
    out = held_out(Engine(), task, tok, 32)
    assert out["eval_accuracy"] == 3 / 6 and [r["rewards"]["some"] for r in out["eval_samples"]][5:] == [0.0, None, None]


# ---- what tasks.py's mutation run asked for ----

def test_a_prompt_id_is_the_shard_in_the_high_bits_and_the_index_below_2_to_the_40():
    assert prompt_id(3, 5) == 3 * 2**40 + 5 and prompt_id(0, 2**40 - 1) < prompt_id(1, 0)
    with pytest.raises(AssertionError):
        prompt_id(0, 2**40)


def test_a_problem_compares_and_hashes_by_prompt_and_answer_not_its_row():
    from minirl.tasks import Problem
    a, b = Problem("q", "1", {"id": 1, "tags": ["x"]}), Problem("q", "1", {"id": 2})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


def test_about_one_string_in_eight_is_held_out_and_training_never_draws_one():
    import itertools
    every = ["".join(s) for n in range(1, 10) for s in itertools.product("ab", repeat=n)]  # all 1,022 strings
    held = {s for s in every if CountTask._held_out(s)}
    assert 0.08 < len(held) / len(every) < 0.18
    task = CountTask(0, 40)
    assert {p.prompt[:-3] for p in task.eval_set} <= held
    assert not held & {task.train_problem(i).prompt[:-3] for i in range(3000)}


def test_a_parquet_file_is_read_by_its_magic_bytes_whatever_its_name(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow
    path = tmp_path / "rows.data"
    pq.write_table(pyarrow.table({"prompt": [f"q{i}" for i in range(10)], "answer": [str(i) for i in range(10)]}),
                   path)
    task = JsonlTask(str(path), 0, 2)
    assert sorted(p.answer for p in task.rows + task.eval_set) == sorted(str(i) for i in range(10))


def test_rows_scored_by_trl_functions_alone_keep_the_answer_they_have(tmp_path):
    """No answer is needed when every reward is TRL's form (it reads its own columns), but a row's answer is
    still its reference: what samples.jsonl shows beside each held-out completion."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", **({"answer": str(i)} if i % 2 else {})}) + "\n"
                            for i in range(10)))
    task = JsonlTask(str(path), 0, 0, needs_answer=False)
    assert sorted((p.prompt, p.answer) for p in task.rows) == [(f"q{i}", str(i) if i % 2 else "") for i in range(10)]


def test_the_prompts_column_is_named_by_its_flag_so_gsm8k_from_the_hub_reads_as_it_is(tmp_path):
    """GSM8K as the hub keeps it (`openai/gsm8k`: `question`, and `answer` ending in `#### N`) runs without a
    conversion: --task.prompt-key question, as verl's data.prompt_key. Without it, the row's columns are listed
    beside the flag; the built-in task, which reads no file, refuses it."""
    rows = [{"question": f"Tom has {i} apples and buys 2. How many now?",
             "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"} for i in range(10)]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = make_task(TaskConfig(name="jsonl", path=str(path), prompt_key="question", eval_prompts=2), 0)
    assert sorted((p.prompt, p.answer) for p in task.rows + task.eval_set) == sorted(
        (r["question"], r["answer"].split("#### ")[1]) for r in rows)
    says = ('"prompt" must be a string or a list of chat messages [{"role": ..., "content": ...}], got missing '
            "(the row's columns: question, answer; name the prompt's with --task.prompt-key)")
    with pytest.raises(ConfigError, match=re.escape(says)):
        make_task(TaskConfig(name="jsonl", path=str(path)), 0)
    with pytest.raises(ConfigError, match="--task.prompt-key is for your own prompts, and --task.name is count"):
        TaskConfig(prompt_key="question").check()


def test_a_pattern_reads_a_hub_datasets_shards_in_name_order_and_a_folder_is_told_what_to_name(tmp_path):
    """A dataset downloaded from the hub is a folder of shards (`data/train-00000-of-00002.parquet`, ...): a quoted
    pattern reads every file it matches, in name order, as one file of all their rows; the folder itself, or a
    pattern that matches nothing, is refused at the check naming what to give."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow
    data = tmp_path / "hub" / "data"
    data.mkdir(parents=True)
    for shard, rows in ((1, range(5, 10)), (0, range(5))):  # written out of order: read in name order
        pq.write_table(pyarrow.table({"prompt": [f"q{i}" for i in rows], "answer": [str(i) for i in rows]}),
                       data / f"train-0000{shard}-of-00002.parquet")
    pq.write_table(pyarrow.table({"prompt": ["t"], "answer": ["0"]}), data / "test-00000-of-00001.parquet")
    cfg = TaskConfig(name="jsonl", path=str(data / "train-*.parquet"), eval_path=str(data / "test-*.parquet"))
    cfg.check()
    task = JsonlTask(cfg.path, 0, 2, cfg.eval_path)
    assert sorted(int(p.answer) for p in task.rows) == list(range(10)) and [p.prompt for p in task.eval_set] == ["t"]
    shard = data / "train-00000-of-00002.parquet"
    assert data_files(cfg.path) == [str(shard), str(data / "train-00001-of-00002.parquet")]
    for path, says in ((tmp_path / "hub", f"is a folder: name a file in it ({str(shard)!r}) or its shards by a "
                                          f"quoted pattern ({str(data / 'train-*.parquet')!r})"),
                       (data / "valid-*.parquet", "is not a file, nor a pattern that matches one"),
                       # TRL's --dataset_name, verl's hub path: minirl reads files, and says how to fetch them
                       ("openai/gsm8k", "is no local file; as a hub dataset's name, download it first (hf download "
                                        "--repo-type dataset openai/gsm8k --local-dir data/gsm8k) and name its files")):
        with pytest.raises(ConfigError, match=re.escape(f"--task.path={str(path)!r} {says}; give a JSONL")):
            TaskConfig(name="jsonl", path=str(path)).check()
    with pytest.raises(ConfigError, match=r"--task.eval-path='nope\*' is not a file.* or leave it empty"):
        TaskConfig(name="jsonl", path=cfg.path, eval_path="nope*").check()
    with pytest.raises(ConfigError, match=re.escape(f"({str(data / 'test-00000-of-00001.parquet')!r}) or its shards "
                                                    f"by a quoted pattern ({str(data / 'test-*.parquet')!r})")):
        TaskConfig(name="jsonl", path=cfg.path, eval_path=str(tmp_path / "hub")).check()


def test_a_datasets_save_to_disk_folder_is_named_and_its_arrow_files_read_as_their_rows(tmp_path):
    """What the datasets library's `save_to_disk` writes (tests/data/save_to_disk, by datasets 5.2.0: a train
    and a test split of chat prompts) is Arrow files: the folder is told which file and pattern to give, and the
    files read as their rows. An Arrow or Parquet file cut short is one line naming it, not pyarrow's traceback."""
    pytest.importorskip("pyarrow")
    saved = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "save_to_disk")
    with pytest.raises(ConfigError, match=re.escape(f"is a folder: name a file in it ('{saved}/train/data-00000-of-"
                                                    f"00001.arrow') or its shards by a quoted pattern ('{saved}/train/"
                                                    "data-*.arrow'); give a JSONL, Parquet or Arrow file")):
        TaskConfig(name="jsonl", path=saved).check()
    cfg = TaskConfig(name="jsonl", path=f"{saved}/train/data-*.arrow", eval_path=f"{saved}/test/data-*.arrow")
    cfg.check()
    task = JsonlTask(cfg.path, 0, 2, cfg.eval_path, tok=_ChatTok())
    assert sorted(p.answer for p in task.rows) == ["1", "2", "3", "4"]
    assert [p.answer for p in task.eval_set] == ["5", "6"]
    assert task.eval_set[0].prompt == "<user>How many a's in ababababab?<assistant>"
    with open(f"{saved}/train/data-00000-of-00001.arrow", "rb") as f:
        cut = f.read()[:600]
    for name, data in (("data-00000-of-00001.arrow", cut), ("rows.parquet", b"PAR1 and no more")):
        (tmp_path / name).write_bytes(data)
        kind = "Arrow" if name.endswith(".arrow") else "Parquet"
        with pytest.raises(ConfigError, match=rf"--task\.path='{tmp_path}/{name}': not a readable {kind} file \(.+\)"):
            JsonlTask(str(tmp_path / name), 0, 0)


class _ChatTok:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, continue_final_message):
        assert not tokenize and add_generation_prompt and not continue_final_message  # text, ending where the answer starts
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.mark.parametrize("tok, says", [(None, "has no chat template"), (type("Plain", (), {"chat_template": None})(),
                                                                          "has no chat template"),
                                       (_ChatTok(), "")])
def test_chat_prompts_need_a_tokenizer_with_a_chat_template(tmp_path, tok, says):
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}], "answer": "1"}) + "\n"
                         for i in range(5)))
    if says:
        with pytest.raises(ConfigError, match=f"chat.jsonl:1: the prompt is chat messages, .*{says}"):
            JsonlTask(str(f), 0, 1, tok=tok)
    else:
        task = JsonlTask(str(f), 0, 1, tok=tok)
        assert sorted(p.prompt for p in task.rows + task.eval_set) == [f"<user>q{i}<assistant>" for i in range(5)]


def test_messages_a_chat_template_refuses_are_named_by_their_row_in_one_line(tmp_path, tiny_path):
    """Gemma's template raises on a system message (Mistral's and Llama 2's on roles that do not alternate): the
    load said jinja2's traceback; it names the row, the template's reason and the way on."""
    from minirl.models import load_tokenizer
    tok = load_tokenizer(tiny_path)
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    f = tmp_path / "chat.jsonl"
    rows = [[{"role": "user", "content": "q"}], [{"role": "system", "content": "Be brief."}, {"role": "user",
                                                                                            "content": "q"}]]
    f.write_text("".join(json.dumps({"prompt": r, "answer": "1"}) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=rf"^--task\.path: {f}:2: the chat template of --model\.path refused these "
                                          r"messages \(System role not supported\); write them as it takes them"):
        JsonlTask(str(f), 0, 0, tok=tok)


class _Engine:
    def __init__(self):
        self.greedy = []

    def generate(self, prompts, ids, group_size, greedy=False):
        from minirl.rollout import Samples
        self.greedy.append(greedy)
        n = len(prompts) * group_size
        return Samples(prompt_ids=[i for i in ids for _ in range(group_size)], prompt_tokens=[[1]] * n,
                       completion_tokens=[[2]] * n, logprobs=[[-1.0]] * n, finish_reasons=["stop"] * n)


class _Tok:
    def __call__(self, text, add_special_tokens=True):  # a tokenizer that puts nothing before a text
        assert not add_special_tokens or text == "a"  # the prompts' own tokens; "a": the probe for leading ones
        ids = [[ord(ch) for ch in t] for t in text] if isinstance(text, list) else [ord(ch) for ch in text]
        return type("Enc", (), {"input_ids": ids})()  # a list of texts gives a list of rows, as transformers does

    def batch_decode(self, rows, skip_special_tokens):
        assert skip_special_tokens  # a reward never sees <eos> or pads
        return ["2" for _ in rows]


def test_training_batches_sample_and_are_watched_for_a_reward_that_never_pays_and_evals_are_greedy(monkeypatch):
    from minirl.tasks import held_out, scored
    task = make_task(TaskConfig(eval_prompts=4), 0)
    watched = []
    monkeypatch.setattr(task.scorer, "watch", lambda rewards, *rest: watched.append(len(rewards)))
    engine = _Engine()
    samples, rewards, parts = scored(engine, task, _Tok(), [task.train_problem(i) for i in range(3)], [0, 1, 2], 2, 32)
    assert engine.greedy == [False] and watched == [6] and samples.texts == ["2"] * 6 and len(parts[0]) == 6
    held_out(engine, task, _Tok(), 32)
    assert engine.greedy == [False, True] and watched == [6]


def test_a_rank_with_no_held_out_prompt_adds_no_hit_and_gets_every_row(monkeypatch):
    """One held-out prompt over two ranks: rank 1 scores none, and the accuracy and rows are rank 0's."""
    import torch
    from minirl import dist
    from minirl.tasks import held_out
    task = make_task(TaskConfig(eval_prompts=1), 0)
    row = {"prompt": task.eval_set[0].prompt, "completion": "2", "answer": "2", "reward": 1.0, "clipped": False}
    monkeypatch.setattr(dist, "all_reduce", lambda t, op="sum": t.add_(torch.tensor([1.0, 1.0])))  # rank 0: 1 of 1
    monkeypatch.setattr(dist, "gather_json", lambda rows: [[row], rows])
    assert held_out(_Engine(), task, _Tok(), 32, rank=1, world=2) == {"eval_accuracy": 1.0, "eval_samples": []}


def test_the_built_in_tasks_problems_and_held_out_set_are_the_recorded_ones():
    """Every run of the built-in task, on any version, trains on the same problems and scores the same
    held-out strings, so eval_accuracy compares across runs; a change here changes every demo's numbers."""
    import itertools
    task = CountTask(0, 3)
    assert [task.train_problem(i).prompt for i in range(6)] == ["b#a=", "bbab#a=", "ab#a=", "bb#a=", "aabaaaa#a=",
                                                               "aaaaaaa#a="]
    assert [p.prompt for p in task.eval_set] == ["aaabaa#a=", "abaaba#a=", "bbabaa#a="]
    assert [p.prompt for p in CountTask(1, 2).eval_set] == ["bbbbbbbb#a=", "ababbaa#a="]
    short = ["".join(s) for n in range(1, 6) for s in itertools.product("ab", repeat=n)]
    assert [s for s in short if CountTask._held_out(s)] == ["abbb", "babb", "bbaa", "aabbb", "ababb", "abbbb", "babba",
                                                          "bbaaa", "bbbaa"]


def test_the_built_in_task_needs_its_longest_prompt_within_the_prompt_budget():
    assert make_task(TaskConfig(), 0, limit=12).eval_set  # 9 letters and "#a=": 12 tokens
    with pytest.raises(ConfigError, match="--rollout.max-prompt-tokens=11: the built-in task's prompts take up to 12"):
        make_task(TaskConfig(), 0, limit=11)


def test_a_jsonl_prompt_may_fill_the_budget_exactly_and_training_cycles_through_the_rows(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": "q" * 5 + str(i), "answer": str(i)}) + "\n" for i in range(4)))
    task = JsonlTask(str(f), 0, 0, tok=_Tok(), limit=6)  # every prompt is 6 characters, 6 tokens
    key = lambda p: p.prompt  # noqa: E731
    assert sorted([task.train_problem(i) for i in range(4, 8)], key=key) == sorted([task.train_problem(i)
                                                                                   for i in range(4)], key=key)
    assert len({task.train_problem(i).prompt for i in range(4)}) == 4


def test_each_epoch_takes_every_training_row_once_in_an_order_of_its_own_the_seeds(tmp_path):
    """As TRL's and verl's samplers: a new order each pass over the rows, so batches do not repeat their mix of
    prompts epoch after epoch; a pure function of (seed, index), so a resumed run, or a rollout rank asking
    across an epoch's end and back, gets the same rows."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    task, again = JsonlTask(str(f), 0, 0), JsonlTask(str(f), 0, 0)
    epochs = [[task.train_problem(e * 20 + i).prompt for i in range(20)] for e in range(3)]
    assert epochs[0] == [p.prompt for p in task.rows]  # the first pass: the rows as loaded (shuffled by the seed)
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs) and len(set(epochs[0])) == 20
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    back_and_forth = [again.train_problem(i).prompt for i in (45, 5, 25, 59, 19, 40)]  # epochs 2, 0, 1, 2, 0, 2
    assert back_and_forth == [epochs[i // 20][i % 20] for i in (45, 5, 25, 59, 19, 40)]
    assert [JsonlTask(str(f), 1, 0).train_problem(20 + i).prompt for i in range(20)] != epochs[1]


def test_a_bad_parquet_row_is_named_by_its_number(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow
    path = tmp_path / "rows.parquet"
    pq.write_table(pyarrow.table({"prompt": ["q1", ""], "answer": ["1", "2"]}), path)
    with pytest.raises(ConfigError, match=r"--task\.path: .*rows\.parquet: row 2: the prompt is empty"):
        JsonlTask(str(path), 0, 0)


def test_the_held_out_rows_come_back_in_the_sets_order_from_the_ranks_slices(monkeypatch):
    """Three held-out prompts over two ranks: rank 0 scores prompts 0 and 2, rank 1 prompt 1."""
    import torch
    from minirl import dist
    from minirl.tasks import held_out
    task = make_task(TaskConfig(eval_prompts=3), 0)
    other = {"prompt": task.eval_set[1].prompt, "completion": "2", "answer": "x", "reward": 0.0, "clipped": False}
    monkeypatch.setattr(dist, "all_reduce", lambda t, op="sum": t.add_(torch.tensor([0.0, 1.0])))
    monkeypatch.setattr(dist, "gather_json", lambda rows: [rows, [other]])
    out = held_out(_Engine(), task, _Tok(), 32, rank=0, world=2)
    assert [r["prompt"] for r in out["eval_samples"]] == [p.prompt for p in task.eval_set]


def test_a_prompt_begins_with_the_tokens_its_tokenizer_puts_before_a_text_once(tmp_path):
    """Mistral 7B's tokenizer (it ships in mistral_common, which vLLM installs) puts `<s>` before a text, as
    Llama's and Gemma's do: a text prompt given without it is one the model never saw in training."""
    import shutil
    import mistral_common
    from transformers import AutoTokenizer
    from minirl.tasks import encode_prompts
    shutil.copy(os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1"),
                tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({  # Mistral-7B-v0.1's
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False}))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "Question: 2+2? Answer:"
    ids = encode_prompts(tok, [text, "<s>" + text, "<s>[INST] 2+2? [/INST]"], 64)
    assert ids[0] == tok(text).input_ids and ids[0][0] == tok.bos_token_id  # as vLLM encodes a text prompt
    assert [x[:2].count(tok.bos_token_id) for x in ids] == [1, 1, 1]  # a chat template's own <s> is not doubled
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"prompt": text, "answer": "4"}) + "\n")
    n = len(ids[0])  # the budget counts the <s>: a prompt one token over it is refused as the task loads
    with pytest.raises(ConfigError, match=rf"{f}:1: the prompt has more than --rollout.max-prompt-tokens={n - 1}"):
        make_task(TaskConfig(name="jsonl", path=str(f), eval_prompts=0), 0, tok, n - 1)
    assert make_task(TaskConfig(name="jsonl", path=str(f), eval_prompts=0), 0, tok, n).rows[0].prompt == text
