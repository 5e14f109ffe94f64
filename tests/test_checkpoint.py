"""checkpoint.py: loading never runs what a checkpoint holds, and a checkpoint of another model shape
is refused by name (no engine); then with the real engine on CPU: exact resume, a kill mid-save,
corrupt and partial checkpoints, SIGTERM's emergency save, and the colocated cycle as the real loop
runs it."""

import json
import os
import re
import signal
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import checkpoint_names, everything, run, sigterm_after
from minirl import checkpoint, launch, models



def e2e(test):
    """The real engine, end to end: a slow test."""
    return pytest.mark.vllm(pytest.mark.slow(test))

BASE = ["--rl.batch-per-replica", "16", "--rl.group-size", "4", "--log.eval-every", "0", "--rl.deterministic",
        "--checkpoint.every", "2"]


def grpo(run_dir, *flags, env=None):
    return run([sys.executable, "-m", "minirl.grpo", *BASE, "--log.run-dir", str(run_dir), *flags], env=env)


def records(d):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time", "tokens_per_s", "memory"))}
            for line in open(d / "metrics.jsonl")]


def weights(d):
    return load_file(d / "final" / "model.safetensors")


def saved(tmp_path, world, path, **tiny):
    """One AdamW step on a sharded policy, saved; returns (checkpoint folder, parts)."""
    policy = models.sharded(path, "policy", world, "float32")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    models.token_logprobs(policy, torch.randint(3, 40, (2, 6))).sum().backward()
    opt.step()
    return checkpoint.save(str(tmp_path / "ckpt"), 1, {"policy": (policy, opt)}, {}, keep=2), {"policy": (policy, opt)}


class Payload:
    """Unpickles by running a shell command (touching `marker`), then hands back `value`'s expression."""

    def __init__(self, marker, value: str):
        self.code = f"(__import__('os').system('touch {marker}'), {value})[1]"

    def __reduce__(self):
        return (eval, (self.code,))


def test_a_crafted_metadata_is_refused_and_its_payload_never_runs(tmp_path, world, tiny_path):
    import pickle
    path, parts = saved(tmp_path, world, tiny_path)
    meta = os.path.join(path, ".metadata")
    marker = tmp_path / "pwned"
    real = open(meta, "rb").read()
    with open(meta, "wb") as f:
        pickle.dump(Payload(marker, f"__import__('pickle').loads({real!r})"), f)  # the real metadata after
    pickle.loads(open(meta, "rb").read())  # the crafted file does run its command under plain pickle...
    assert marker.exists()
    marker.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata: refers to builtins\.eval"):
        checkpoint.load(path, parts)
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata: refers to builtins\.eval"):
        checkpoint.check(path, "ppo", 1)  # and before anything is built, from the files alone
    assert not marker.exists()  # ...and minirl's loader never ran it


def test_an_unreadable_loop_state_or_metadata_and_a_parameter_it_lacks_are_refused_by_name(tmp_path, world,
                                                                                            tiny_path):
    """Read from the files before anything is built: a loop_state.json that is not JSON, a .metadata
    that is not DCP's pickle, and a parameter this run's model has that the checkpoint does not (a
    policy's checkpoint offered for a critic) are each refused naming the file or the parameter."""
    path, _ = saved(tmp_path, world, tiny_path)
    for name, bad, words in (("loop_state.json", b"{not json", "unreadable loop_state.json"),
                             (".metadata", b"not a pickle", "unreadable DCP metadata")):
        good = open(os.path.join(path, name), "rb").read()
        with open(os.path.join(path, name), "wb") as f:
            f.write(bad)
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(words)) as e:
            checkpoint.check(path, "ppo", 1)
        assert path in str(e.value)
        with open(os.path.join(path, name), "wb") as f:
            f.write(good)
    checkpoint.check(path, "ppo", 1)  # whole again
    with pytest.raises(checkpoint.CheckpointError, match=r"has no parameter 'model\.embed_tokens\.weight' for the "
                                                         r"value: it was written for another model"):
        checkpoint.check_shapes(path, launch.on_meta(tiny_path, ("value",)))


def test_a_checkpoint_whose_files_fail_to_read_is_refused_in_one_line_naming_it(tmp_path, world, tiny_path):
    """What passes `check` (every file there, none short) and still fails to read: a shard's bytes that are
    not the tensor DCP's metadata says, an RNG state that is not safetensors. Each is one CheckpointError
    naming the folder and the error's first line: the rank's own under DCP's wrapper, whose first line said
    only "CheckpointException ranks:dict_keys([0])"."""
    path, parts = saved(tmp_path, world, tiny_path)
    shard = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    for name, says in ((shard, r"\(a data file holds bytes that are not the tensors its metadata places there"),
                       ("rng_rank0.safetensors", r"\(SafetensorError: ")):
        good = open(os.path.join(path, name), "rb").read()
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"\xff" * len(good))  # the size the metadata asks, none of the content
        checkpoint.check(path, "ppo", 1)
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint.load(path, parts)
        assert re.fullmatch(rf"checkpoint {re.escape(path)} is unreadable {says}[^\n]{{0,200}}\); resume from an "
                            r"earlier one", str(e.value)), str(e.value)
        with open(os.path.join(path, name), "wb") as f:
            f.write(good)
    checkpoint.load(path, parts)  # whole again


