"""tools/rehearse.py: `--dry-run --rehearse` runs the real train step on fake CUDA tensors for train rank 0 of
a world the fake backend plays, at a real model's shape (tests/data/models: config.json only), and
measures it with FSDPMemTracker beside the plan's estimate."""

import os
import re
import sys

import pytest

from conftest import ROOT, run, start

MODELS = os.path.join(ROOT, "tests", "data", "models")
LAST = re.compile(r"rehearsal (grpo|ppo) (\S+) world (\d+): peak ([\d.]+) GiB per card, plan ([\d.]+) GiB, "
                  r"host reads per (?:optimizer )?step (\d+), device mismatches (\d+) .*")
RESULT = re.compile(r"rehearsal \w+ \S+ world \d+: rehearsed GiB per card: (.*)")


def rehearse(module: str, flags: list[str], tmp_path):
    """Start a rehearsal; the returned call waits for it and returns (the process, its stdout lines)."""
    finish = start([sys.executable, "-m", module, *flags, "--log.run-dir", str(tmp_path / "run"), "--dry-run",
                    "--rehearse", "--dry-run-device", "cuda"], timeout=600)

    def result():
        p = finish()
        return p, p.stdout.strip().splitlines()
    result.stop = finish.stop
    return result


def recipe(path: str, model: str, stand_in: str) -> list[str]:
    """A recipe's flags at `model`'s shape, on a step of two chunks of the stand-in prompts."""
    from test_recipes import flags
    _, nproc, argv, _ = flags(os.path.join(ROOT, "recipes", path))
    argv = [stand_in if a.endswith(".jsonl") else a for a in argv]
    argv[argv.index("--model.path") + 1] = os.path.join(MODELS, model)
    argv[argv.index("--ppo.num-prompts-per-step") + 1] = "84"
    return [*argv, "--dry-run-world-size", str(nproc)]


@pytest.fixture(scope="module")
def at_real_shapes(tmp_path_factory):
    """The three rehearsals at a real model's shape, started together: each keeps one core busy (fake
    tensors dispatch in Python), so they share the machine's cores instead of queueing."""
    from minirl.tools.fakecuda import library
    library()  # compiled here once, not by three processes at the same time
    d = tmp_path_factory.mktemp("rehearsals")
    (d / "data.jsonl").write_text('{"prompt": "q", "answer": "1"}\n' * 4)
    stand_in = str(d / "data.jsonl")
    started = {
        "grpo 0.5b": rehearse("minirl.grpo", [
            "--model.path", os.path.join(MODELS, "Qwen2.5-0.5B-Instruct"), "--model.dtype", "bfloat16",
            "--task.name", "jsonl", "--task.path", stand_in, "--rl.group-size", "8", "--rl.batch-per-replica", "64",
            "--rl.micro-batch-per-replica", "32", "--rl.kl-coef", "0.001", "--rollout.max-prompt-tokens", "512",
            "--rollout.max-tokens", "512", "--dry-run-world-size", "8"], d / "grpo"),
        "ppo 0.5b": rehearse("minirl.ppo", recipe("gsm8k_ppo_8gpu.sh", "Qwen2.5-0.5B-Instruct", stand_in), d / "ppo"),
        "ppo 7b": rehearse("minirl.ppo", recipe("gsm8k_ppo_7b_8gpu.sh", "Qwen2.5-7B-Instruct", stand_in), d / "7b"),
    }
    yield started
    for result in started.values():  # those a `-k` left out
        result.stop()


def agree(p, lines, loop: str, world: int) -> dict:
    """The run ended with the rehearsal line: no device mismatch, the plan within 25% of the peak."""
    assert p.returncode == 0
    last = LAST.fullmatch(lines[-1])
    assert last, lines[-1]
    assert last.group(1) == loop and last.group(2) == "Qwen2.5-0.5B-Instruct" and int(last.group(3)) == world
    peak, planned = float(last.group(4)), float(last.group(5))
    assert int(last.group(7)) == 0
    assert abs(planned / peak - 1) <= 0.25, (peak, planned)
    measured = dict(re.findall(r"(\w+) ([\d.]+)", next(RESULT.fullmatch(x) for x in lines if RESULT.fullmatch(x))
                               .group(1)))
    return {k: float(v) for k, v in measured.items()}


def test_rehearsal_of_grpo_at_the_0_5b_shape_on_8_ranks_finds_no_device_mismatch_and_agrees_with_the_plan(
        at_real_shapes):
    """GRPO's update at Qwen2.5-0.5B, world 8, the 1-GPU recipe's sequence lengths: reference scored
    first, two policy micro-batches (the second packed), clip, step, the weight-sync gather."""
    p, lines = at_real_shapes["grpo 0.5b"]()
    got = agree(p, lines, "grpo", 8)
    # what the step holds: float32 masters and AdamW's moments (1/8 of 0.49B parameters each), and
    # the activations of a micro-batch of 4 x 1024 tokens, far the largest
    assert 0.2 < got["params"] and 0.4 < got["optimizer"] < 0.5 and got["activations"] > 3 * got["params"]


