"""End to end: `torchrun --nproc-per-node 2 -m minirl.ppo`: one rollout rank with the real vLLM engine,
one train rank streaming chunks through the train pump (S1, S3, S20, S22)."""

import json
import sys

import pytest

from conftest import run
from minirl.config import ConfigError, PPOArgs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_streamed_run_trains_on_several_chunks_per_step(tmp_path):
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "minirl.ppo",
             "--steps", "3", "--ppo.num-prompts-per-step", "8", "--ppo.num-generations-per-prompt", "4",
             "--async-rl.min-groups-for-streaming-train", "2", "--async-rl.rollout-groups-per-call", "2",
             "--async-rl.sampler.max-lookahead-versions", "0", "--ppo.critic-ppo-epochs", "2",
             "--log.eval-every", "2", "--log.run-dir", str(tmp_path)])
    assert p.returncode == 0
    chunk_lines = [line for line in p.stderr.splitlines() if line.startswith("train_pump: step 0 chunk")]
    assert len(chunk_lines) > 1  # lookahead 0: step 0's groups arrive in waves, and training starts on the first
    assert "train_pump: step 0 closing on" in p.stderr
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in recs if "reward_mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["value_epoch_n"] == 8 * 4  # the critic sees every sample once per epoch (S3)
        assert r["ppo_chunks"] >= 1 and "ppo_loss" in r and "value_loss" in r
    assert any("eval_accuracy" in r for r in recs)
    assert (tmp_path / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("change, flag", [
    (lambda a: setattr(a.ppo, "ppo_epochs", 2), "--ppo.ppo-epochs"),
    (lambda a: setattr(a.async_rl.sampler, "name", "random"), "--async-rl.sampler.name"),
    (lambda a: setattr(a.grid, "rollout_ranks", 0), "separate generation ranks"),
    (lambda a: setattr(a.async_rl, "min_groups_for_streaming_train", 0), "--async-rl.min-groups-for-streaming-train"),
])
def test_support_limits_are_rejected_at_setup(change, flag):
    a = PPOArgs()
    change(a)
    with pytest.raises(ConfigError, match=flag.replace(".", r"\.")):
        a.validate(2)


def test_one_process_is_refused_naming_the_launch(tmp_path):
    p = run([sys.executable, "-m", "minirl.ppo", "--log.run-dir", str(tmp_path)], timeout=120)
    assert p.returncode == 2 and "--nproc-per-node" in p.stderr
