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


def test_a_number_without_a_value_is_written_as_null_so_strict_json_readers_read_the_history(tmp_path):
    log = RunLog(str(tmp_path), enabled=True)
    log.write({"step": 0, "value_explained_var": float("nan"), "grad_norm": float("inf"), "reward_mean": 0.5})
    log.close()

    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    line = open(tmp_path / "metrics.jsonl").readline()
    assert json.loads(line, parse_constant=refuse) == {"step": 0, "value_explained_var": None, "grad_norm": None,
                                                       "reward_mean": 0.5}


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


def test_an_eval_of_another_version_than_its_lines_step_count_says_which_it_scored():
    """Streamed PPO's rollout ranks score a version while the trainer goes on, so a step's line can carry an
    older version's eval (the line after 3 steps, version 2's): the line says which, and stays as it was where
    the eval is of the steps it counts (GRPO's always)."""
    assert console_line({"step": 2, "reward_mean": 0.5, "eval_accuracy": 0.3, "eval_version": 2, "grad_norm": 1.0},
                        3) == "step    3/3 | reward 0.5 | eval_acc 0.3 (version 2) | gnorm 1"
    assert console_line({"step": 2, "reward_mean": 0.5, "eval_accuracy": 0.3, "eval_version": 3}, 3) == \
        "step    3/3 | reward 0.5 | eval_acc 0.3"
    assert console_line({"step": 3, "eval_accuracy": 0.25, "eval_version": 3}, 3) == "step    3/3 | eval_acc 0.25"


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """The W&B run id is kept in the run directory; a resume passes it back with resume="allow"."""
    import types
    inits = []
    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or types.SimpleNamespace(
        log=lambda *a, **k: None, finish=lambda: None, define_metric=lambda *a, **k: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    RunLog(str(tmp_path), enabled=True, wandb_project="p").close()
    RunLog(str(tmp_path), enabled=True, wandb_project="p", start_step=5).close()
    first = inits[0]["id"]
    assert [(kw["id"], kw["resume"]) for kw in inits] == [(first, "allow"), (first, "allow")]


def test_wandb_without_an_api_key_is_one_line_naming_the_flag_and_the_ways_on(tmp_path, monkeypatch):
    """The real `wandb` where nobody logged in (a fresh cluster account): it raised its UsageError through the run
    (a traceback from rank 0); now one line names the flag, W&B's reason, logging in and offline mode."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # W&B keeps its settings in the process: an earlier test's offline mode would log in "offline"
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings of the machine's user
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ConfigError, match=r"^--log.wandb-project='p': W&B did not start \(UsageError: No API key "
                                          r".*\); log in \(wandb login, or WANDB_API_KEY\), or .*WANDB_MODE=offline"):
        try:
            RunLog(str(tmp_path / "run"), enabled=True, wandb_project="p")
        finally:
            wandb.teardown()  # and this test's settings leave with it


def test_a_wandb_error_without_a_message_is_still_one_line(tmp_path, monkeypatch):
    """W&B's errors name their reason, but one raised bare is said by its class alone, not an IndexError."""
    import types

    class Refused(Exception):
        pass

    def init(**kw):
        raise Refused()

    fake = types.SimpleNamespace(init=init, errors=types.SimpleNamespace(Error=Refused))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(ConfigError, match=r"^--log.wandb-project='p': W&B did not start \(Refused: \); log in"):
        RunLog(str(tmp_path), enabled=True, wandb_project="p")


def test_wandb_runs_offline_with_the_real_package(tmp_path, monkeypatch, capfd):
    """The real `wandb` (the [wandb] extra; skipped where it is not installed), offline: a run starts,
    logs its steps and finishes (the id helper it once used, wandb.util.generate_id, is gone). A record
    below the newest step (a streamed run's late eval) is kept: W&B drops, with a warning, what is logged
    at a step below its own newest."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)  # its warnings on the console
    log = RunLog(str(tmp_path), enabled=True, wandb_project="minirl-test")
    tables = []
    real_log = log._wandb.log
    log._wandb.log = lambda data, **kw: (tables.extend(k for k in data if k == "train_samples"), real_log(data, **kw))
    row = {"prompt": "q", "completion": "c", "reward": 1.0, "rewards": {"f": 1.0}, "clipped": False}
    for s in range(3):
        log.write({"step": s, "reward_mean": s / 10, "train_samples": [row] * 2})  # --log.train-samples 2
    log.write({"step": 1, "eval_accuracy": 0.5, "eval_version": 1})  # late: the newest step is 2
    log.close()
    said = capfd.readouterr()
    assert "less than the current step" not in said.out + said.err
    assert (tmp_path / "wandb_run_id").read_text().strip() in str(list((tmp_path / "wandb").iterdir()))
    assert tables == ["train_samples"] * 3  # a W&B table a step, accepted by the real package
    rows = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [r["step"] for r in rows] == [0, 0, 1, 1, 2, 2] and all(r["split"] == "train" for r in rows)


def test_tensorboard_gets_each_records_numbers_with_the_real_package(tmp_path):
    """The real TensorBoard writer (the dev extra installs it): every number of a record is a scalar at its
    step, read back from the event file; text and the step itself are not."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log = RunLog(str(tmp_path), enabled=True, tensorboard=True)
    for s in range(3):
        log.write({"step": s, "reward_mean": s / 10, "eval_accuracy": None, "time/step": 0.5, "note": "x"})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward_mean", "time/step"]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward_mean")] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    for rank0, asked, d in ((True, False, tmp_path / "unasked"), (False, True, tmp_path / "rank1")):
        quiet = RunLog(str(d), enabled=rank0, tensorboard=asked)  # only rank 0 writes, and only when asked
        quiet.write({"step": 0, "reward_mean": 0.5})
        quiet.close()
        assert not (d / "tensorboard").exists()