def test_a_crafted_optimizer_item_is_refused_and_its_payload_never_runs(tmp_path, world, tiny_path):
    """A non-tensor item (an optimizer hyperparameter) that unpickles by running a command: DCP's own
    reader would run it (torch.load with weights_only=False); minirl's refuses it first."""
    policy = models.sharded(tiny_path, "policy", world, "float32")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    marker = tmp_path / "pwned"
    opt.param_groups[0]["lr"] = Payload(marker, "1e-3")  # runs only when unpickled
    path = checkpoint.save(str(tmp_path / "ckpt"), 1, {"policy": (policy, opt)}, {}, keep=2)
    assert not marker.exists()
    fresh = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    with pytest.raises(checkpoint.CheckpointError, match=r"param_groups\.0\.lr: not plain data"):
        checkpoint.load(path, {"policy": (policy, fresh)})
    assert not marker.exists()


def test_a_checkpoint_of_another_model_shape_names_the_parameter_and_both_shapes(tmp_path, world, tiny_path):
    from minirl.config import TinyModelConfig
    path, _ = saved(tmp_path, world, tiny_path)
    wider = models.build_tiny(TinyModelConfig(hidden_size=192, num_heads=3))
    policy = models.sharded(wider, "policy", world, "float32")
    parts = {"policy": (policy, torch.optim.AdamW(policy.parameters(), lr=1e-3))}
    with pytest.raises(checkpoint.CheckpointError, match=r"'model\.embed_tokens\.weight' has shape \(50, 128\) "
                                                         r"there and \(50, 192\) in this model"):
        checkpoint.load(path, parts)


@e2e
def test_a_resume_of_another_model_shape_is_refused_before_the_run_dir_is_touched(straight, tmp_path):
    """The model's shapes (built on the meta device) are checked against the checkpoint's metadata in the
    preflight: config.json and the history still describe the run's own model, which stays resumable."""
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    before = {f: (run_dir / f).read_bytes() for f in ("config.json", "metrics.jsonl")}
    p = grpo(run_dir, "--steps", "6", "--checkpoint.resume", "auto", "--model.tiny.intermediate-size", "192",
             "--model.tiny.warm-start-steps", "0")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "has shape (256, 128) there and (192, 128) in this model" in p.stderr
    assert "loading the policy" not in p.stdout
    assert {f: (run_dir / f).read_bytes() for f in before} == before


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    assert grpo(d, "--steps", "4").returncode == 0
    return d


@e2e
def test_resume_is_exact(straight, tmp_path):
    assert grpo(tmp_path, "--steps", "2").returncode == 0
    assert grpo(tmp_path, "--steps", "4", "--checkpoint.resume", "auto").returncode == 0
    a, b = weights(straight), weights(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert records(straight) == records(tmp_path)


# mu 2 and two mini-batches (the ahead pass, the determinism probe), an eval every 3 steps, a save every 2,
# and step 3's update non-finite (skipped and counted, as a NaN reward batch would make it)
RICH = ["--rl.batch-per-replica", "16", "--rl.group-size", "4", "--rl.mini-batch-per-replica", "8",
        "--rl.mu-iterations", "2", "--log.eval-every", "3", "--task.eval-prompts", "16", "--rl.deterministic",
        "--checkpoint.every", "2", "--steps", "6"]
SKIP = "nan_rewards:3-3"


def rich(run_dir, *flags):
    return [sys.executable, "-m", "minirl.grpo", *RICH, "--log.run-dir", str(run_dir), *flags]


@pytest.fixture(scope="module")
def rich_straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("rich_straight")
    p = run(rich(d), env={"MINIRL_FAULT": SKIP})
    assert p.returncode == 0, p.stderr[-2000:]
    return d


@e2e
@pytest.mark.parametrize("interrupt", ["SIGTERM", "kill -9 after a scheduled save"])
def test_an_interrupted_run_resumes_to_exactly_the_uninterrupted_one(rich_straight, tmp_path, interrupt):
    """Interrupted by a SIGTERM mid-run (an emergency save) or killed right after step 2's save (step 4
    saves nothing: its update was skipped), then resumed: every logged metric (the optimizer-step and skip counts, the eval schedule), samples.jsonl,
    the final weights and the last checkpoint's loop and RNG state are those of the run never stopped."""
    if interrupt == "SIGTERM":  # in step 4, after the skip: its emergency save is step_5, off the schedule
        p = run(rich(tmp_path), env={"MINIRL_FAULT": f"{SKIP},sigterm:4"})
        assert p.returncode == 0 and "SIGTERM: saved" in p.stdout and "at step 5" in p.stdout, p.stdout[-2000:]
    else:
        p = run(rich(tmp_path), env={"MINIRL_FAULT": f"{SKIP},kill_before_prune:2"})
        assert p.returncode == -signal.SIGKILL
    p = run(rich(tmp_path, "--checkpoint.resume", "auto"), env={"MINIRL_FAULT": SKIP})
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-2000:]
    assert "every step is done" not in p.stdout  # said only of a resume with no step left (test_ppo.py)
    straight = everything(rich_straight)
    assert [r.get("skipped_nonfinite", 0) for r in straight["metrics"] if "reward_mean" in r] == [0, 0, 0, 4, 0, 0]
    assert straight["loop_state"]["probe_done"] and straight["checkpoint"] == "step_00000006"
    assert everything(tmp_path) == straight


