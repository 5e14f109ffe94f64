"""tools/plot.py (minirl-plot): a PNG of a run's curves from metrics.jsonl, also from a crashed run's partial file."""

import json

import pytest

from minirl.tools.plot import drawn, plot, read, series


def write_run(d, records, tail=""):
    with open(d / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)


def test_plot_writes_a_png_of_the_logged_curves(tmp_path):
    recs = [{"step": 0, "eval_accuracy": 0.0}] + [
        {"step": s, "reward_mean": 0.1 * s, "ppo_loss": -0.01, "value_loss": 1.0 / (s + 1), "time/step": 0.5}
        for s in range(5)]
    write_run(tmp_path, recs, tail='{"step": 5, "reward_')  # the last line was cut by a crash
    out = plot(str(tmp_path))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert len(read(str(tmp_path))) == 6
    assert plot(str(tmp_path / "metrics.jsonl")) == out  # the file itself names its run
    assert series(read(str(tmp_path)), "reward_mean") == ([0, 1, 2, 3, 4], [0.0, 0.1, 0.2, 0.30000000000000004, 0.4])


def test_several_reward_functions_are_drawn_in_the_reward_panel_and_one_is_not():
    one = [{"step": s, "reward_mean": 0.5, "reward/count": 0.5} for s in range(3)]
    two = [{"step": s, "reward_mean": 0.7, "reward/gsm8k": 0.5, "reward/ends_cleanly": 1.0} for s in range(3)]
    assert drawn(one) == [("reward", ["reward_mean"])]
    assert drawn(two) == [("reward", ["reward_mean", "reward/ends_cleanly", "reward/gsm8k"])]


def test_missing_metrics_names_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--log.run-dir"):
        plot(str(tmp_path))
    write_run(tmp_path, [], tail='{"step": 0, "rew')  # a run that crashed before its first record was whole
    with pytest.raises(SystemExit, match=r"no step records in .*metrics\.jsonl yet"):
        plot(str(tmp_path))


def test_evaluations_are_drawn_at_the_version_they_scored(tmp_path):
    """PPO's rollout ranks score a version while later steps train: an eval's x is its eval_version."""
    recs = [{"step": 0, "eval_accuracy": 0.1, "eval_version": 0},
            {"step": 0, "reward_mean": 0.0, "completion_len_mean": 3.0, "completion_len_max": 6,
             "completion_clip_ratio": 0.25},
            {"step": 3, "reward_mean": 0.2, "eval_accuracy": 0.4, "eval_version": 2}]
    write_run(tmp_path, recs)
    assert series(read(str(tmp_path)), "eval_accuracy") == ([0, 2], [0.1, 0.4])
    assert series(read(str(tmp_path)), "completion_len_max") == ([0], [6])
    plot(str(tmp_path))