def test_tensorboard_shows_the_steps_metrics_jsonl_keeps_after_a_resume_or_a_fresh_start(tmp_path):
    """A run stopped after step 4 resumes from its step-3 checkpoint: TensorBoard shows steps 3 and 4 once, the
    resumed run's (SummaryWriter's purge_step), as metrics.jsonl keeps them; a fresh run in the same folder
    replaces them all, as it starts metrics.jsonl afresh."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for start, value, steps in ((0, 9.0, range(6)), (0, 1.0, range(5)), (3, 2.0, range(3, 5))):
        log = RunLog(str(tmp_path), enabled=True, tensorboard=True, start_step=start)
        for s in steps:
            log.write({"step": s, "reward_mean": value})
        log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 2.0),
                                                                          (4, 2.0)]
    assert [json.loads(line)["reward_mean"] for line in open(tmp_path / "metrics.jsonl")] == [1.0] * 3 + [2.0] * 2


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


# ---- the numbers each step's record and console line carry (what logger.py's mutation run asked for) ----

def test_sample_metrics_are_the_hand_computed_ones():
    """Three groups of two: rewards [2, 2 | 0, 4 | 1, 3]. The std is the population one; a group whose
    rewards are all equal has no signal; a function's None (NaN) is left out of its mean, and a function
    that scored no row has no mean (it was 0)."""
    import torch
    from minirl.logger import sample_metrics
    r = sample_metrics(torch.tensor([2.0, 2.0, 0.0, 4.0, 1.0, 3.0]), 2, [3, 5, 2, 10, 4, 6], [False] * 5 + [True],
                       {"f": [1.0] + [float("nan")] * 5, "g": [0.0, 1.0, 1.0, 0.0, 1.0, 1.0], "h": [float("nan")] * 6})
    assert r == {"reward_mean": 2.0, "reward_std": pytest.approx((10 / 6) ** 0.5), "reward/f": 1.0,
                 "reward/g": pytest.approx(4 / 6), "reward/h": None, "frac_reward_zero_std": pytest.approx(1 / 3),
                 "completion_len_mean": 5.0, "completion_len_min": 2.0, "completion_len_max": 10.0,
                 "completion_clip_ratio": pytest.approx(1 / 6)}
    assert sample_metrics(torch.tensor([0.0, 1.0]), 2, [1, 1], [False, False])["reward_std"] == 0.5  # below 1 too


def test_training_rows_decode_the_first_n_rollouts_with_their_rewards():
    """A completion is read without its EOS; a prompt with its special tokens (token 1 here), as the model saw
    it: a chat template's markers, as the eval rows show them."""
    class Tok:
        def batch_decode(self, rows, skip_special_tokens):
            return ["".join(chr(96 + t) for t in row if not (skip_special_tokens and t == 1)) for row in rows]

    from minirl.logger import training_rows
    rows = training_rows(Tok(), [[1, 2], [2], [3]], [[4, 5, 1], [6], [7]], [0.5, 1.0, 0.0],
                         {"f": [1, 0, 0], "g": [float("nan")] * 3}, [True, False, False], 2)
    assert rows == [{"prompt": "ab", "completion": "de", "reward": 0.5, "rewards": {"f": 1.0, "g": None}, "clipped": True},
                    {"prompt": "b", "completion": "f", "reward": 1.0, "rewards": {"f": 0.0, "g": None}, "clipped": False}]
    assert "NaN" not in json.dumps(rows)  # TRL's None as JSON's null: samples.jsonl stays JSON
    assert training_rows(Tok(), [[1]], [[2]], [1.0], {}, [False], 0) == []