@e2e
def test_scheduled_saves_publish_once_per_step(straight):
    """B22: a scheduled save at a step that does not validate runs inside the update's window, so a
    save step syncs the engine once, like any other (down the after-publication path it would be twice)."""
    recs = [r for r in records(straight) if "reward_mean" in r]
    assert len(recs) == 4 and checkpoint_names(straight / "checkpoints") == ["step_00000002", "step_00000004"]
    assert [r["weight_syncs"] for r in recs] == [1, 1, 1, 1]


def history_holds_the_newest_checkpoint(run_dir) -> None:
    """What a kill at any moment leaves: metrics.jsonl holds every step the newest complete checkpoint
    claims (a resume starts after them and never writes them again)."""
    newest = checkpoint.find("auto", str(run_dir / "checkpoints"))
    done = checkpoint.steps_done(newest) if newest else 0
    steps = {r["step"] for r in records(run_dir) if "reward_mean" in r}
    assert set(range(done)) <= steps, (newest, sorted(steps))


@e2e
@pytest.mark.parametrize("point", ["kill_mid_file", "kill_in_save", "kill_before_rename", "kill_before_prune"])
def test_kill_during_save_resumes_from_the_previous_complete_checkpoint(straight, tmp_path, point):
    """kill -9 while step 4's checkpoint is written (in the update window: before its step's record):
    with a data file cut short, after the data but before the COMPLETE marker, complete but not yet
    renamed, and in place before the prune. The history holds every step the newest complete
    checkpoint claims; the resume takes step 2's (step 4's, complete before the prune, holds every step:
    that resume only exports) and the run ends exactly as one never interrupted."""
    p = grpo(tmp_path, "--steps", "4", env={"MINIRL_FAULT": f"{point}:4"})
    assert p.returncode == -signal.SIGKILL
    history_holds_the_newest_checkpoint(tmp_path)
    if point == "kill_before_prune":  # step 4's checkpoint is complete: the run is done but for its export
        assert checkpoint_names(tmp_path / "checkpoints") == ["step_00000002", "step_00000004"]
        assert not (tmp_path / "final").exists()
    else:
        ckpts = checkpoint_names(tmp_path / "checkpoints")
        assert ckpts == ["step_00000002", "step_00000004.tmp"]  # the interrupted one is never taken
    p = grpo(tmp_path, "--steps", "4", "--checkpoint.resume", "auto")
    assert p.returncode == 0 and f"step_0000000{4 if point == 'kill_before_prune' else 2}" in p.stdout
    a, b = weights(straight), weights(tmp_path)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert records(straight) == records(tmp_path)
    assert checkpoint_names(tmp_path / "checkpoints") == ["step_00000002", "step_00000004"]


@e2e
def test_a_resume_never_loses_the_history_and_the_lr_flag_wins(tmp_path):
    """`--checkpoint.resume auto` with nothing to resume says so and starts fresh; kill -9 at several
    moments of a resumed run leaves metrics.jsonl holding every step up to the checkpoint, whole
    lines only; a resume with another --rl.lr trains at the flag's rate and says so."""
    import subprocess
    import time

    from conftest import TORCHRUN_VARS
    p = grpo(tmp_path, "--steps", "2", "--checkpoint.every", "1", "--checkpoint.resume", "auto")
    assert p.returncode == 0 and "no complete checkpoint in" in p.stdout and "starting fresh" in p.stdout
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    cmd = [sys.executable, "-m", "minirl.grpo", *BASE, "--log.run-dir", str(tmp_path), "--steps", "6",
           "--checkpoint.every", "1", "--checkpoint.resume", "auto"]
    for delay in (0.5, 2.0, 4.0, 7.0):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        done = checkpoint.steps_done(checkpoint.find("auto", str(tmp_path / "checkpoints")))
        steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]  # every line whole
        assert steps[:done] == list(range(done)), (delay, done, steps)
    p = grpo(tmp_path, "--steps", "6", "--checkpoint.every", "1", "--checkpoint.resume", "auto", "--rl.lr", "5e-5",
             "--rl.lr-warmup-steps", "100")
    assert p.returncode == 0
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", p.stdout).group(1))
    # one source of the rate: the flags' schedule (warmup: 5e-5 * (k + 1) / 100 at optimizer step k = the step)
    first = 5e-5 * (resumed_at + 1) / 100
    assert (f"--rl.lr: the checkpoint's optimizer was at lr 0.0001; the schedule of the flags sets the rate, "
            f"{first:g} at the next step") in p.stdout
    lrs = {r["step"]: r["lr"] for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "lr" in r}
    assert abs(lrs[resumed_at] - first) < 1e-12
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == list(range(6))


