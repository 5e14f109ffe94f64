"""batch.py's packing: padding-free micro-batches give the padded path's logprobs, entropies, values and
gradients (to 1e-6, on skewed rows of the real tiny model, FSDP2 world of one), only models that keep
packed rows apart are packed, and a packed token budget counts the tokens the forward computes."""

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import grads
from minirl import batch, dist, models
from minirl.batch import Layout, plan_chunks

LENGTHS = [3, 41, 7, 2, 26, 13, 40, 5]  # skewed: 137 real tokens; padded 8 x 41 = 328


def skewed_batch(vocab_hi=40, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab_hi, (n,), generator=g)
        mask[i, 1:n] = 1.0  # every token that has a context
    return ids, mask, torch.tensor(lengths)


def close(a: list[torch.Tensor], b: list[torch.Tensor], tol=1e-6) -> float:
    """Largest difference relative to the largest magnitude; asserts it is within tol."""
    scale = max(x.abs().max().item() for x in a)
    diff = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert len(a) == len(b) and diff <= tol * max(scale, 1.0), (diff, scale)
    return diff


def test_layout_packs_rows_end_to_end_with_restarting_positions():
    lay = Layout.of(LENGTHS, 41)
    assert lay.capacity == 41 and lay.lanes == 4 and lay.lanes * lay.capacity == 164  # vs 328 padded
    assert sorted(len(r) for r in batch.lanes_of(LENGTHS, 41)) == [1, 1, 3, 3]
    ids, mask, _ = skewed_batch()
    packed = lay.pack(ids)
    assert packed.shape == (4, 41) and int((packed != 0).sum()) == int((ids != 0).sum())
    row1 = (lay.padded >= 1 * 41) & (lay.padded < 2 * 41)                        # the 41-token row
    assert lay.positions.view(-1)[lay.packed[row1]].tolist() == list(range(41))
    # unpack reads each token's output off the position before it: a row's first column is 0
    back = lay.unpack(torch.nn.functional.pad(packed[:, :-1], (1, 0)).float())
    shifted = torch.nn.functional.pad(ids[:, :-1], (1, 0)).float() * (mask > 0)
    assert torch.equal(back, shifted)
    one = Layout.of(LENGTHS, 41, one_lane=True)
    assert (one.lanes, one.capacity) == (1, 137)


@pytest.mark.parametrize("fsdp", [False, True])
def test_packed_logprobs_and_gradients_equal_the_padded_path(tiny_path, world, fsdp):
    padded, packed = models.load_policy(tiny_path), models.load_policy(tiny_path)
    packed.pack_rows = True
    if fsdp:
        padded, packed = dist.shard(padded, world, torch.float32), dist.shard(packed, world, torch.float32)
    ids, mask, lengths = skewed_batch()
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) * mask
    a, ent_a = models.token_logprobs(padded, ids, entropy=True)
    b, ent_b = models.token_logprobs(packed, ids, entropy=True, lengths=lengths)
    lay = models.layout(packed, ids, lengths)
    assert lay.lanes * lay.capacity == 164  # it did pack
    close([a * mask, ent_a * mask], [b * mask, ent_b * mask])
    assert b[mask == 0].abs().max() == 0 and b.shape == a.shape
    (a * w).sum().backward()
    (b * w).sum().backward()
    close(grads(padded), grads(packed))


def test_packed_plain_logprobs_equal_the_padded_path(tiny_path):
    model = models.load_policy(tiny_path)
    ids, mask, lengths = skewed_batch()
    a, ent_a = models.plain_token_logprobs(model, ids, entropy=True)
    model.pack_rows = True
    b, ent_b = models.plain_token_logprobs(model, ids, entropy=True, lengths=lengths)
    close([a * mask, ent_a * mask], [b * mask, ent_b * mask])


