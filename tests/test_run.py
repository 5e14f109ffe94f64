"""run.py, the harness both loops call: which steps are scored and saved, each step's record, the
early stop, and what it says, driven here without a model or an engine (the loops' end-to-end tests
drive it with both)."""

import json
import time

import pytest

from conftest import ready_for
from minirl.config_grpo import GRPOArgs
from minirl.config_ppo import PPOArgs
from minirl.run import Run


def harness(tmp_path, tiny_path, world, **log):
    args = GRPOArgs()
    args.steps, args.checkpoint.every, args.log.run_dir = 6, 3, str(tmp_path)
    for k, v in {"eval_every": 2, **log}.items():
        setattr(args.log, k, v)
    said = []
    run = Run(ready_for(args, tiny_path), world, "a test", rows=8)
    run.info = run.log.info = said.append
    return run, said


def test_the_harness_scores_and_saves_after_the_steps_their_flags_name_and_records_each_step(tmp_path, tiny_path,
                                                                                            world):
    """--log.eval-every 2 and --checkpoint.every 3 over 6 steps: the starting policy and the one after
    steps 2, 4 and 6 are scored; a save follows step 6 but not step 3, which took no update; each record
    carries its step, its wall time and the completion tokens per second of its rows."""
    run, said = harness(tmp_path, tiny_path, world)
    with run.phase("build"):  # before the steps: not announced unless the loop says what it does
        pass
    run.baseline(lambda version: {"eval_accuracy": 0.25, "eval_version": version}, announce="scoring")
    assert said[0] == "scoring ..." and said[1].startswith("scoring: done in ")
    saved, seen = [], []
    for step in run.steps():
        seen.append(step)
        with run.phase("train"):
            time.sleep(0.01)
        record = {"completion_len_mean": 10.0, **({"eval_accuracy": 0.5} if run.evaluates(step) else {})}
        run.end_step(step, record, stepped=step != 2, save=lambda: saved.append(step))
    assert seen == list(range(6)) and run.done == 6 and run.stopped == ""
    assert [s for s in range(6) if run.evaluates(s)] == [1, 3, 5]
    assert saved == [5]  # after step 6; step 3 (index 2) took no update
    thirds, _ = harness(tmp_path / "thirds", tiny_path, world, eval_every=3)  # a step is not its version
    assert [s for s in range(6) if thirds.evaluates(s)] == [2, 5] == [s for s in range(6) if thirds.saves(s, True)]
    assert thirds.logged_eval == -1  # a fresh run has logged no eval: streamed PPO scores version 0 first
    assert "step 0: train ..." in said and not [x for x in said if x.startswith(("step 1", "step 0: build"))]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert {k: v for k, v in records[0].items() if not k.startswith("time/")} == {
        "step": 0, "eval_accuracy": 0.25, "eval_version": 0}  # the build's time rides along
    steps = records[1:]
    assert [r["step"] for r in steps] == list(range(6))
    assert [("eval_accuracy" in r) for r in steps] == [False, True, False, True, False, True]
    for r in steps:
        assert 0.01 <= r["time/step"] < 5 and r["time/train"] >= 0.01
        assert r["tokens_per_s"] == pytest.approx(10.0 * 8 / r["time/step"])


def test_a_run_that_never_evaluates_scores_no_starting_policy(tmp_path, tiny_path, world):
    run, _ = harness(tmp_path, tiny_path, world, eval_every=0)
    run.baseline(lambda version: pytest.fail("scored"))
    assert not [s for s in range(6) if run.evaluates(s)]


def test_the_target_accuracy_stops_the_run_at_the_step_that_reaches_it(tmp_path, tiny_path, world):
    """--log.target-eval-accuracy 0.5: a step scored at exactly 0.5 is the last, with a line saying so;
    below it, or unscored, the run goes on, as it does on the starting policy's score (streamed PPO's
    step 0 record can carry version 0's)."""
    run, said = harness(tmp_path, tiny_path, world, eval_every=2, target_eval_accuracy=0.5)
    accuracy = {0: 0.9, 1: 0.49, 3: 0.5, 5: 0.75}  # the steps between are not scored
    seen = []
    for step in run.steps():
        seen.append(step)
        scored = {"eval_accuracy": accuracy[step], "eval_version": step + (step > 0)} if step in accuracy else {}
        run.end_step(step, {"completion_len_mean": 1.0, **scored}, True, save=lambda: None)
    assert seen == [0, 1, 2, 3] and run.stopped == "target"
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
        assert (said[0] == nothing) == (resume == "auto") and said[-3].startswith("minirl.grpo: a test; model ")


def test_a_pretrained_model_at_the_tiny_models_learning_rate_gets_a_warning(tmp_path, tiny_path, world, monkeypatch):
    """The default --rl.lr (1e-4) suits the built-in tiny model. AdamW's first steps move every weight by about
    the rate: SmolLM2-135M at 1e-4 was 7 to 13 nats a token from its start (a step's mean KL) within 2 to 4
    optimizer steps. A pretrained model at that rate gets one line; at 1e-6 (TRL's and verl's default), or the
    tiny model, none."""
    from minirl.logger import RunLog
    said = []
    monkeypatch.setattr(RunLog, "info", lambda self, line: said.append(line))
    args = GRPOArgs()
    args.log.run_dir = str(tmp_path)
    for path, lr, warned in [("tiny", 1e-4, False), ("/models/pretrained", 1e-4, True),
                             ("/models/pretrained", 1e-6, False)]:
        args.model.path, args.rl.lr = path, lr
        said.clear()
        Run(ready_for(args, tiny_path), world, "a test", rows=8)
        warning = ("warning: --rl.lr=0.0001 suits the built-in tiny model; it moves a pretrained model far in a step "
                   "(TRL and verl default to 1e-6)")
        assert (warning in said) == warned, (path, lr, said)


