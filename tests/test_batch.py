"""batch.py: the rank-local store, the (mini, micro) plan and dispatch (B3, X1)."""

import random

import torch

import pytest

from minirl.batch import RolloutStore, pack, plan_chunks
from minirl.rollout import Samples


def samples():
    return Samples(prompt_ids=[0, 0, 1, 1], prompt_tokens=[[5, 6], [5, 6], [7], [7]],
                   completion_tokens=[[1], [2, 3, 4], [8, 9], [3]],
                   logprobs=[[-0.1], [-0.2, -0.3, -0.4], [-0.5, -0.6], [-0.7]], finish_reasons=["stop"] * 4)


def test_pack_masks_completions_only_and_keeps_rollout_logprobs():
    b = pack(samples(), torch.tensor([1.0, -1.0, 0.5, -0.5]), pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 1, 0, 0], [5, 6, 2, 3, 4], [7, 8, 9, 0, 0], [7, 3, 0, 0, 0]]
    assert b["mask"].tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert torch.allclose(b["rollout_logp"][1], torch.tensor([0, 0, -0.2, -0.3, -0.4]))
    assert b["lengths"].tolist() == [3, 5, 3, 2]


def test_chunk_is_rows_of_this_ranks_share_trimmed():
    b = pack(samples(), torch.arange(4.0), pad_id=0)
    plan = plan_chunks(b["lengths"].tolist(), n_mini=2, micro_rows=1)
    assert plan == [[[0], [1]], [[2], [3]]]
    store = RolloutStore(b, plan_chunks(b["lengths"].tolist(), 1, 2), reads_per_chunk=1)
    c = store.chunk(0, 1)
    assert c["input_ids"].shape == (2, 3)  # trimmed to the chunk's own longest row
    assert c["advantages"].tolist() == [2.0, 3.0]
    assert torch.equal(c["mask"], b["mask"][2:4, :3])
    # every (mini, micro) index covers each row exactly once
    store = RolloutStore(b, plan, reads_per_chunk=1)
    seen = torch.cat([store.chunk(m, u)["advantages"] for m in range(2) for u in range(2)])
    assert seen.tolist() == [0.0, 1.0, 2.0, 3.0]
    store.close()


def test_store_releases_after_last_reader_and_refuses_more():
    b = pack(samples(), torch.arange(4.0), pad_id=0)
    store = RolloutStore(b, [[[0, 1, 2, 3]]], reads_per_chunk=2)
    store.chunk(0, 0)
    store.chunk(0, 0)
    assert "input_ids" not in store.batch  # the bulk is released
    with pytest.raises(KeyError):
        store.chunk(0, 0)


def test_token_budget_plan_fits_and_agrees(world):
    lengths = [30, 5, 5, 5, 28, 6, 7, 2]
    plan = plan_chunks(lengths, n_mini=2, micro_rows=0, max_tokens=40)
    for mini, bins in enumerate(plan):
        assert sorted(r for b in bins for r in b) == list(range(4 * mini, 4 * mini + 4))
        assert all(len(b) * max(lengths[r] for r in b) <= 40 or len(b) == 1 for b in bins)
    assert plan[0] == [[0], [1, 2, 3]]
    assert plan_chunks([50, 3], 1, 0, max_tokens=10) == [[[0], [1]]]  # over-budget row alone


def test_a_token_budget_takes_the_fewest_padded_micro_batches_that_fit(world):
    """X1: under a budget of rows x longest row, as few micro-batches as the best of every split of the rows
    into ones that fit (up to 7 rows, each split tried), and a budget met exactly is met."""
    def splits(rows: list[int]):
        if not rows:
            yield []
            return
        for rest in splits(rows[1:]):
            for i in range(len(rest)):
                yield rest[:i] + [[rows[0]] + rest[i]] + rest[i + 1:]
            yield [[rows[0]]] + rest

    def fits(b: list[int]) -> bool:
        return len(b) * max(lengths[r] for r in b) <= budget or len(b) == 1

    rng = random.Random(0)
    for _ in range(300):
        lengths, budget = [rng.randint(1, 10) for _ in range(rng.randint(2, 7))], rng.randint(5, 40)
        plan = plan_chunks(lengths, n_mini=1, micro_rows=0, max_tokens=budget)[0]
        fewest = min(len(s) for s in splits(list(range(len(lengths)))) if all(map(fits, s)))
        assert len(plan) == fewest and all(map(fits, plan)), (lengths, budget, plan)
        assert sorted(r for b in plan for r in b) == list(range(len(lengths)))
    assert plan_chunks([4, 4, 2], 1, 0, max_tokens=8) == [[[0, 1], [2]]]


def test_a_group_travels_padded_and_comes_back_as_rows_with_the_reward_on_the_last_token():
    """PPO's unit of work: `as_group` pads a prompt's completions to the longest (with 0, logprobs 0.0)
    and keeps their lengths; `group_rows` turns groups back into right-padded rows whose sequence reward
    sits on each row's last completion token, with the engine's logprobs under the mask."""
    from minirl.batch import as_group, group_rows
    s = samples()
    first = as_group(s, slice(0, 2), [1.0, 0.0], [[1.0, 0.0]], version=3)
    second = as_group(s, slice(2, 4), [0.5, 2.0], [[0.5, 2.0]], version=4)
    assert first["completions"].tolist() == [[1, 0, 0], [2, 3, 4]] and first["lengths"].tolist() == [1, 3]
    torch.testing.assert_close(first["logprobs"], torch.tensor([[-0.1, 0.0, 0.0], [-0.2, -0.3, -0.4]]))
    assert first["prompt"].tolist() == [5, 6] and first["version"].item() == 3
    rows = group_rows([first, second], pad_id=0)
    assert rows["input_ids"].tolist() == [[5, 6, 1, 0, 0], [5, 6, 2, 3, 4], [7, 8, 9, 0, 0], [7, 3, 0, 0, 0]]
    assert rows["mask"].tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    ends = {(b, t): v for b, row in enumerate(rows["rewards"].tolist()) for t, v in enumerate(row) if v}
    assert ends == {(0, 2): 1.0, (2, 2): 0.5, (3, 1): 2.0}  # row 1's reward is 0
    assert rows["rollout_logp"][1, 2:].tolist() == pytest.approx([-0.2, -0.3, -0.4])
