"""Two processes over gloo (torchrun --standalone): FSDP2, the DP partition, divisor all-reduce, export."""

import pytest

from conftest import torchrun

pytestmark = pytest.mark.dist


def test_two_rank_chunked_deferred_step_equals_single_process_whole_batch(tiny_path):
    """Also: dist.full_parameters (what the engine is sent) equals the trainer's parameters."""
    p = torchrun("tests/dist/fsdp_chunked_step.py", tiny_path)
    assert p.returncode == 0
    assert "OK grad_diff=" in p.stdout


def test_disaggregated_rollout_rank_and_train_group_meet_through_the_store(tiny_path):
    p = torchrun("tests/dist/disaggregated_groups.py", tiny_path, nproc=3)
    assert p.returncode == 0
    assert "ROLLOUT OK" in p.stdout and p.stdout.count("TRAIN rank") == 2