def test_the_memory_peak_is_read_in_gib_on_the_host_and_on_a_card(monkeypatch):
    """CPU: the process's peak RSS (ru_maxrss, KiB on Linux). CUDA: the card's allocated peak, reset after
    each read. Either way the max over the ranks unless `over_ranks=False` (a rollout rank's group is vLLM's)."""
    import resource
    import torch
    from minirl import dist, logger
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert 0.05 < logger.memory_peak_gib(torch.device("cpu"), over_ranks=False) == pytest.approx(host, rel=0.05)
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    card = torch.device("cuda", 0)
    assert logger.memory_peak_gib(card, over_ranks=False) == 3.0 and resets == [card]
    monkeypatch.setattr(dist, "all_reduce", lambda t, op="sum": t.fill_(7.0) if op == "max" else t)  # a peer's peak
    assert logger.memory_peak_gib(card) == 7.0


def test_a_phase_adds_its_time_and_a_profiled_run_marks_it_once(tmp_path, monkeypatch):
    """`time/<name>` sums a phase's calls in a step; under MINIRL_PROFILE_LOOP=1 each phase's end is one mark
    (time since the last mark, memory in MiB), unless a finer mark inside it closed it already."""
    import time
    import torch
    clock = iter([10.0, 11.0, 12.5, 20.0, 21.0, 25.0, 27.0, 30.0, 31.0, 32.0, 33.0, 34.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    log = RunLog(str(tmp_path), enabled=False)               # 10.0: the profile's start
    assert log.device == torch.device("cpu") and not log.profiling
    with log.phase("generate"):                              # 11.0 -> 12.5
        pass
    with log.phase("generate"):                              # 20.0 -> 21.0
        pass
    assert log.times == {"time/generate": 2.5} and log.take_profile() is None
    monkeypatch.setenv("MINIRL_PROFILE_LOOP", "1")
    log = RunLog(str(tmp_path), enabled=False)               # 25.0
    with log.phase("train", extra=lambda: {"tokens": 4}):    # 27.0 -> 30.0, marked at 31.0
        pass
    with log.phase("publish"):                               # 32.0 -> 34.0
        log.mark("wake")                                     # 33.0: a finer mark closes the phase itself
    profile = log.take_profile()
    assert profile["phases"] == ["train", "wake"] and log.times == {"time/train": 3.0, "time/publish": 2.0}
    assert (profile["train/s"], profile["train/tokens"], profile["wake/s"]) == (6.0, 4, 2.0)
    import psutil
    assert profile["train/rss_mib"] == pytest.approx(psutil.Process().memory_info().rss / 2**20, rel=0.2)  # MiB
    assert log.take_profile() == {}                          # a fresh one for the next step


def test_a_profiled_card_reads_its_memory_in_mib(monkeypatch):
    import torch
    monkeypatch.setenv("MINIRL_PROFILE_LOOP", "1")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * 2**20)
    log = RunLog("", enabled=False, device=torch.device("cuda", 0))
    log.mark("train")
    assert (log.profile["train/allocated_mib"], log.profile["train/reserved_mib"]) == (3.0, 5.0)


def test_the_console_prints_every_nth_step_and_each_eval_with_an_eta_from_the_steps_after_the_first(tmp_path,
                                                                                                   capsys):
    """--log.every 2: steps 0, 2, 4 and any eval. The ETA is the mean of the recent step times (the first, with
    the engine's warm-up, left out) times the steps still to run; the first line says its rate includes it."""
    log = RunLog(str(tmp_path), enabled=True, every=2, total_steps=5)
    for s, t in enumerate([100.0, 10.0, 20.0, 30.0, 40.0]):
        log.write({"step": s, "reward_mean": 0.5, "time/step": t, "tokens_per_s": 9.0,
                   **({"eval_accuracy": 0.5} if s == 3 else {})})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step    1/5 | reward 0.5 | s 100 | tok/s (incl. warm-up) 9 | eta 6m40s",  # 100 s x 4
                     "step    3/5 | reward 0.5 | s 20 | tok/s 9 | eta 0m30s",                 # 15 s x 2
                     "step    4/5 | reward 0.5 | eval_acc 0.5 | s 30 | tok/s 9 | eta 0m20s",   # 20 s x 1
                     "step    5/5 | reward 0.5 | s 40 | tok/s 9 | eta 0m00s"]


