"""End to end: `python -m minirl.grpo` (world of one) and `torchrun --nproc-per-node 2 -m minirl.grpo`
on the built-in task with the real vLLM engine and FSDP2 on CPU."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import GRPO_SMALL as STEPS
from conftest import run, start

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def records(run_dir):
    """The step records (the baseline evaluation before the first update is a record of its own)."""
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "reward_mean" in r]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    p = run([sys.executable, "-m", "minirl.grpo", *STEPS, "--log.run-dir", str(d)])
    assert p.returncode == 0
    return d, p


def test_single_process_run_logs_every_step_and_exports_hf(one_rank):
    d, p = one_rank
    recs = records(d)
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert 0.0 <= r["reward_mean"] <= 1.0
        for key in ("grpo_loss", "grpo_denom", "grpo_clipfrac", "time/generate", "time/train", "time/publish",
                    "reward_std", "frac_reward_zero_std", "completion_len_min", "completion_clip_ratio", "entropy",
                    "lr", "logprob_gap", "memory_peak_gib"):
            assert key in r, key
        assert 0 <= r["frac_reward_zero_std"] <= 1 and r["completion_len_min"] <= r["completion_len_max"]
        assert r["entropy"] > 0 and r["logprob_gap"] < 1e-3 and r["memory_peak_gib"] > 0.1
    baseline = json.loads(open(d / "metrics.jsonl").readline())  # scored before the first update
    assert {k: v for k, v in baseline.items() if not k.startswith("time/")} == {
        "step": 0, "eval_accuracy": baseline["eval_accuracy"], "eval_version": 0}
    assert baseline["time/eval"] > 0  # start-up phases (build_trainer, build_engine) may ride along
    assert [r.get("eval_version") for r in recs] == [None, 2, 3]  # every 2 steps, and after the last
    assert "reward" in p.stdout and "step    2" in p.stdout
    assert all(r["reward/count"] == r["reward_mean"] for r in recs)  # the one built-in reward, logged by name
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(d / "final")
    saved = load_file(d / "final" / "model.safetensors")
    assert torch.equal(m.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    assert json.load(open(d / "config.json"))["rl"]["group_size"] == 4
    # the engine's own start-up lines (vLLM's logger) go to <run dir>/engine.log, not the console
    said = "Enforce eager set, disabling torch.compile"
    assert said in (d / "engine.log").read_text() and said not in p.stdout + p.stderr


def test_every_eval_writes_its_completions_to_samples_jsonl_and_prints_two(one_rank):
    d, p = one_rank
    rows = [json.loads(line) for line in open(d / "samples.jsonl")]
    evals = [r for r in map(json.loads, open(d / "metrics.jsonl")) if "eval_accuracy" in r]
    assert [(r["step"], r["eval_version"]) for r in rows[::128]] == [(r["step"], r["eval_version"]) for r in evals]
    assert len(rows) == 128 * len(evals)
    for r in rows:
        assert set(r) == {"step", "eval_version", "prompt", "completion", "answer", "reward", "clipped", "rewards"}
        assert r["reward"] == float(r["completion"] == r["answer"] and not r["clipped"])  # the strict scorer
        assert r["rewards"] == {"count": r["reward"]}  # each function's value: here the one function's
    for e in evals:  # eval_accuracy is the mean reward of the eval's rows
        mine = [r["reward"] for r in rows if r["eval_version"] == e["eval_version"]]
        assert e["eval_accuracy"] == pytest.approx(sum(mine) / len(mine))
    shown = [line for line in p.stdout.splitlines() if line.startswith("  sample (version")]
    assert len(shown) == 2 * len(evals) and repr(rows[0]["prompt"]) in shown[0]


def test_two_rank_torchrun_matches_one_rank(one_rank, tmp_path):
    """Same seed, same global batch: two data-parallel ranks see the same data as one (B14) and
    reach the same weights up to reduction order."""
    d1, _ = one_rank
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             "-m", "minirl.grpo", *STEPS, "--log.run-dir", str(tmp_path)])
    assert p.returncode == 0
    r1, r2 = records(d1), records(tmp_path)
    assert [r["reward_mean"] for r in r1] == [r["reward_mean"] for r in r2]
    for key in ("grpo_loss", "entropy"):  # a per-token rate weighted by each rank's tokens (B13)
        assert [r[key] for r in r2] == pytest.approx([r[key] for r in r1], rel=1e-4), key
    # each rank scores half the held-out prompts; rank 0 writes them all, in the set's order
    held = lambda d: [(r["prompt"], r["eval_version"]) for r in map(json.loads, open(d / "samples.jsonl"))]  # noqa: E731
    assert held(tmp_path) == held(d1)
    # two engines, a log each: one file shared by both would interleave their lines
    assert {f.name for f in tmp_path.glob("engine*.log")} == {"engine_rank0.log", "engine_rank1.log"}
    a, b = load_file(d1 / "final" / "model.safetensors"), load_file(tmp_path / "final" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.dist
def test_four_ranks_match_one_rank(one_rank, grpo_four_ranks):
    """torchrun --nproc-per-node 4: four FSDP2 shards and four colocated engines (one thread each),
    one group per rank per step, reach what one rank reaches."""
    d1, _ = one_rank
    r1, r4 = records(d1), records(grpo_four_ranks)
    assert [r["reward_mean"] for r in r1] == [r["reward_mean"] for r in r4]
    assert [r["weight_syncs"] for r in r4] == [1, 1, 1]
    a, b = load_file(d1 / "final" / "model.safetensors"), load_file(grpo_four_ranks / "final" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_bad_flags_fail_fast_naming_the_flag(tmp_path, tiny_path):
    """One line naming the flag or file, exit 2, no traceback, nothing built (docs/reliability.md)."""
    import shutil
    garbage = tmp_path / "garbage"
    shutil.copytree(tiny_path, garbage)
    (garbage / "config.json").write_text("{ not json")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "ab#a=", "answer": "1"}\n{"prompt": null, "answer": "1"}\n')
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 0}\n')
    cases = [(["--model.path", str(tmp_path / "nope")], "--model.path"),
             (["--model.tiny.num-heads", "8"], "--model.tiny.num-heads"),
             (["--rollout.kv-cache-gib", "500"], "--rollout.kv-cache-gib"),
             (["--rl.batch-per-replica", "12"], "--rl.batch-per-replica"),
             (["--model.path", str(garbage)], "config.json is not valid JSON"),
             (["--task.name", "jsonl", "--task.path", str(bad_jsonl)], f"{bad_jsonl}:2"),
             (["--rl.clip-eps", "-0.2"], "--rl.clip-eps"),
             (["--task.reward", "no_such_module_xyz:f"], "--task.reward"),
             (["--log.run-dir", str(used)], "already holds a run")]
    started = [start([sys.executable, "-m", "minirl.grpo", *flags,
                      *([] if "--log.run-dir" in flags else ["--log.run-dir", str(tmp_path / f"r{i}")])], timeout=120)
               for i, (flags, _) in enumerate(cases)]  # together: each is mostly one core importing torch
    for (flags, flag), result in zip(cases, started):
        p = result()
        assert p.returncode == 2, flags
        assert flag in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def final_weights(d):
    return load_file(d / "final" / "model.safetensors")


def without_times(recs):
    return [{k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s", "memory"))} for r in recs]


@pytest.fixture(scope="module")
def seeded_pair(tmp_path_factory):
    """Two runs with the same seed and config, and one micro-batched (gates of B16). The tiny model without
    its warm start stops anywhere (unequal lengths) and never writes the count, so the reward is a length
    penalty, which a completion the cap cuts keeps: groups differ, and the updates move the weights."""
    reward = tmp_path_factory.mktemp("reward") / "shorter.py"
    reward.write_text("def shorter(completion, answer):\n    return -len(completion) / 8\n")
    base = ["--steps", "2", "--log.eval-every", "0", "--rl.batch-per-replica", "32", "--rl.group-size", "4",
            "--rollout.max-tokens", "8", "--model.tiny.warm-start-steps", "0", "--task.reward", f"{reward}:shorter"]
    dirs = {}
    for name, extra in [("a", []), ("b", []), ("micro", ["--rl.micro-batch-per-replica", "8"])]:
        d = tmp_path_factory.mktemp(name)
        assert run([sys.executable, "-m", "minirl.grpo", *base, *extra, "--log.run-dir", str(d)]).returncode == 0
        dirs[name] = d
    return dirs


def test_bit_identical_at_n1(seeded_pair):
    a, b = final_weights(seeded_pair["a"]), final_weights(seeded_pair["b"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert without_times(records(seeded_pair["a"])) == without_times(records(seeded_pair["b"]))


def test_chunked_equivalence_micro_batched_run_matches(seeded_pair):
    """micro = 0 vs micro = 8 rows (n_micro = 4) on batches of unequal completion lengths: the same
    samples, the same token-weighted loss, and final weights within 1e-5 after two AdamW steps
    (float32; Adam divides by sqrt(v), which amplifies last-bit gradient differences)."""
    ra, rm = records(seeded_pair["a"]), records(seeded_pair["micro"])
    for x, y in zip(ra, rm):
        assert x["reward_mean"] == y["reward_mean"] and x["grpo_denom"] == y["grpo_denom"]
        assert x["completion_len_max"] > x["completion_len_mean"]  # lengths really are unequal
        assert x["grad_norm"] > 0.1 and x["frac_reward_zero_std"] < 0.5  # a real update (all-zero rewards: none)
        assert abs(x["grpo_loss"] - y["grpo_loss"]) < 1e-6
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)  # before the clip: the same scale
    a, m = final_weights(seeded_pair["a"]), final_weights(seeded_pair["micro"])
    diff = max((a[k] - m[k]).abs().max().item() for k in a)
    print(f"chunked vs un-chunked final weights: max |diff| = {diff:.2e}")
    assert diff < 1e-5


def test_minibatches_step_several_times_but_sync_once_per_batch(tmp_path):
    """n_mini = 4 and two inner epochs (X2): eight optimizer steps per collected batch, one weight sync."""
    p = run([sys.executable, "-m", "minirl.grpo", "--steps", "2", "--log.eval-every", "0",
             "--rl.batch-per-replica", "16", "--rl.group-size", "4", "--rl.mini-batch-per-replica", "4",
             "--rl.mu-iterations", "2", "--log.run-dir", str(tmp_path)])
    assert p.returncode == 0
    recs = records(tmp_path)
    assert [r["optimizer_steps"] for r in recs] == [8, 16]
    assert [r["weight_syncs"] for r in recs] == [1, 1]


@pytest.mark.parametrize("family", ["gpt2_path", "neox_path", "gemma2_path"])
def test_another_family_trains_and_its_engine_stays_in_the_trainers_step(family, request, tmp_path):
    """Other families (tests/conftest.py) through two GRPO steps of two optimizer steps each: the engine's logprobs
    of each batch are the trainer's pi_old of it to float32 rounding, the second batch's after a weight sync of an
    update. GPT-2: the sync sent a tied head only under Llama's names, so vLLM kept its old head (0.19 nats off
    after one update). GPT-NeoX: vLLM's Transformers backend rewrote its base class as the engine was built, and
    the trainer's forward failed on an attribute only vLLM's instances have. Gemma 2: the sync sent a head its
    vLLM model does not have, and the first one failed."""
    model_path = request.getfixturevalue(family)
    reward = tmp_path / "distinct.py"
    reward.write_text("def distinct(completion, answer):\n    return len(set(completion)) / 8\n")  # differs by row
    p = run([sys.executable, "-m", "minirl.grpo", "--model.path", model_path, "--task.reward", f"{reward}:distinct",
             "--steps", "2", "--rl.batch-per-replica", "16", "--rl.group-size", "4", "--rl.mini-batch-per-replica",
             "8", "--rl.lr", "1e-2", "--log.eval-every", "0", "--log.run-dir", str(tmp_path / "run")])
    assert p.returncode == 0, p.stderr[-2000:]
    first, second = records(tmp_path / "run")
    assert first["grad_norm"] > 0 and first["optimizer_steps"] == 2
    assert first["logprob_gap"] < 1e-5 and second["logprob_gap"] < 1e-5, (first["logprob_gap"], second["logprob_gap"])
