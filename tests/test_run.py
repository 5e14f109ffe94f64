"""run.py, the harness both loops call: which steps are scored and saved, each step's record, the
early stop, and what it says, driven here without a model or an engine (the loops' end-to-end tests
drive it with both)."""

import json
import time

import pytest

from conftest import ready_for
from minirl.config_grpo import GRPOArgs
from minirl.run import Run


def harness(tmp_path, tiny_path, world, **log):
    args = GRPOArgs()
    args.steps, args.checkpoint.every, args.log.run_dir = 6, 2, str(tmp_path)
    for k, v in {"eval_every": 3, **log}.items():
        setattr(args.log, k, v)
    said = []
    run = Run(ready_for(args, tiny_path), world, "a test", rows=8)
    run.info = run.log.info = said.append
    return run, said


def test_the_harness_scores_and_saves_after_the_steps_their_flags_name_and_records_each_step(tmp_path, tiny_path,
                                                                                            world):
    """--log.eval-every 3 and --checkpoint.every 2 over 6 steps: the policy after steps 3 and 6 is
    scored (and the starting one), a save follows steps 2, 4 and 6 but never a step without an update;
    each record carries its step, its wall time and the completion tokens per second of its rows."""
    run, said = harness(tmp_path, tiny_path, world)
    run.baseline(lambda version: {"eval_accuracy": 0.25, "eval_version": version}, announce="scoring")
    assert said[0] == "scoring ..." and said[1].startswith("scoring: done in ")
    saved, seen = [], []
    for step in run.steps():
        seen.append(step)
        with run.phase("train"):
            time.sleep(0.01)
        record = {"completion_len_mean": 10.0, **({"eval_accuracy": 0.5} if run.evaluates(step) else {})}
        run.end_step(step, record, stepped=step != 3, save=lambda: saved.append(step))
    assert seen == list(range(6)) and run.done == 6 and run.stopped == ""
    assert [s for s in range(6) if run.evaluates(s)] == [2, 5]
    assert saved == [1, 5]  # after steps 2 and 6; step 4 (index 3) took no update
    assert "step 0: train ..." in said and not [x for x in said if x.startswith("step 1")]  # the warm-up, said
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert records[0] == {"step": 0, "eval_accuracy": 0.25, "eval_version": 0, "time/eval": records[0]["time/eval"]}
    steps = records[1:]
    assert [r["step"] for r in steps] == list(range(6))
    assert [("eval_accuracy" in r) for r in steps] == [False, False, True, False, False, True]
    for r in steps:
        assert 0.01 <= r["time/step"] < 5 and r["time/train"] >= 0.01
        assert r["tokens_per_s"] == pytest.approx(10.0 * 8 / r["time/step"])


def test_the_target_accuracy_stops_the_run_at_the_step_that_reaches_it(tmp_path, tiny_path, world):
    """--log.target-eval-accuracy 0.5: a step scored at exactly 0.5 is the last, with a line saying so;
    below it the run goes on."""
    run, said = harness(tmp_path, tiny_path, world, eval_every=1, target_eval_accuracy=0.5)
    accuracy = {0: 0.25, 1: 0.49, 2: 0.5, 3: 0.75}
    seen = []
    for step in run.steps():
        seen.append(step)
        run.end_step(step, {"completion_len_mean": 1.0, "eval_accuracy": accuracy[step]}, True, save=lambda: None)
    assert seen == [0, 1, 2] and run.stopped == "target"
    assert said[-1] == "eval_accuracy 0.500 reached --log.target-eval-accuracy=0.5; stopping"


def test_a_fresh_start_under_resume_auto_says_there_was_nothing_to_resume(tmp_path, tiny_path, world, monkeypatch):
    from minirl.logger import RunLog
    said = []
    monkeypatch.setattr(RunLog, "info", lambda self, line: said.append(line))
    for resume in ("", "auto"):
        args = GRPOArgs()
        args.log.run_dir, args.checkpoint.resume = str(tmp_path / (resume or "fresh")), resume
        (tmp_path / (resume or "fresh")).mkdir()
        said.clear()
        Run(ready_for(args, tiny_path), world, "a test", rows=8)
        nothing = f"--checkpoint.resume auto: no complete checkpoint in {args.checkpoint_dir}; starting fresh"
        assert (said[0] == nothing) == (resume == "auto") and said[-2].startswith("minirl.grpo: a test; model ")