@e2e
def test_a_run_that_can_no_longer_learn_stops_without_saving_or_exporting(tmp_path):
    """Rewards turn NaN from step 2 (an injected fault): steps 2 and 3 take no optimizer step, the run
    stops there with exit 3 and one line, no checkpoint is written from a skipped step and no export."""
    p = grpo(tmp_path, "--steps", "10", "--checkpoint.every", "1", "--rl.max-skipped-steps", "2",
             env={"MINIRL_FAULT": "nan_rewards:2"})
    assert p.returncode == 3
    assert "stopped: step 3: 2 steps in a row (2-3) took no optimizer step" in p.stderr and "Traceback" not in p.stderr
    assert checkpoint_names(tmp_path / "checkpoints") == ["step_00000001", "step_00000002"]
    assert not (tmp_path / "final").exists()
    assert [json.loads(line).get("skipped_nonfinite", 0) for line in open(tmp_path / "metrics.jsonl")] == [0, 0, 1, 1]


@e2e
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
    for path, words in ((partial, "not a complete checkpoint"), (corrupt, "cut short (100 of")):
        p = grpo(tmp_path / "run", "--steps", "6", "--checkpoint.resume", str(path))
        assert p.returncode == 2, p.stderr[-2000:]
        assert str(path) in p.stderr and words in p.stderr and "Traceback" not in p.stderr
        assert "loading the policy" not in p.stdout  # told from the files, before anything was built


@e2e
@pytest.mark.parametrize("sig, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_sigterm_saves_and_exits(tmp_path, sig, name):
    """A scheduler's SIGTERM, or a first Ctrl-C at the terminal: a checkpoint of the steps done at the
    next step boundary, a line saying so, exit 0 (Ctrl-C used to print a traceback and save nothing)."""
    metrics = tmp_path / "metrics.jsonl"
    code, err = sigterm_after([sys.executable, "-m", "minirl.grpo", *BASE, "--steps", "500", "--checkpoint.every",
                               "0", "--log.run-dir", str(tmp_path)], str(metrics), records=2, sig=sig)
    assert code == 0, err[-3000:]
    last = json.loads(metrics.read_text().strip().splitlines()[-1])["step"]
    assert checkpoint_names(tmp_path / "checkpoints") == [f"step_{last + 1:08d}"]
    assert f"{name}: saved" in err and "Traceback" not in err


@e2e
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


def test_a_large_export_is_sharded_with_an_index_transformers_reads(tmp_path, world, tiny_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    import minirl.run
    monkeypatch.setattr(minirl.run, "SHARD_BYTES", 200_000)
    policy = models.sharded(tiny_path, "policy", world, "float32")
    card = minirl.run.model_card("t", str(tiny_path), {"steps": 3})
    minirl.run.export_hf(policy, tiny_path, str(tmp_path / "final"), True, torch.bfloat16, {"README.md": card})
    files = sorted(os.listdir(tmp_path / "final"))
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert oct(os.stat(tmp_path / "final").st_mode & 0o777) == "0o755"  # readable by all, whatever the umask
    readme = (tmp_path / "final" / "README.md").read_text()
    assert "README.md" in files and "| steps | 3 |" in readme
    assert readme.startswith("---\n") and "- minirl" in readme and str(tmp_path) not in readme  # a hub header
    assert os.path.dirname(str(tiny_path)) not in readme  # no absolute path: the base model by its folder name
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.bfloat16)
    ref = models.load_policy(tiny_path)
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(ref.state_dict().values(),
                                                                     back.state_dict().values()))


@pytest.mark.parametrize("fault", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_export_leaves_the_earlier_one_whole_and_nothing_half_written(tmp_path, world, tiny_path,
                                                                               monkeypatch, fault):
    """A full disk (one line naming the folder and the error) or a Ctrl-C while the weights are written:
    the earlier export in OUT is untouched and no OUT.tmp is left."""
    import minirl.run
    policy = models.sharded(tiny_path, "policy", world, "float32")
    out = tmp_path / "final"
    minirl.run.export_hf(policy, tiny_path, str(out), True, torch.float32)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}

    def fail(*args, **kwargs):
        raise fault
    monkeypatch.setattr(minirl.run, "save_torch_state_dict", fail)
    with pytest.raises(checkpoint.CheckpointError if isinstance(fault, OSError) else KeyboardInterrupt) as e:
        minirl.run.export_hf(policy, tiny_path, str(out), True, torch.float32)
    if isinstance(fault, OSError):
        assert str(e.value) == f"exporting to {out} failed: [Errno 28] No space left on device; nothing was written there"
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["final"]


def two_checkpoints(tmp_path, world, tiny_path, loop_state):
    policy = models.sharded(tiny_path, "policy", world, "float32")
    parts = {"policy": (policy, models.adamw(policy, 1e-4, 0.01))}
    return [checkpoint.save(str(tmp_path / "checkpoints"), s, parts, loop_state, keep=5) for s in (1, 2)]


GRPO_STATE = {"loop": "grpo", "optimizer_steps": 1, "skipped": 0, "probe_done": False}


