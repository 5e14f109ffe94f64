"""launch.py's run-directory claim: one live run owns a run directory; `--checkpoint.resume auto` without a checkpoint and
`--log.overwrite` never lose or mix an old run's work."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TORCHRUN_VARS, run
from minirl import config, launch
from minirl.config import ConfigError
from minirl.config_grpo import GRPOArgs

SMALL = ["--rl.batch-per-replica", "4", "--rl.group-size", "2", "--log.eval-every", "0"]


def finished_run(d):
    """What a finished run without checkpoints leaves (the default --checkpoint.every 0)."""
    os.makedirs(d / "final")
    (d / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "reward_mean": 0.5}}\n' for s in range(801)))
    (d / "final" / "model.safetensors").write_text("weights")
    (d / "config.json").write_text("{}")
    return (d / "metrics.jsonl").read_text()


def test_resume_auto_on_a_run_without_checkpoints_keeps_it(tmp_path):
    """It used to say "starting fresh", cut metrics.jsonl to one line and replace final/."""
    history = finished_run(tmp_path)
    p = run([sys.executable, "-m", "minirl.grpo", *SMALL, "--steps", "2", "--checkpoint.resume", "auto",
             "--log.run-dir", str(tmp_path)], timeout=120)
    assert p.returncode == 2 and "no complete checkpoint to resume" in p.stderr and "--log.overwrite" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == history
    assert (tmp_path / "final" / "model.safetensors").read_text() == "weights"


def test_overwrite_starts_the_run_dir_clean_of_the_old_run(tmp_path, monkeypatch):
    """--log.overwrite removes the old run's history, final/, logs and checkpoints (so `auto` and the
    step-numbered pruning can never meet them again), and nothing else in the folder."""
    finished_run(tmp_path)
    for step in (3, 4):
        os.makedirs(tmp_path / "checkpoints" / f"step_{step:08d}")
        (tmp_path / "checkpoints" / f"step_{step:08d}" / "COMPLETE").write_text("")
    (tmp_path / "engine_rank0.log").write_text("old")
    os.makedirs(tmp_path / "checkpoints" / "set_aside" / "20261201-000000" / "step_00000005")
    (tmp_path / "run.json").write_text('{"run": "old", "line": "old", "from": 0}')
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "train.log").write_text("mine too")  # e.g. nohup's output, sent into the run directory
    monkeypatch.delenv("RANK", raising=False)
    args = GRPOArgs()
    args.log.run_dir, args.log.overwrite = str(tmp_path), True
    owner = launch.claim(args, None)
    assert sorted(os.listdir(tmp_path)) == [".lock", "checkpoints", "notes.txt", "run.json", "train.log"]
    assert os.listdir(tmp_path / "checkpoints") == [".lock"]  # the new run's lock on its checkpoint folder
    assert launch.identity(str(tmp_path)) == owner and owner["run"] != "old" and owner["from"] == 0


def test_a_launch_killed_while_overwrite_clears_leaves_no_old_checkpoint_a_resume_would_take(tmp_path, monkeypatch):
    """--log.overwrite removes the old run's files one by one. Killed part way (kill -9, a node lost), the
    relaunch with `auto` must not resume the old run's checkpoints under the history the kill half removed:
    run.json goes first, so what is left is another run's, and refused."""
    removed = []
    real = launch._remove

    def remove(path):
        removed.append(os.path.basename(path))
        real(path)
        raise KeyboardInterrupt  # the kill, after one removal

    finished_run(tmp_path)
    (tmp_path / "run.json").write_text('{"run": "old", "line": "old", "from": 0}')
    old = tmp_path / "checkpoints" / "step_00000004"
    os.makedirs(old)
    (old / "COMPLETE").write_text("4\n")
    (old / "loop_state.json").write_text('{"steps_done": 4, "run": "old", "line": "old"}')
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "_remove", remove)
    args = GRPOArgs()
    args.log.run_dir, args.log.overwrite = str(tmp_path), True
    with pytest.raises(KeyboardInterrupt):
        launch.claim(args, None)
    assert removed == ["run.json"] and (tmp_path / "metrics.jsonl").exists() and old.exists()
    args.log.overwrite, args.checkpoint.resume = False, "auto"  # the relaunch
    with pytest.raises(ConfigError, match=rf"holds another run's checkpoint \({old}, written by"):
        launch.owned_checkpoints(args, launch.identity(str(tmp_path)))


