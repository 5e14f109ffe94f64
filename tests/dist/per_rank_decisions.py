"""Two ranks over gloo, each with data chosen so that what it would decide alone differs from what the
mesh must decide together. (1) X1: the token-budget micro-batch count is the mesh's largest, so every
rank runs the same number of forward/backward calls. (2) B19: the determinism probe's verdict is the
mesh-wide fraction of moved tokens, the same on every rank (one rank raising alone would leave the
other waiting in the next collective). Run by tests/test_dist.py."""

from types import SimpleNamespace

import torch

from minirl import dist, grpo
from minirl.batch import plan_chunks

world = dist.init()
r = world.rank

# ---- (1) X1: rank 0's rows need 3 micro-batches of a 40-token budget, rank 1's fit in one ----
lengths = [20, 20, 20, 20, 20, 20] if r == 0 else [2, 2, 2, 2, 2, 2]  # padded cost: rows x longest
plan = plan_chunks(lengths, n_mini=1, micro_rows=0, max_tokens=40)
alone = 3 if r == 0 else 1
assert len(plan[0]) == 3, f"rank {r}: {len(plan[0])} micro-batches; alone it needs {alone}, the mesh 3"
assert sorted(i for b in plan[0] for i in b) == list(range(6)) and all(b for b in plan[0])
print(f"rank {r}: X1 micro-batches {len(plan[0])} (alone {alone})", flush=True)


# ---- (2) B19: a probe whose train() forward moves `moved` of this rank's 10 completion tokens ----
class Policy:
    config = SimpleNamespace(minirl_forward_noise={"nats": 0.05, "tolerance": 0.3})
    training = False

    def train(self):
        self.training = True

    def eval(self):
        self.training = False


def verdict(moved: int) -> tuple[bool, float]:
    base = torch.zeros(1, 10)
    grpo.score = lambda policy, ids, lengths=None: base + torch.tensor(  # noqa: E731
        [[1.0] * moved + [0.0] * (10 - moved)]) * float(policy.training)
    probe = grpo.Probe(Policy())
    try:
        probe({"mask": torch.ones(1, 10), "input_ids": torch.zeros(1, 10, dtype=torch.long), "lengths": None}, base)
        return False, probe.fraction
    except RuntimeError:
        return True, probe.fraction


raised, fraction = verdict(4 if r == 0 else 0)  # rank 0 alone: 40% > 30%; the mesh: 20%
assert not raised and abs(fraction - 0.2) < 1e-12, (r, raised, fraction)
raised, fraction = verdict(10 if r == 0 else 0)  # rank 1 alone: 0%; the mesh: 50% > 30%
assert raised and abs(fraction - 0.5) < 1e-12, (r, raised, fraction)
print(f"rank {r}: B19 mesh-wide verdicts OK", flush=True)
dist.shutdown()
