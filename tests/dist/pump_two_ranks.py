"""Two train ranks (FSDP2 over gloo) and the PPO train pump. (1) Whitening takes its moments over
both ranks' rows, not one rank's shard (S19). (2) A step whose rank-1 share is entirely masked trains
on both ranks; a step masked on every rank fails on every rank before either update (S15), instead
of one rank raising while the other waits in a collective. Run by tests/test_stream.py."""

import sys

import torch

from minirl import dist, launch
from minirl.accumulator import Accumulator
from minirl.gae import masked_whiten
from minirl.models import load_policy, load_value
from minirl.offload import TrainerOffload
from minirl.stream import PumpConfig, TrainPump

world = dist.init()
r = world.rank

# ---- (1) whitening over both shards, of very different scale ----
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 6, 9, generator=g, dtype=torch.float64) * torch.tensor([1.0, 25.0], dtype=torch.float64)[:, None, None]
x[1] += 7.0
m = (torch.rand(2, 6, 9, generator=g) > 0.3).double()
vals = x[m.bool()]
expected = (x - vals.mean()) / (vals.std(unbiased=False) + 1e-8)
mine = masked_whiten(x[r], m[r])
assert torch.allclose(mine[m[r].bool()], expected[r][m[r].bool()], atol=1e-10), "whitening is not over both shards"
print(f"rank {r}: whitening over both shards OK")

# ---- (2) a masked share ----
path = sys.argv[1]
policy, value = dist.shard(load_policy(path), world, torch.float32), dist.shard(load_value(path), world, torch.float32)
popt, vopt = torch.optim.SGD(policy.parameters(), lr=0.1), torch.optim.SGD(value.parameters(), lr=0.1)
offload = TrainerOffload(policy, popt, keep_grads=True), TrainerOffload(value, vopt)  # one pair per run, as ppo.train


def chunk(masked: bool) -> dict:
    ids = torch.randint(3, 40, (4, 10), generator=torch.Generator().manual_seed(r))
    mask = torch.zeros(4, 10)
    if not masked:
        mask[:, 3:8] = 1.0
    rewards = torch.zeros(4, 10)
    rewards[:, 7] = 1.0
    return {"input_ids": ids, "mask": mask, "rewards": rewards, "groups": 2}


def step(k: int, rank1_masked: bool, rank0_masked: bool) -> TrainPump:
    p = TrainPump(policy, value, Accumulator(policy, popt, n_micro=None), vopt, PumpConfig(), step=k,
                  log=lambda _: None, policy_off=offload[0], value_off=offload[1])
    p.chunk(chunk(masked=rank1_masked if r == 1 else rank0_masked))
    return p


p = step(0, rank1_masked=True, rank0_masked=False)
out = p.close()  # before the fix: rank 1 raised here and rank 0 waited in the critic's collectives
assert p.policy_acc.steps == 1 and out["value_epoch_n"] == 4, out
p = step(1, rank1_masked=True, rank0_masked=True)
try:
    p.close()
    raise AssertionError("an entirely masked step trained")
except RuntimeError as e:
    assert "masked" in str(e), e
assert p.policy_acc.steps == 0
print(f"rank {r}: masked shares OK")
dist.shutdown()
launch.leave(0)  # no interpreter teardown: see launch.leave