def test_auto_skips_a_complete_checkpoint_with_a_missing_or_empty_shard(tmp_path, world, tiny_path, capsys):
    """A COMPLETE marker but a lost or empty file: `auto` says so and takes the previous one; asked for
    by name it is refused naming the file. Told from the files, before anything is built."""
    first, second = two_checkpoints(tmp_path, world, tiny_path, GRPO_STATE)
    shard = next(n for n in os.listdir(second) if n.endswith(".distcp"))
    open(os.path.join(second, shard), "w").close()  # emptied
    assert checkpoint.find("auto", str(tmp_path / "checkpoints"), "grpo", 1) == first
    assert f"skipping checkpoint {second}: {shard} is missing or empty" in capsys.readouterr().out
    os.remove(os.path.join(second, shard))
    with pytest.raises(checkpoint.CheckpointError, match=r"rank 0's shard \(__0_\*\.distcp\) is missing"):
        checkpoint.find(second, "", "grpo", 1)


@pytest.mark.parametrize("change, says", [
    (lambda s: s.pop("optimizer_steps"), "loop_state.json has no optimizer_steps"),
    (lambda s: s.update(loop="ppo"), "written by minirl.ppo; this is minirl.grpo"),
    (lambda s: s.update(world_size=4), "written by 4 train rank(s); this run has 1"),
])
def test_a_checkpoint_of_another_loop_world_or_an_incomplete_loop_state_is_refused_by_its_files(
        tmp_path, world, tiny_path, change, says):
    _, second = two_checkpoints(tmp_path, world, tiny_path, GRPO_STATE)
    path = os.path.join(second, "loop_state.json")
    state = json.load(open(path))
    change(state)
    json.dump(state, open(path, "w"))
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(says)):
        checkpoint.find(second, "", "grpo", 1)


def test_a_grpo_resume_from_a_ppo_checkpoint_fails_before_the_model_is_built(tmp_path, world, tiny_path):
    _, second = two_checkpoints(tmp_path, world, tiny_path, {"loop": "ppo"})
    p = grpo(tmp_path / "run", "--steps", "4", "--checkpoint.resume", second)
    assert p.returncode == 2 and "written by minirl.ppo" in p.stderr and "Traceback" not in p.stderr
    assert "loading the policy" not in p.stdout  # refused before anything was built


def test_a_loop_state_without_a_step_count_and_a_partial_folder_are_refused_by_the_tools_too(tmp_path, world,
                                                                                            tiny_path):
    """What the tools read of a checkpoint: its step count (a loop state without one, or not a number, is named as
    unreadable), and one part's weights (`load_model`: a folder without the COMPLETE marker is refused)."""
    path, _ = saved(tmp_path, world, tiny_path)
    state = os.path.join(path, "loop_state.json")
    for bad, why in (({}, "KeyError"), ({"steps_done": "one"}, "ValueError")):
        with open(state, "w") as f:
            json.dump(bad, f)
        with pytest.raises(checkpoint.CheckpointError, match=f"checkpoint {re.escape(path)}: unreadable "
                                                             f"loop_state.json \\({why}"):
            checkpoint.steps_done(path)
    os.remove(os.path.join(path, checkpoint.MARKER))
    with pytest.raises(checkpoint.CheckpointError,
                       match="has no COMPLETE marker: it is partial and will not be loaded"):
        checkpoint.load_model(path, "policy", models.sharded(tiny_path, "policy", world, "float32"))


def test_steps_below_the_steps_done_are_refused_and_equal_ones_resume_to_finish_the_run(tmp_path, world, tiny_path):
    """Fewer --steps than the checkpoint holds is refused, not a silent no-op; as many resumes, to finish a run
    stopped after its last step (its export)."""
    _, second = two_checkpoints(tmp_path, world, tiny_path, GRPO_STATE)
    with pytest.raises(checkpoint.CheckpointError, match="--steps=1: .* already holds 2 steps, more than asked; "
                                                          "give --steps 2 or more"):
        checkpoint.find("auto", str(tmp_path / "checkpoints"), "grpo", 1, 1)
    assert checkpoint.find("auto", str(tmp_path / "checkpoints"), "grpo", 1, 2) == second
    assert checkpoint.find("auto", str(tmp_path / "checkpoints"), "grpo", 1, 3) == second


@e2e
def test_a_save_on_a_full_disk_says_so_and_leaves_nothing_to_resume(tmp_path):
    """The checkpoint folder on a 256 KiB file system (a tmpfs, mounted as root): the first save fails,
    the run exits 2 with one line naming the device error, and no partial folder is left behind."""
    import subprocess
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        p = grpo(tmp_path / "run", "--steps", "3", "--checkpoint.every", "1", "--checkpoint.dir", str(disk))
        assert p.returncode == 2, p.stderr[-2000:]
        assert "No space left on device" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert checkpoint_names(disk) == []
    finally:
        subprocess.run(["umount", str(disk)])


@e2e
def test_a_checkpoint_folder_belongs_to_one_run(straight, tmp_path):
    """A second run pointed at another run's --checkpoint.dir (fresh, or `auto`) is refused before anything
    is built or written: it would have pruned the other's checkpoints, or resumed another seed's weights
    under its own history."""
    before = checkpoint_names(straight / "checkpoints")
    for resume in ("", "auto"):
        p = grpo(tmp_path / "other", "--steps", "6", "--checkpoint.dir", str(straight / "checkpoints"),
                 *(["--checkpoint.resume", resume] if resume else []))
        assert p.returncode == 2 and "holds another run's checkpoint" in p.stderr and str(straight) in p.stderr
        assert "Traceback" not in p.stderr and "loading the policy" not in p.stdout
    assert not (tmp_path / "other").exists() and checkpoint_names(straight / "checkpoints") == before


