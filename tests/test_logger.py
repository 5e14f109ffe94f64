"""logger.RunLog: metrics.jsonl always, flushed per step and trimmed on resume; the optional
TensorBoard / W&B sinks name their extra when missing; one readable console line per step."""

import json
import sys

import pytest

from minirl.config import ConfigError
from minirl.logger import RunLog, console_line


def test_records_are_flushed_per_step_and_a_resume_keeps_earlier_steps(tmp_path):
    log = RunLog(str(tmp_path), enabled=True)
    for s in range(4):
        log.write({"step": s, "reward_mean": s / 10})
        assert len(open(tmp_path / "metrics.jsonl").readlines()) == s + 1  # on disk before the next step
    log.close()
    RunLog(str(tmp_path), enabled=True, start_step=2).close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1]


def test_eval_samples_go_to_samples_jsonl_the_console_shows_some_and_a_resume_trims_them(tmp_path, capsys):
    rows = [{"prompt": f"ab{i}#a=", "completion": "1" * i, "answer": "1", "reward": float(i == 1), "clipped": i == 3}
            for i in range(4)]
    log = RunLog(str(tmp_path), enabled=True, samples=3)
    for s in range(4):
        log.write({"step": s, "reward_mean": 0.5, **({"eval_accuracy": 0.25, "eval_version": s + 1,
                                                     "eval_samples": rows} if s % 2 else {})})
    log.close()
    written = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert written == [{"step": s, "eval_version": s + 1, **r} for s in (1, 3) for r in rows]
    assert all("eval_samples" not in json.loads(line) for line in open(tmp_path / "metrics.jsonl"))
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  sample")]
    assert len(shown) == 6 and shown[1] == "  sample (version 2): 'ab1#a=' -> '1' (answer '1', reward 1)"
    assert shown[2].endswith("reward 0)")
    # the next eval shows the next prompts of the set: the fourth, then the first two again
    assert shown[3].startswith("  sample (version 4): 'ab3#a='") and shown[3].endswith("cut at --rollout.max-tokens)")
    assert shown[4].startswith("  sample (version 4): 'ab0#a='")
    RunLog(str(tmp_path), enabled=True, start_step=2).close()  # resumed at step 2: step 3's eval is gone
    assert [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")] == [1] * 4


def test_a_resume_rewrite_that_fails_midway_leaves_the_old_history_whole(tmp_path, monkeypatch):
    """The resume's rewrite of metrics.jsonl goes to a temporary file that replaces the history only
    once it is on disk: a failure before that (fsync raising, as on a full or failing disk) leaves
    every old line in place, and a run that then starts leaves them there too."""
    import os
    log = RunLog(str(tmp_path), enabled=True)
    for s in range(5):
        log.write({"step": s, "reward_mean": s / 10})
    log.close()
    before = (tmp_path / "metrics.jsonl").read_text()

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        RunLog(str(tmp_path), enabled=True, start_step=2)
    assert (tmp_path / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("kwargs, module, flag", [
    ({"tensorboard": True}, "torch.utils.tensorboard", "--log.tensorboard"),
    ({"wandb_project": "p"}, "wandb", "--log.wandb-project"),
])
def test_a_missing_optional_sink_names_its_flag_and_extra(tmp_path, monkeypatch, kwargs, module, flag):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=flag.replace(".", r"\.") + ".*pip install"):
        RunLog(str(tmp_path), enabled=True, **kwargs)


def test_console_line_shows_the_key_numbers():
    line = console_line({"step": 7, "reward_mean": 0.5, "ppo_loss": -0.01, "value_loss": 0.2, "ppo_clipfrac": 0.03,
                         "time/step": 1.25, "tokens_per_s": 900.0})
    assert line == "step    8 | reward 0.5 | loss -0.01 | vloss 0.2 | clip 0.03 | s 1.25 | tok/s 900"


def test_the_console_counts_steps_done_as_the_checkpoints_do():
    """The baseline eval is at 0 steps done, the first step's line at 1, the last at total (step_<total>/)."""
    assert console_line({"step": 0, "eval_accuracy": 0.25}, 20).startswith("step    0/20 | ")
    assert console_line({"step": 0, "reward_mean": 0.5}, 20).startswith("step    1/20 | ")
    assert console_line({"step": 19, "reward_mean": 0.5}, 20).startswith("step   20/20 | ")


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """The W&B run id is kept in the run directory; a resume passes it back with resume="allow"."""
    import types
    inits = []
    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None,
                                                                                             finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    RunLog(str(tmp_path), enabled=True, wandb_project="p").close()
    RunLog(str(tmp_path), enabled=True, wandb_project="p", start_step=5).close()
    first = inits[0]["id"]
    assert [(kw["id"], kw["resume"]) for kw in inits] == [(first, "allow"), (first, "allow")]


def test_wandb_runs_offline_with_the_real_package(tmp_path, monkeypatch):
    """The real `wandb` (the [wandb] extra; skipped where it is not installed), offline: a run starts,
    logs its steps and finishes (the id helper it once used, wandb.util.generate_id, is gone)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLog(str(tmp_path), enabled=True, wandb_project="minirl-test")
    tables = []
    real_log = log._wandb.log
    log._wandb.log = lambda data, step=None: (tables.extend(k for k in data if k == "train_samples"),
                                              real_log(data, step=step))
    row = {"prompt": "q", "completion": "c", "reward": 1.0, "rewards": {"f": 1.0}, "clipped": False}
    for s in range(3):
        log.write({"step": s, "reward_mean": s / 10, "train_samples": [row] * 2})  # --log.train-samples 2
    log.close()
    assert (tmp_path / "wandb_run_id").read_text().strip() in str(list((tmp_path / "wandb").iterdir()))
    assert tables == ["train_samples"] * 3  # a W&B table a step, accepted by the real package
    rows = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [r["step"] for r in rows] == [0, 0, 1, 1, 2, 2] and all(r["split"] == "train" for r in rows)


def test_a_resumed_history_that_is_not_utf8_is_refused_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 0, "note": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"metrics\.jsonl: not UTF-8 text .* move it aside"):
        RunLog(str(tmp_path), enabled=True, start_step=1)


def test_each_reward_function_is_logged_as_its_own_mean():
    import torch
    from minirl.logger import sample_metrics
    r = sample_metrics(torch.tensor([1.2, 0.2, 0.0, 1.0]), 2, [2, 2, 8, 2], [False, False, True, False],
                       {"gsm8k": [1.0, 0.0, 0.0, 1.0], "ends_cleanly": [1.0, 1.0, 0.0, 0.0]})
    assert r["reward/gsm8k"] == 0.5 and r["reward/ends_cleanly"] == 0.5 and r["reward_mean"] == pytest.approx(0.6)
    assert r["completion_clip_ratio"] == 0.25


def test_a_full_disk_under_the_history_is_one_line_naming_the_file():
    """metrics.jsonl or samples.jsonl on a full disk: one line (exit 2), not a traceback from deep in a step."""
    import pytest
    from minirl import logger
    from minirl.config import ConfigError
    log = logger.RunLog("", enabled=False)
    log._file = open("/dev/full", "w")
    with pytest.raises(ConfigError, match=r"writing /dev/full failed: \[Errno 28\] No space left on device; free "):
        logger._append(log._file, ['{"step": 0}\n'])
    log.close()  # the line above is the error: closing the file (which flushes again) adds none


def test_samples_are_on_disk_as_each_step_writes_them_not_at_close(tmp_path):
    """A reader (or a crash) mid-run sees every eval's and training step's samples so far."""
    log = RunLog(str(tmp_path), enabled=True)
    row = {"prompt": "q", "completion": "1", "answer": "1", "reward": 1.0, "clipped": False}
    log.write({"step": 0, "reward_mean": 1.0, "train_samples": [row]})
    log.write({"step": 1, "reward_mean": 1.0, "eval_accuracy": 1.0, "eval_version": 2, "eval_samples": [row]})
    lines = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]  # the log is still open
    assert [(r["step"], r.get("split"), r.get("eval_version")) for r in lines] == [(0, "train", None), (1, None, 2)]
    log.close()
