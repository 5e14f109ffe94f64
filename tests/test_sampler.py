"""sampler.py: tail-aware selection (S2, S4, S16-S18, S21, S23) against the spec's examples and a
brute-force check of its rules."""

import math

import pytest

from minirl.sampler import Group, ReadyGroups, select_count


def test_spec_example_88_then_40_not_88_32_8():
    assert select_count(88, 128, 32) == 88
    assert select_count(32, 40, 32) == 0      # 88 + 32 would leave 8 < ceil(32/2)
    assert select_count(39, 40, 32) == 0
    assert select_count(40, 40, 32) == 40     # the final remainder flushes


def test_spec_example_112_runs_and_113_to_127_wait():
    assert select_count(112, 128, 32) == 112  # leaves exactly the floor (16): allowed
    for ready in range(113, 128):
        assert select_count(ready, 128, 32) == 0, ready
    assert select_count(128, 128, 32) == 128


@pytest.mark.parametrize("minimum", range(86, 128))
def test_minimums_86_to_127_always_give_one_chunk(minimum):
    for ready in range(0, 129):
        n = select_count(ready, 128, minimum)
        assert n in (0, 128), (minimum, ready, n)


def test_minimum_85_can_stream_in_two_chunks():
    assert select_count(85, 128, 85) == 85 and select_count(43, 43, 85) == 43


def test_minimum_is_a_floor_not_a_chunk_size():
    assert select_count(70, 128, 32) == 70  # takes every ready group it may


def test_rules_hold_for_every_state():
    """Brute force over small batches: never over the remainder, aligned, never below the minimum
    unless it is the final flush, never leaves a non-empty tail below the floor."""
    for remaining in range(1, 25):
        for minimum in range(1, 25):
            for align in (1, 2, 4):
                for ready in range(0, remaining + 9):  # more ready than the batch has left, too
                    n = select_count(ready, remaining, minimum, align)
                    if n == 0:
                        continue
                    final = remaining - remaining % align
                    assert n <= min(ready, remaining) and n % align == 0
                    assert n >= minimum or n == final
                    left = remaining - n
                    assert n == final or left >= math.ceil(minimum / 2)


def test_selection_is_capped_at_the_batch_remainder():
    """More groups ready than the step has left (a later step's groups, under ready_first): the
    selection is the remainder, never more."""
    assert select_count(50, 40, 32) == 40
    assert select_count(50, 40, 32, align=8) == 40
    assert select_count(50, 45, 32, align=8) == 40  # capped, then aligned down: the final flush
    assert select_count(200, 128, 32) == 128


def test_largest_selection_is_deferred_not_trimmed():
    # 120 ready of 128 with minimum 32 would leave 8: wait, rather than take 112
    assert select_count(120, 128, 32) == 0


def fill(rg, indices, version=0, step=0):
    for i in indices:
        rg.add(Group(i, version), step)


def test_in_order_takes_contiguous_ready_groups_from_the_oldest():
    rg = ReadyGroups(num_prompts=8, min_groups=2, name="in_order")
    fill(rg, [1, 2, 3])           # group 0 not ready: nothing in order yet
    assert rg.take() == []
    fill(rg, [0])
    assert [g.index for g in rg.take()] == [0, 1, 2, 3]
    fill(rg, [5, 6, 7])
    assert rg.take() == []        # 4 is missing
    fill(rg, [4])
    assert [g.index for g in rg.take()] == [4, 5, 6, 7]


def test_ready_first_takes_any_ready_group_and_deferred_groups_stay_ready():
    rg = ReadyGroups(num_prompts=8, min_groups=4, name="ready_first")
    fill(rg, [6, 1, 3])
    assert rg.take() == []                      # below the minimum: deferred, still ready
    assert sorted(rg.ready) == [1, 3, 6]
    fill(rg, [0, 7])
    chunk = rg.take()
    assert [g.index for g in chunk] == [0, 1, 3, 6, 7]
    fill(rg, [2, 4, 5])
    assert [g.index for g in rg.take()] == [2, 4, 5]  # final flush
    assert rg.remaining == 0 and len(rg.claimed) == 8  # nothing dropped, nothing twice
    rg.release()
    assert rg.released == 8 and not rg.claimed


def test_full_batch_waits_for_every_group():
    rg = ReadyGroups(num_prompts=4, min_groups=4)
    fill(rg, [0, 1, 2])
    assert rg.take() == []
    fill(rg, [3])
    assert len(rg.take()) == 4


def test_stale_groups_are_not_consumed():
    rg = ReadyGroups(num_prompts=4, min_groups=1, max_lookahead_versions=1)
    assert rg.add(Group(0, version=3), step=4)
    assert not rg.add(Group(1, version=2), step=4)
    assert list(rg.ready) == [0]  # the stale one is not kept


def test_duplicate_group_is_refused():
    rg = ReadyGroups(num_prompts=4, min_groups=1)
    rg.add(Group(0, 0), 0)
    with pytest.raises(ValueError, match="duplicate group 0: it is already ready"):
        rg.add(Group(0, 0), 0)
    rg.take()
    with pytest.raises(ValueError, match="already claimed"):  # a raise, not an assert: `python -O` keeps it
        rg.add(Group(0, 0), 0)


def test_unknown_sampler_is_rejected():
    with pytest.raises(ValueError, match="in_order or ready_first"):
        ReadyGroups(num_prompts=4, min_groups=1, name="random")


def test_a_released_batch_has_nothing_remaining():
    """After both updates the step's groups are released: none remain to take, none is claimed."""
    rg = ReadyGroups(num_prompts=4, min_groups=2)
    for i in range(4):
        rg.add(Group(i, version=0), step=0)
    assert len(rg.take()) == 4 and rg.remaining == 0
    rg.release()
    assert rg.remaining == 0 and not rg.claimed and rg.released == 4 and rg.take() == []