def test_rehearsal_of_streamed_ppo_at_the_0_5b_shape_on_8_ranks_finds_no_device_mismatch_and_agrees_with_the_plan(
        at_real_shapes):
    """The 8-GPU PPO recipe's flags (2 rollout ranks, 6 train ranks, chunks of 42 groups) on a step of
    two chunks: value, reference and policy per chunk, the close, the refit's gather and buckets."""
    from test_recipes import flags
    _, nproc, _, _ = flags(os.path.join(ROOT, "recipes", "gsm8k_ppo_8gpu.sh"))
    p, lines = at_real_shapes["ppo 0.5b"]()
    got = agree(p, lines, "ppo", nproc - 2)
    assert got["grads"] > 0 and got["optimizer"] > 0


def test_a_cpu_tensor_planted_in_the_step_fails_the_rehearsal_naming_the_op_and_the_line(tmp_path):
    """The policy loss given a mask built without a device (torch.ones(shape): on the host): every CPU
    test passes with it, a GPU run would fail, and the rehearsal stops there naming both."""
    from minirl.tools.fakecuda import library as fake_cuda_library
    plant = ("import sys, torch, minirl.grpo as g; f = g.policy_loss; "
             "g.policy_loss = lambda lp, old, adv, mask, *a, **k: f(lp, old, adv, torch.ones(mask.shape), *a, **k); "
             "g.cli(sys.argv[1:])")
    flags = ["--rl.batch-per-replica", "16", "--rl.group-size", "4", "--dry-run", "--dry-run-world-size", "2"]
    child = {"LD_PRELOAD": fake_cuda_library(), "MINIRL_REHEARSAL_CHILD": "1"}  # what tools.rehearse.run sets
    planted = start([sys.executable, "-c", plant, *flags, "--log.run-dir", str(tmp_path / "a")], env=child)
    clean = start([sys.executable, "-m", "minirl.grpo", *flags, "--log.run-dir", str(tmp_path / "b")], env=child)
    p = planted()
    assert p.returncode == 1
    line = p.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"rehearsal grpo tiny world 2: device mismatch in aten\.\w+\.\w+: cuda:0 meets cpu at "
                        r"minirl/objective\.py:\d+ .*; device mismatches 1 .*", line), line
    clean = clean()
    assert clean.returncode == 0 and "device mismatches 0" in clean.stdout.strip().splitlines()[-1]


def test_rehearse_asks_for_a_dry_run_and_a_compiler_in_one_line(tmp_path):
    p = run([sys.executable, "-m", "minirl.grpo", "--rehearse", "--log.run-dir", str(tmp_path / "a")])
    assert p.returncode == 2 and "--rehearse is part of a dry run: add --dry-run" in p.stderr
    empty = tmp_path / "bin"
    empty.mkdir()
    p = run([sys.executable, "-m", "minirl.grpo", "--dry-run", "--rehearse", "--log.run-dir", str(tmp_path / "b")],
            env={"PATH": str(empty), "CXX": "no-such-compiler", "MINIRL_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 2
    errors = [x for x in p.stderr.splitlines() if "error" in x]
    assert errors == ["minirl.grpo: error: --rehearse needs a C++ compiler to build its CUDA stand-ins against "
                      "torch's headers (once); none is on PATH: install g++ or set CXX"], p.stderr


def test_the_7b_ppo_recipe_fits_80_gib_train_cards_with_10_percent_to_spare(at_real_shapes):
    """recipes/gsm8k_ppo_7b_8gpu.sh at the Qwen2.5-7B shape on a step of two chunks: every train card's
    rehearsed peak, a checkpoint's and the export's included, is at most 72 GiB of 80, and the plan
    agrees within 25%. (Without activation checkpointing the same step holds 33.5 GiB of activations.)"""
    p, lines = at_real_shapes["ppo 7b"]()
    assert p.returncode == 0
    last = LAST.fullmatch(lines[-1])
    assert last and last.group(2) == "Qwen2.5-7B-Instruct" and int(last.group(7)) == 0, lines[-1]
    peak, planned = float(last.group(4)), float(last.group(5))
    assert peak <= 72.0 and lines[-1].endswith("; fits)") and abs(planned / peak - 1) <= 0.25, lines[-1]


def test_the_rehearsal_counts_host_reads_per_optimizer_step_and_none_is_per_micro_batch(tmp_path):
    """GRPO's optimizer step at 1 and at 8 micro-batches reads the same number of CUDA values back to the
    host (the window's finiteness and norm, the step's metrics): none per micro-batch, so on a GPU the
    queue is never drained inside the step. The built-in model's shape keeps it quick."""
    counts = []
    started = [rehearse("minirl.grpo", ["--rl.group-size", "4", "--rl.batch-per-replica", "32",
                                        "--rl.micro-batch-per-replica", str(micro), "--dry-run-world-size", "1"],
                        tmp_path / str(micro))
               for micro in (32, 4)]  # n_micro 1 and 8 of a mini-batch of 32 rows
    for result in started:
        p, lines = result()
        assert p.returncode == 0, lines[-3:]
        last = LAST.fullmatch(lines[-1])
        assert last and int(last.group(7)) == 0, lines[-1]
        counts.append(int(last.group(6)))
    assert counts[0] == counts[1] and 0 < counts[0] <= 4, counts