def test_a_checkpoint_folder_that_cannot_be_made_is_one_line_naming_its_flag(tmp_path, monkeypatch):
    """--checkpoint.dir under a file (or on a read-only disk, in a folder not ours) failed in the claim with
    os.makedirs' traceback; --log.run-dir's parent is checked with the flags, the made folder here too."""
    (tmp_path / "notes.txt").write_text("a file")
    monkeypatch.delenv("RANK", raising=False)
    args = GRPOArgs()
    args.log.run_dir, args.checkpoint.dir = str(tmp_path / "run"), str(tmp_path / "notes.txt" / "ckpts")
    with pytest.raises(ConfigError, match=rf"^--checkpoint.dir='{tmp_path}/notes.txt/ckpts' cannot be written "
                                          r"\(Not a directory\); give a folder you can write$"):
        launch.claim(args, None)


def test_overwrite_and_resume_together_are_refused():
    args = GRPOArgs()
    args.log.overwrite, args.checkpoint.resume = True, "auto"
    with pytest.raises(ConfigError, match="--log.overwrite starts over"):
        args.validate(1)


def test_a_second_run_on_a_live_runs_dir_exits_2_and_a_dead_run_leaves_no_lock(tmp_path):
    """Two runs started on one run dir: the second exits 2 at once, naming the live one; once the first
    is killed (-9, no clean-up), the directory can be claimed again."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    first = subprocess.Popen([sys.executable, "-m", "minirl.grpo", *SMALL, "--steps", "500", "--log.run-dir",
                              str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not config.holds_run(str(tmp_path)):
            time.sleep(0.5)
        assert config.holds_run(str(tmp_path)), "the first run never logged a step"
        before = (tmp_path / "metrics.jsonl").read_text()
        p = run([sys.executable, "-m", "minirl.grpo", *SMALL, "--steps", "2", "--log.run-dir", str(tmp_path),
                 "--log.overwrite"], timeout=120)
        assert p.returncode == 2 and "in use by a live run" in p.stderr and f"pid {first.pid}" in p.stderr, p.stderr
        assert (tmp_path / "metrics.jsonl").read_text().startswith(before)  # the live run's history untouched
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    launch.lock(str(tmp_path))  # the kernel released the dead run's lock


def test_a_checkpoint_folder_in_use_by_a_live_run_is_refused_naming_it(tmp_path, monkeypatch):
    """Two runs, each with its own run dir, sharing a --checkpoint.dir: the second is refused at once
    (the live run's lock covers its checkpoint folder wherever it is)."""
    shared = tmp_path / "shared"
    os.makedirs(shared)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from minirl import launch; "
                               f"launch.lock({str(shared)!r}, '--checkpoint.dir'); print('held', flush=True); "
                               "time.sleep(60)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.delenv("RANK", raising=False)
        args = GRPOArgs()
        args.log.run_dir, args.checkpoint.dir = str(tmp_path / "b"), str(shared)
        with pytest.raises(ConfigError, match=rf"--checkpoint.dir='{shared}' is in use by a live run "
                                              rf"\(pid {holder.pid} on "):
            launch.claim(args, None)
    finally:
        holder.kill()
        holder.wait()


def test_a_run_that_logged_no_step_is_started_over_under_an_identity_of_its_own(tmp_path, monkeypatch):
    """A run killed before its first record leaves run.json and an empty metrics.jsonl: `auto` with no
    checkpoint starts fresh there (nothing of a run to keep), as a new run, not the dead one."""
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "run.json").write_text('{"run": "old", "line": "old", "from": 0}')
    monkeypatch.delenv("RANK", raising=False)
    args = GRPOArgs()
    args.log.run_dir, args.checkpoint.resume = str(tmp_path), "auto"
    os.makedirs(tmp_path / "checkpoints" / "step_00000001.tmp")  # the dead run's unfinished save
    owner = launch.claim(args, None)
    assert owner["run"] != "old" and owner["line"] == owner["run"] and launch.identity(str(tmp_path)) == owner
    args.checkpoint.resume = ""  # a plain fresh start there too: nothing is set aside (that is a resume by path's)
    assert launch.claim(args, None)["run"] not in ("old", owner["run"])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".lock", "step_00000001.tmp"]


