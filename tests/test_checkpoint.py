"""Checkpoints and resume with the real engine on CPU: exact resume, a kill mid-save, corrupt and
partial checkpoints, SIGTERM's emergency save, and the colocated cycle as the real loop runs it."""

import json
import os
import signal
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import run, sigterm_after

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BASE = ["--rl.batch-per-replica", "16", "--rl.group-size", "4", "--log.eval-every", "0", "--rl.deterministic",
        "--checkpoint.every", "2"]


def grpo(run_dir, *flags, env=None):
    return run([sys.executable, "-m", "minirl.grpo", *BASE, "--log.run-dir", str(run_dir), *flags], env=env)


def records(d):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time", "tokens_per_s"))}
            for line in open(d / "metrics.jsonl")]


def weights(d):
    return load_file(d / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    assert grpo(d, "--steps", "4").returncode == 0
    return d


def test_resume_is_exact(straight, tmp_path):
    assert grpo(tmp_path, "--steps", "2").returncode == 0
    assert grpo(tmp_path, "--steps", "4", "--checkpoint.resume", "auto").returncode == 0
    a, b = weights(straight), weights(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert records(straight) == records(tmp_path)


def test_scheduled_saves_publish_once_per_step(straight):
    """B22: a scheduled save at a step that does not validate runs inside the update's window, so a
    save step syncs the engine once, like any other (down the after-publication path it would be twice)."""
    recs = [r for r in records(straight) if "reward_mean" in r]
    assert len(recs) == 4 and sorted(os.listdir(straight / "checkpoints")) == ["step_00000002", "step_00000004"]
    assert [r["weight_syncs"] for r in recs] == [1, 1, 1, 1]


def test_kill_during_save_resumes_from_the_previous_complete_checkpoint(straight, tmp_path):
    p = grpo(tmp_path, "--steps", "4", env={"MINIRL_FAULT": "kill_in_save:4"})
    assert p.returncode == -signal.SIGKILL
    ckpts = sorted(os.listdir(tmp_path / "checkpoints"))
    assert ckpts == ["step_00000002", "step_00000004.tmp"]  # the interrupted one never got its marker
    p = grpo(tmp_path, "--steps", "4", "--checkpoint.resume", "auto")
    assert p.returncode == 0 and "step_00000002" in p.stderr
    a, b = weights(straight), weights(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert records(straight) == records(tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000002", "step_00000004"]


def test_partial_and_corrupt_checkpoints_are_refused_by_name(straight, tmp_path):
    import shutil
    src = straight / "checkpoints" / "step_00000004"
    partial, corrupt = tmp_path / "partial", tmp_path / "corrupt"
    shutil.copytree(src, partial)
    os.remove(partial / "COMPLETE")
    shutil.copytree(src, corrupt)
    for f in os.listdir(corrupt):
        if f.endswith(".distcp"):
            with open(corrupt / f, "r+b") as fh:
                fh.truncate(100)
    for path, words in ((partial, "not a complete checkpoint"), (corrupt, "unreadable")):
        p = grpo(tmp_path / "run", "--steps", "6", "--checkpoint.resume", str(path))
        assert p.returncode == 2, p.stderr[-2000:]
        assert str(path) in p.stderr and words in p.stderr and "Traceback" not in p.stderr


def test_sigterm_saves_and_exits(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    code, err = sigterm_after([sys.executable, "-m", "minirl.grpo", *BASE, "--steps", "500", "--checkpoint.every",
                               "0", "--log.run-dir", str(tmp_path)], str(metrics), records=2)
    assert code == 0, err[-3000:]
    last = json.loads(metrics.read_text().strip().splitlines()[-1])["step"]
    assert os.listdir(tmp_path / "checkpoints") == [f"step_{last + 1:08d}"]
    assert "SIGTERM" in err


def test_profile_records_the_colocated_cycle_with_the_real_engine(tmp_path):
    """B20 and B27; and B22: every step saves (a scheduled save, no validation), inside the update's
    window: after training, before the weights are published, with no extra hand-off."""
    p = grpo(tmp_path, "--steps", "2", "--checkpoint.every", "1", env={"MINIRL_PROFILE_LOOP": "1"})
    assert p.returncode == 0
    for line in open(tmp_path / "metrics.jsonl"):
        prof = json.loads(line)["grpo_step"]
        assert prof["phases"] == ["generate", "score", "rollout.sleep", "trainer.onload", "train", "checkpoint.save",
                                  "rollout.wake_up(weights)", "weight_sync", "trainer.offload",
                                  "rollout.wake_up(kv_cache)"]
        assert 0 < prof["train/optimizer_s"] < prof["train/s"]
        assert all(f"{ph}/rss_mib" in prof and f"{ph}/s" in prof for ph in prof["phases"])