def test_packed_values_and_gradients_equal_the_padded_path(tiny_path, world):
    base = models.load_value(tiny_path)
    with torch.no_grad():  # a head that reads the hidden state (it starts at zero)
        base.score.weight.copy_(torch.randn(base.score.weight.shape, generator=torch.Generator().manual_seed(2)))
    padded, packed = copy.deepcopy(base), copy.deepcopy(base)
    packed.pack_rows = True
    padded, packed = dist.shard(padded, world, torch.float32), dist.shard(packed, world, torch.float32)
    ids, mask, lengths = skewed_batch()
    a, b = padded(ids), packed(ids, lengths)
    assert b[mask == 0].abs().max() == 0 and a.abs().max() > 0.1
    close([a * mask], [b * mask])
    (a * mask).square().sum().backward()
    (b * mask).square().sum().backward()
    close(grads(padded), grads(packed))


def test_only_models_that_keep_packed_rows_apart_are_packed(tiny_path, world, monkeypatch):
    model = models.load_policy(tiny_path)
    assert models.packing_error(model) is None
    assert models.sharded(tiny_path, "policy", world, "float32", pack=True).pack_rows
    assert not models.sharded(tiny_path, "policy", world, "float32", pack=False).pack_rows
    assert not models.sharded(tiny_path, "policy", world, "float32").pack_rows  # packing is asked for, never assumed
    forward = type(model).forward

    def ignores_positions(self, *a, position_ids=None, **k):  # an attention that never sees the restarts
        return forward(self, *a, **k)

    monkeypatch.setattr(type(model), "forward", ignores_positions)
    assert models.packing_error(model) > 1e-3
    assert not models.sharded(tiny_path, "policy", world, "float32", pack=True).pack_rows
    assert "off: this model mixes rows" in models.load_report(True, SimpleNamespace(pack_rows=False))
    off = models.load_report(False, SimpleNamespace(pack_rows=False))
    assert off == "padding-free training: off (--model.no-packing)"


def test_the_critic_packs_in_one_lane_where_its_backbone_runs_flash_attention(tiny_path):
    """transformers keeps packed rows apart under flash attention at batch size 1 only: where the backbone
    runs it, the critic's rows go into one lane as the policy's do (the check at load assumes so), and a token
    budget counts that lane's tokens."""
    policy, value = models.load_policy(tiny_path), models.load_value(tiny_path)
    ids, lengths = torch.zeros(4, 10, dtype=torch.long), [10, 3, 4, 5]
    policy.pack_rows = value.pack_rows = True
    assert models.layout(value, ids, lengths).lanes == 3  # sdpa: lanes as long as the longest row
    for backbone in (policy, value.model):
        backbone.config._attn_implementation = "flash_attention_2"  # the setting only: no kernel runs here
    for model in (policy, value):
        lay = models.layout(model, ids, lengths)
        assert (lay.lanes, lay.capacity) == (1, 22) and models.computed_tokens(model, lengths) == 22
        # a token budget counts that lane's tokens: 22 fit in one micro-batch (3 lanes x 10 would not)
        assert plan_chunks(lengths, 1, 0, max_tokens=22, cost=lambda rows: models.computed_tokens(model, rows)) == [
            [[0, 1, 2, 3]]]
    assert models.packing_error(value) is None  # packed, on the promise of one lane


def test_equal_lengths_run_padded(tiny_path):
    model = models.load_policy(tiny_path)
    ids = torch.randint(3, 40, (4, 9))
    assert models.layout(model, ids, torch.tensor([9, 2, 2, 9])) is None  # a model never checked for packing pads
    model.pack_rows = True
    assert models.layout(model, ids, torch.tensor([9, 9, 9, 9])) is None  # nothing to save
    lay = models.layout(model, ids, torch.tensor([9, 2, 2, 9]))
    assert lay.lanes * lay.capacity == 27


def test_packed_token_budget_counts_computed_tokens():
    """X1 under packing: a micro-batch's cost is its packed lanes' tokens, so the same budget takes
    fewer micro-batches, and every micro-batch fits it."""
    lengths = [40, 3, 5, 2, 38, 4, 6, 3] * 4
    padded = plan_chunks(lengths, 1, 0, max_tokens=96)
    packed = plan_chunks(lengths, 1, 0, max_tokens=96, cost=batch.computed_tokens)
    assert len(packed[0]) < len(padded[0])
    for micro in packed[0]:
        assert batch.computed_tokens([lengths[r] for r in micro]) <= 96 or len(micro) == 1
    assert sorted(r for m in packed[0] for r in m) == list(range(len(lengths)))