def test_a_pretrained_model_at_the_built_in_tasks_token_cap_gets_a_warning(tmp_path, tiny_path, world, monkeypatch):
    """The default --rollout.max-tokens (8) fits the built-in task's one-digit answer; a pretrained model's answer
    cut there earns 0 from every function, so its run sees rewards of 0 (the all-zero warning comes after 10 steps)."""
    from minirl.logger import RunLog
    said = []
    monkeypatch.setattr(RunLog, "info", lambda self, line: said.append(line))
    args = PPOArgs()
    args.log.run_dir = str(tmp_path)
    for path, cap, warned in [("tiny", 8, False), ("/models/pretrained", 8, True), ("/models/pretrained", 256, False)]:
        args.model.path, args.rollout.max_tokens = path, cap
        said.clear()
        Run(ready_for(args, tiny_path), world, "a test", rows=8)
        assert any(line.startswith("warning: --rollout.max-tokens=8 suits the built-in task") for line in said) == warned


def test_a_runs_header_says_how_many_prompts_it_trains_on_and_holds_out(tmp_path, tiny_path, world, monkeypatch):
    """A dataset read wrong (a filter, the wrong split, a held-out file given twice) shows in the count before
    any step, as verl's "dataset len" line does."""
    from minirl.logger import RunLog
    said = []
    monkeypatch.setattr(RunLog, "info", lambda self, line: said.append(line))
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"prompt": format(i, "011b").translate({48: "a", 49: "b"}) + "#a=", "answer": "1"})
                         + "\n" for i in range(1200)))
    for name, path, line in (("count", "", "prompts: made by the built-in task, 128 held out"),
                             ("jsonl", str(f), "prompts: 1,072 to train on, 128 held out")):
        args = GRPOArgs()
        args.log.run_dir, args.task.name, args.task.path = str(tmp_path / name), name, path
        said.clear()
        Run(ready_for(args, tiny_path), world, "a test", rows=8)
        assert line in said, said


def test_pi_old_from_the_engine_under_a_cut_distribution_gets_a_warning(tmp_path, tiny_path, world, monkeypatch):
    """vLLM's logprobs are of the distribution it sampled from (top-p, top-k and min-tokens cut it and
    renormalize): at --rollout.top-p 0.5 the tiny model's were 0.25 nats a token above the trainer's. Taken as
    pi_old, every ratio starts near 0.78, past a 0.2 clip: one line says so; the trainer's own pi_old, or the
    whole distribution, none."""
    from minirl.logger import RunLog
    said = []
    monkeypatch.setattr(RunLog, "info", lambda self, line: said.append(line))
    for cls, group in ((GRPOArgs, "rl"), (PPOArgs, "ppo")):
        for flag, value, engine, warned in [("top_p", 0.5, True, True), ("top_k", 1, True, True),
                                            ("min_tokens", 1, True, True), ("top_p", 0.5, False, False),
                                            ("top_p", 1.0, True, False), ("top_k", -1, True, False)]:
            args = cls()
            args.log.run_dir = str(tmp_path)
            setattr(args.rollout, flag, value)
            getattr(args, group).use_rollout_logprobs_for_loss = engine
            said.clear()
            Run(ready_for(args, tiny_path), world, "a test", rows=8)
            lines = [line for line in said if "logprobs-for-loss takes pi_old from the engine" in line]
            assert bool(lines) == warned, (cls, flag, value, engine, said)
            assert all(f"--{group}.use-rollout" in line and f"--rollout.{flag.replace('_', '-')}" in line
                       for line in lines)


def test_a_first_ctrl_c_during_the_final_export_is_told_the_export_finishes(tmp_path, tiny_path, world, capfd):
    """Past the last step a first Ctrl-C saves no checkpoint: it was told "saving a checkpoint at the end of this
    step", and the export went on to the end as it does."""
    import os
    import signal

    from minirl import models
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        run, _ = harness(tmp_path, tiny_path, world, eval_every=0)
        run.stop.armed = True  # the steps are done (`Run.steps` arms the signal's save)
        run.finish(models.sharded(tiny_path, "policy", world, "float32"), before=lambda: os.kill(os.getpid(),
                                                                                                 signal.SIGINT))
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    err = capfd.readouterr().err
    assert "Ctrl-C: the export of the final policy finishes first, then the run exits" in err
    assert "saving a checkpoint" not in err and (tmp_path / "final" / "model.safetensors").is_file()


def test_a_signal_before_the_first_step_stops_at_once_and_one_in_a_step_waits_for_its_save(tmp_path, tiny_path,
                                                                                          world):
    """Before the steps (the build, a resume's load) there is nothing to save: a SIGTERM stops at once (exit 143);
    once the steps begin, the first asks for the save at the step's end."""
    import os
    import signal
    run, said = harness(tmp_path, tiny_path, world)
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 143
    saved = []
    for step in run.steps():
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # mid-step: the step ends, is saved, and the run stops
        run.end_step(step, {"completion_len_mean": 1.0}, stepped=True, save=lambda: saved.append(step))
    assert saved == [1] and run.stopped == "signal" and run.done == 2