def test_auto_that_skips_every_checkpoint_says_so_and_keeps_them(tmp_path, monkeypatch):
    """Complete checkpoints that `auto` skipped (another world size, another loop: a line each says why) are not
    "no complete checkpoint", and --log.overwrite, which would delete them, is not the only way on."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    os.makedirs(tmp_path / "checkpoints" / "step_00000002")
    (tmp_path / "checkpoints" / "step_00000002" / "COMPLETE").write_text("2\n")
    monkeypatch.delenv("RANK", raising=False)
    args = GRPOArgs()
    args.log.run_dir, args.checkpoint.resume = str(tmp_path), "auto"
    with pytest.raises(ConfigError, match=r"no checkpoint in .*checkpoints' can resume this launch \(the lines above "
                                          r"say why\); launch as they say, or start over with --log.overwrite"):
        launch.claim(args, None)
    assert os.listdir(tmp_path / "checkpoints" / "step_00000002") == ["COMPLETE"]


def test_auto_continues_the_line_and_sets_nothing_aside(tmp_path, monkeypatch):
    """`auto` resumes the newest complete checkpoint of the run's own line: the identity is kept and a newer
    unfinished save (step_4.tmp) stays where it is; only a resume by path starts a line and sets newer ones aside."""
    ckpts = tmp_path / "checkpoints"
    for name in ("step_00000002", "step_00000004.tmp"):
        os.makedirs(ckpts / name)
    (ckpts / "step_00000002" / "loop_state.json").write_text('{"steps_done": 2}')
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (tmp_path / "run.json").write_text('{"run": "r1", "line": "r1", "from": 0}')
    monkeypatch.delenv("RANK", raising=False)
    args = GRPOArgs()
    args.log.run_dir, args.checkpoint.resume = str(tmp_path), "auto"
    assert launch.claim(args, str(ckpts / "step_00000002")) == {"run": "r1", "line": "r1", "from": 0}
    assert sorted(os.listdir(ckpts)) == [".lock", "step_00000002", "step_00000004.tmp"]


def test_a_resume_by_path_starts_a_line_and_sets_the_newer_checkpoints_aside(tmp_path, monkeypatch):
    """Resuming step 2 by path while steps 4 and 6 exist: the run keeps its id on a new line from step 2, and
    steps 4 and 6 are moved (never deleted) to set_aside/<time>/; what is not a later step stays put."""
    ckpts = tmp_path / "checkpoints"
    for name in ("step_00000002", "step_00000004", "step_00000006", "set_aside"):
        os.makedirs(ckpts / name)
    (ckpts / "step_00000002" / "loop_state.json").write_text('{"steps_done": 2}')
    (tmp_path / "run.json").write_text('{"run": "r1", "line": "r1", "from": 0}')
    monkeypatch.delenv("RANK", raising=False)
    args = GRPOArgs()
    args.log.run_dir, args.checkpoint.resume = str(tmp_path), str(ckpts / "step_00000002")
    owner = launch.claim(args, args.checkpoint.resume)
    assert owner["run"] == "r1" and owner["line"] != "r1" and owner["from"] == 2
    assert sorted(os.listdir(ckpts)) == [".lock", "set_aside", "step_00000002"]
    (aside,) = os.listdir(ckpts / "set_aside")
    assert sorted(os.listdir(ckpts / "set_aside" / aside)) == ["step_00000004", "step_00000006"]