def test_packed_grpo_step_equals_the_padded_step(tiny_path, world):
    """A whole GRPO update (ahead pass, 2 mini-batches of 2 micro-batches) packed and padded."""
    from test_grpo_update import grpo_args, train
    args = grpo_args(mini_batch_per_replica=8, micro_batch_per_replica=4)
    padded = dist.shard(models.load_policy(tiny_path), world, torch.float32)
    packed = dist.shard(models.load_policy(tiny_path), world, torch.float32)
    packed.pack_rows = True
    *_, calls_a, _, _ = train(tiny_path, args, model=padded, lr=0.5)
    *_, calls_b, _, _ = train(tiny_path, args, model=packed, lr=0.5)
    assert max(c["grpo_clipfrac"] for c in calls_a) > 0  # the second mini-batch moved: not a trivial step
    close([p.full_tensor() for p in padded.parameters()], [p.full_tensor() for p in packed.parameters()])


def test_packed_ppo_step_equals_the_padded_step(tiny_path, world):
    """The streamed PPO pump: frozen old values, policy chunks and critic epochs, packed and padded, in
    float64. Packed and padded attention sum over different shapes; in float32 the gradients' sums of
    up to n ~ 10^4 terms may part by gamma_n = n 2^-24 of their size (a 1e-6 tolerance failed on other
    machines at 2e-6). In float64 that bound is ~1e-12, so the step must agree to 1e-9 everywhere."""
    from minirl.accumulator import Accumulator
    from minirl.stream import PumpConfig, TrainPump

    def chunk(seed, lengths):
        ids, mask, n = skewed_batch(lengths=lengths, seed=seed)
        mask = mask.double()
        rewards = torch.zeros_like(mask)
        rewards[torch.arange(len(lengths)), n - 1] = torch.tensor([1.0, 0.0] * (len(lengths) // 2), dtype=torch.float64)
        mask[:, :3] = 0  # three prompt tokens
        return {"input_ids": ids, "mask": mask, "rewards": rewards, "lengths": n, "groups": len(lengths) // 2}

    value = models.load_value(tiny_path).double()
    with torch.no_grad():
        value.score.weight.copy_(0.1 * torch.randn(value.score.weight.shape, generator=torch.Generator().manual_seed(0)))
    policy = models.load_policy(tiny_path).double()
    out = []
    for pack in (False, True):
        p, v = copy.deepcopy(policy), copy.deepcopy(value)
        p.pack_rows = v.pack_rows = pack
        acc = Accumulator(p, torch.optim.SGD(p.parameters(), lr=0.5), n_micro=None)
        pump = TrainPump(p, v, acc, torch.optim.SGD(v.parameters(), lr=0.5),
                         PumpConfig(critic_ppo_epochs=2, policy_micro_rows=3, critic_micro_rows=5, offload=False), step=0)
        for seed, lengths in ((1, [4, 30, 6, 12]), (2, [20, 5, 9, 4, 33, 7])):
            pump.chunk(chunk(seed, lengths))
        pump.close()
        out.append([*p.parameters(), *v.parameters()])
    start = [*policy.parameters(), *value.parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(out[0], start)) > 1e-3  # both models moved
    assert all(a.dtype == torch.float64 for a in out[1])
    close(*out, tol=1e-9)


def test_the_packed_value_model_under_fsdp2_returns_no_view(tiny_path, world):
    """FSDP2 hooks a module's outputs for backward and warns when one is a view (an in-place op on it would
    drop the hook): the packed critic's values come back as a fresh tensor, and its gradients flow."""
    import warnings
    from minirl import models
    value = models.sharded(tiny_path, "value", world, "float32", True)
    ids = torch.randint(3, 40, (3, 9), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        v = value(ids, [9, 4, 3])
    assert v._base is None and not [w for w in seen if "returned a view tensor" in str(w.message)]
    v.sum().backward()
    assert value.score.weight.grad is not None