def test_the_eta_takes_the_mean_of_the_last_twenty_steps(tmp_path, capsys):
    log = RunLog(str(tmp_path), enabled=True, total_steps=30)
    for s, t in enumerate([100.0, 50.0] + [1.0] * 20):
        log.write({"step": s, "time/step": t})
    log.close()
    assert capsys.readouterr().out.splitlines()[-1] == "step   21/30 | s 1 | eta 0m08s"  # 1 s x 8, not 50 s


@pytest.mark.parametrize("seconds, shown", [(59.4, "0m59s"), (61, "1m01s"), (120, "2m00s"), (3599, "59m59s"),
                                            (3600, "1h00m"), (3725, "1h02m"), (7140, "1h59m"), (90061, "25h01m")])
def test_an_eta_reads_as_minutes_and_seconds_under_an_hour_else_hours_and_minutes(seconds, shown):
    assert console_line({"step": 0}, eta=seconds) == f"step    0 | eta {shown}"


def test_a_log_made_with_its_defaults_prints_every_step_shows_two_samples_and_starts_fresh(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # an earlier run's history: a fresh log drops it
    log = RunLog(str(tmp_path), enabled=True)
    row = {"prompt": "q", "completion": "1", "answer": "1", "reward": 1.0}
    for s in range(3):
        log.write({"step": s, "reward_mean": 1.0, "time/step": 1.0,
                   **({"eval_accuracy": 1.0, "eval_samples": [row] * 3} if s == 2 else {})})
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert out == ["step    1 | reward 1 | s 1", "step    2 | reward 1 | s 1", "step    3 | reward 1 | eval_acc 1 | s 1",
                   *["  sample (version None): 'q' -> '1' (answer '1', reward 1)"] * 2]
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_a_resumed_run_whose_history_is_gone_starts_one_and_drops_a_line_cut_by_a_kill(tmp_path):
    RunLog(str(tmp_path / "lost"), enabled=True, start_step=3).close()
    assert (tmp_path / "lost" / "metrics.jsonl").read_text() == ""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rew')  # killed mid-line
    log = RunLog(str(tmp_path), enabled=True, start_step=3)
    log.times["time/generate"] = 0.123456  # a phase's time, rounded into the record
    log.write({"step": 3})
    log.close()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines == [{"step": 0}, {"step": 1}, {"step": 3, "time/generate": 0.1235}]


def test_the_sinks_get_every_number_at_its_step_and_a_fresh_run_a_new_wandb_run(tmp_path, monkeypatch):
    """W&B's charts run on the record's `step` (define_metric), never on W&B's own step, which drops what
    comes out of order."""
    import types
    inits, logged, defined = [], [], []
    run = types.SimpleNamespace(log=lambda data: logged.append(data), finish=lambda: None,
                                define_metric=lambda *a, **kw: defined.append((*a, kw)))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: inits.append(kw) or run))
    log = RunLog(str(tmp_path), enabled=True, wandb_project="p", config={"seed": 3})
    log.write({"step": 4, "reward_mean": 0.5, "optimizer_steps": 2, "note": "text", "eval_version": None})
    log.close()
    assert logged == [{"step": 4, "reward_mean": 0.5, "optimizer_steps": 2.0}] and inits[0]["config"] == {"seed": 3}
    assert defined == [("step", {}), ("*", {"step_metric": "step"})]
    first = inits[0]["id"]
    assert len(first) == 12 and first.isalnum() and first == first.lower()
    RunLog(str(tmp_path), enabled=True, wandb_project="p").close()  # --log.overwrite: not the old run's W&B run
    assert inits[1]["id"] != first


def test_an_engines_output_goes_to_its_own_log_in_the_run_dir_or_to_the_console_with_the_flag():
    """engine.log for one engine, engine_rank<R>.log when several ranks have one; --log.engine-logs: the
    console (None)."""
    from minirl.config import LogConfig
    from minirl.logger import engine_log
    cfg = LogConfig(run_dir="runs/a")
    assert engine_log(cfg, 0, several=False) == "runs/a/engine.log"
    assert engine_log(cfg, 3, several=True) == "runs/a/engine_rank3.log"
    cfg.engine_logs = True
    assert engine_log(cfg, 3, several=True) is None