@e2e
def test_a_resume_by_path_from_an_older_checkpoint_sets_the_newer_ones_aside(straight, tmp_path):
    """Resuming step 2 by path (to redo steps 3-4 another way) moves step 4 aside, with a line saying where;
    the new line's checkpoints are the ones `auto` takes after a preemption, never the abandoned line's."""
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    older = run_dir / "checkpoints" / "step_00000002"
    p = grpo(run_dir, "--steps", "3", "--checkpoint.every", "1", "--checkpoint.resume", str(older))
    assert p.returncode == 0, p.stderr
    aside = re.search(r"they are set aside in (\S+)", p.stdout).group(1)
    assert os.listdir(aside) == ["step_00000004"] and os.path.dirname(os.path.dirname(aside)).endswith("checkpoints")
    assert checkpoint_names(run_dir / "checkpoints") == ["set_aside", "step_00000002", "step_00000003"]
    p = grpo(run_dir, "--steps", "4", "--checkpoint.every", "1", "--checkpoint.resume", "auto")
    assert p.returncode == 0 and "step_00000003 at step 3" in p.stdout, p.stdout + p.stderr
    assert [r["step"] for r in records(run_dir) if "reward_mean" in r] == [0, 1, 2, 3]


def test_auto_never_takes_a_checkpoint_of_a_line_the_run_left(tmp_path, world, tiny_path):
    """Were a newer checkpoint of the old line still in place (a crash among the moves), `auto` passes
    over it: past the step the run's current line started from, only that line's checkpoints count."""
    first, second = two_checkpoints(tmp_path, world, tiny_path, {**GRPO_STATE, "run": "r", "line": "old"})
    owner = {"run": "r", "line": "new", "from": 1}
    assert checkpoint.find("auto", str(tmp_path / "checkpoints"), "grpo", 1, owner=owner) == first
    state = json.load(open(os.path.join(second, "loop_state.json")))
    json.dump({**state, "line": "new"}, open(os.path.join(second, "loop_state.json"), "w"))
    assert checkpoint.find("auto", str(tmp_path / "checkpoints"), "grpo", 1, owner=owner) == second
    assert checkpoint.foreign(str(tmp_path / "checkpoints"), owner) == ""
    assert checkpoint.foreign(str(tmp_path / "checkpoints"), {}).startswith(first)


