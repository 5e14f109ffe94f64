"""batch.py: the rank-local store and the (mini, micro) dispatch (B3)."""

import torch

from minirl.batch import chunk, pack
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
    c = chunk(b, 2, 2)
    assert c["input_ids"].shape == (2, 3)  # trimmed to the chunk's own longest row
    assert c["advantages"].tolist() == [2.0, 3.0]
    assert torch.equal(c["mask"], b["mask"][2:4, :3])
    # every (mini, micro) index covers each row exactly once
    seen = torch.cat([chunk(b, s, 1)["advantages"] for s in range(4)])
    assert seen.tolist() == [0.0, 1.0, 2.0, 3.0]