def test_a_save_makes_its_data_durable_then_marks_renames_and_prunes_in_that_order(tmp_path, world, tiny_path,
                                                                                  monkeypatch):
    """Four saves with --checkpoint.keep 2, every fsync, rename and removal recorded: each data file and the
    folder are on disk before the COMPLETE marker, the marker before the rename, the rename (and its
    folder's fsync) before anything older is pruned; the newest two remain, and a re-save of a step
    replaces it whole."""
    import shutil
    calls = []
    real_fsync, real_rename, real_rmtree = os.fsync, os.rename, shutil.rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (calls.append(("rename", str(a), str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(shutil, "rmtree", lambda p, **k: (calls.append(("rmtree", str(p))), real_rmtree(p, **k))[1])
    policy = models.sharded(tiny_path, "policy", world, "float32")
    parts, d = {"policy": (policy, models.adamw(policy, 1e-4, 0.01))}, str(tmp_path / "checkpoints")
    for step in (1, 2, 3, 4):
        calls.clear()
        final = checkpoint.save(d, step, parts, dict(GRPO_STATE), keep=2)
        tmp = final + ".tmp"
        files = {os.path.join(tmp, f) for f in os.listdir(final) if f != checkpoint.MARKER}
        synced = [c[1] for c in calls if c[0] == "fsync"]
        marker = synced.index(os.path.join(tmp, checkpoint.MARKER))
        assert files <= set(synced[:marker]) and tmp in synced[:marker]  # data and folder first, then the marker
        rename = calls.index(("rename", tmp, final))
        assert calls.index(("fsync", os.path.join(tmp, checkpoint.MARKER))) < rename
        assert ("fsync", d) in calls[rename:]  # the rename itself on disk
        pruned = [c for c in calls[rename:] if c[0] == "rmtree"]
        assert pruned == ([("rmtree", os.path.join(d, f"step_{step - 2:08d}"))] if step > 2 else [])
    assert checkpoint_names(d) == ["step_00000003", "step_00000004"]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    checkpoint.save(d, 4, parts, dict(GRPO_STATE), keep=2)  # a re-save of step 4 (after a resume from step 3)
    assert checkpoint_names(d) == ["step_00000003", "step_00000004"]
    fresh = models.sharded(tiny_path, "policy", world, "float32")
    checkpoint.load_model(os.path.join(d, "step_00000004"), "policy", fresh)
    assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(policy.parameters(), fresh.parameters()))


def test_an_export_holds_every_file_of_the_model_folder_in_the_dtype_asked(tmp_path, world, tiny_path):
    """A model folder with a chat template file (`.jinja`) and a generation config: each is in the export,
    byte for byte, and the weights are written in --model.dtype (read back from the file's own header).
    A source that is itself an export passes on neither its model card nor its run's config."""
    import shutil

    import minirl.run
    src = tmp_path / "model"
    shutil.copytree(tiny_path, src)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (src / "generation_config.json").write_text('{"do_sample": false}')
    for its_own in ("README.md", "minirl_config.json"):
        (src / its_own).write_text("{}")
    policy = models.sharded(str(src), "policy", world, "float32")
    minirl.run.export_hf(policy, str(src), str(tmp_path / "out"), True, torch.bfloat16)
    assert not {"README.md", "minirl_config.json"} & set(os.listdir(tmp_path / "out"))
    kept = {f for f in os.listdir(src) if not f.endswith((".safetensors", ".md")) and f != "minirl_config.json"}
    assert {"chat_template.jinja", "generation_config.json"} <= kept <= set(os.listdir(tmp_path / "out"))
    assert all((tmp_path / "out" / f).read_bytes() == (src / f).read_bytes() for f in kept)
    with open(tmp_path / "out" / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {t["dtype"] for k, t in header.items() if k != "__metadata__"} == {"BF16"}


# ---- in process, no engine: what the checkpoint module's mutation run found only the end-to-end tests checking ----

def optimizer_tensors(opt) -> list:
    """This rank's share of every tensor in the optimizer's state: the moments and AdamW's scalar steps."""
    return [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()]


def test_a_save_loads_back_its_weights_optimizer_loop_state_and_every_rng(tmp_path, world, tiny_path):
    """Save after one AdamW step, then move everything on (weights, moments, python's, numpy's and torch's
    generators): `load` brings each back exactly and returns the loop state with what `save` adds."""
    import random

    import numpy as np
    path, parts = saved(tmp_path, world, tiny_path)  # one AdamW step taken, so the optimizer has moments
    policy, opt = parts["policy"]
    weights = [p.full_tensor().clone() for p in policy.parameters()]
    moments = [t.clone() for t in optimizer_tensors(opt)]
    random.seed(1), np.random.seed(2), torch.manual_seed(3)  # the generators as the second save records them
    checkpoint.save(str(tmp_path / "again"), 1, parts, dict(GRPO_STATE), keep=2)
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    models.token_logprobs(policy, torch.randint(3, 40, (2, 6))).sum().backward()
    opt.step()
    state = checkpoint.load(str(tmp_path / "again" / "step_00000001"), parts)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(weights, policy.parameters()))
    assert all(torch.equal(a, t) for a, t in zip(moments, optimizer_tensors(opt), strict=True))
    assert {k: state[k] for k in (*GRPO_STATE, "steps_done", "world_size")} == {**GRPO_STATE, "steps_done": 1,
                                                                               "world_size": 1}
    assert path.endswith("step_00000001") and os.path.isfile(os.path.join(path, checkpoint.MARKER))


def test_a_data_file_shorter_than_its_metadata_says_is_named_with_both_sizes(tmp_path, world, tiny_path):
    first, second = two_checkpoints(tmp_path, world, tiny_path, GRPO_STATE)
    checkpoint.check(second, "grpo", 1)
    data = os.path.join(second, next(n for n in sorted(os.listdir(second)) if n.endswith(".distcp")))
    size = os.path.getsize(data)
    os.truncate(data, size - 1)
    with pytest.raises(checkpoint.CheckpointError, match=rf"{os.path.basename(data)} is cut short \({size - 1} of "
                                                         rf"{size} bytes\); resume from an earlier one"):
        checkpoint.check(second, "grpo", 1)
    assert checkpoint.find("auto", str(tmp_path / "checkpoints"), "grpo", 1) == first


def test_auto_and_a_path_take_only_complete_checkpoints(tmp_path, world, tiny_path):
    """`auto` passes over an interrupted save (`.tmp`) and a folder without its marker; named by path,
    such a folder is refused, and a folder that holds checkpoints is told its newest."""
    first, second = two_checkpoints(tmp_path, world, tiny_path, GRPO_STATE)
    os.rename(second, second.replace("step_00000002", "step_00000003") + ".tmp")
    os.remove(os.path.join(first, checkpoint.MARKER))
    d = str(tmp_path / "checkpoints")
    assert checkpoint.find("auto", d, "grpo", 1) is None
    with pytest.raises(checkpoint.CheckpointError, match=r"not a complete checkpoint \(no COMPLETE marker"):
        checkpoint.find(first, d, "grpo", 1)
    open(os.path.join(first, checkpoint.MARKER), "w").close()
    for holder in (d, str(tmp_path)):  # the run's checkpoints/, the run directory: named as what they are
        with pytest.raises(checkpoint.CheckpointError, match=rf"={re.escape(repr(holder))} holds checkpoints and is "
                                                             rf"not one: give one of them \(the newest complete one "
                                                             rf"is {re.escape(first)}\)"):
            checkpoint.find(holder, d, "grpo", 1)


def test_a_metadata_naming_any_torch_function_is_refused(tmp_path, world, tiny_path):
    """Only torch's dtypes are admitted from module `torch`: a pickle calling `torch.load` is not."""
    path, _ = saved(tmp_path, world, tiny_path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"ctorch\nload\n.")  # GLOBAL torch.load
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata: refers to torch\.load, which"):
        checkpoint.check(path, "ppo", 1)


def test_a_checkpoint_written_under_python_3_13_is_read_whatever_python_reads_it(tmp_path, world, tiny_path,
                                                                                  monkeypatch):
    """Python 3.13 pickles the metadata's path as pathlib._local.PosixPath (3.12 and 3.14: pathlib.PosixPath): a
    3.13 run's checkpoint is checked and resumed, its moved-on weights restored. Here 3.13's pickle is made as
    3.13 makes it: PosixPath's module is pathlib._local, and pickle finds the class there."""
    import pathlib
    import pickle
    import types
    path, parts = saved(tmp_path, world, tiny_path)
    meta = os.path.join(path, ".metadata")
    metadata = checkpoint._read_metadata(path)
    local = sys.modules.get("pathlib._local") or types.ModuleType("pathlib._local")
    monkeypatch.setattr(local, "PosixPath", pathlib.PosixPath, raising=False)
    monkeypatch.setitem(sys.modules, "pathlib._local", local)
    monkeypatch.setattr(pathlib.PosixPath, "__module__", "pathlib._local")
    with open(meta, "wb") as f:
        pickle.dump(metadata, f)
    assert b"pathlib._local" in open(meta, "rb").read()  # as 3.13 writes it
    policy, _ = parts["policy"]
    weights = [p.full_tensor().clone() for p in policy.parameters()]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    checkpoint.check(path, "ppo", 1)
    checkpoint.load(path, parts)
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(weights, policy.parameters(), strict=True))


def test_a_grpo_resume_of_a_state_without_its_loop_asks_whether_it_is_ppos(tmp_path, world, tiny_path):
    _, second = two_checkpoints(tmp_path, world, tiny_path, {})
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check(second, "grpo", 1)
    assert str(e.value).endswith("has no optimizer_steps, skipped, probe_done (a minirl.ppo checkpoint?)")
    _, second = two_checkpoints(tmp_path / "b", world, tiny_path, {"loop": "grpo"})
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check(second, "grpo", 1)
    assert str(e.value).endswith("has no optimizer_steps, skipped, probe_done")


def test_a_model_with_a_non_finite_parameter_is_never_written_and_the_parameter_is_named(tmp_path, world, tiny_path):
    policy = models.sharded(tiny_path, "policy", world, "float32")
    with torch.no_grad():
        policy.model.norm.weight.to_local()[0] = float("nan")
    with pytest.raises(checkpoint.CheckpointError, match=r"not finite \(the policy's model\.norm\.weight\)$"):
        checkpoint.save(str(tmp_path / "c"), 1, {"policy": (policy, models.adamw(policy, 1e-4, 0.0))}, {}, keep=2)
    assert not (tmp_path / "c").exists()


def test_a_failed_save_names_the_os_error_or_the_room_the_shard_needs(tmp_path, world, tiny_path, monkeypatch):
    """DCP's own error under a failed save: an OSError by its errno and file; torch's writer on a full disk
    reports "unexpected pos", so too little room for this rank's shard (parameters and moments) is said so."""
    import shutil
    from types import SimpleNamespace
    path, parts = saved(tmp_path, world, tiny_path)
    d = str(tmp_path / "c")

    def fails(error):
        def save(*args, **kwargs):
            raise RuntimeError("wrapped") from error
        monkeypatch.setattr(checkpoint.dcp, "save", save)
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint.save(d, 2, parts, {}, keep=2)
        assert os.listdir(d) == []  # nothing left to resume
        return str(e.value)

    assert fails(OSError(5, "Input/output error", "x.distcp")).endswith(
        "failed: [Errno 5] Input/output error: x.distcp; the earlier checkpoints are untouched")
    policy, opt = parts["policy"]
    need = sum(t.numel() * t.element_size() for t in [*(p.to_local() for p in policy.parameters()),
                                                      *optimizer_tensors(opt)])
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=2**20))
    assert (f"[Errno 28] No space left on device (1.0 MiB free under {d}, this rank's shard needs about "
            f"{need / 2**20:.1f} MiB); free some space") in fails(RuntimeError("unexpected pos 123"))
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(free=need))
    assert fails(ValueError("first line\nsecond")).endswith("failed: RuntimeError: wrapped; the earlier checkpoints "
                                                            "are untouched")


def test_a_resume_says_when_the_flags_rate_differs_from_the_checkpoints(world, tiny_path):
    opt = models.adamw(models.load_policy(tiny_path), 1e-4, 0.0)
    said = []
    checkpoint.report_lr(opt, 1e-4, "--rl.lr", said.append)
    assert said == []
    checkpoint.report_lr(opt, 2e-4, "--rl.lr", said.append)
    assert said == ["--rl.lr: the checkpoint's optimizer was at lr 0.0001; the schedule of the flags sets the rate, "
                    "0.0002 at the next step"]
