"""Two ranks over gloo, each with data chosen so that what it would decide alone differs from what the
mesh must decide together. (1) X1: the token-budget micro-batch count is the mesh's largest, so every
rank runs the same number of forward/backward calls. (2) B19: the determinism probe's verdict is the
mesh-wide fraction of moved tokens, the same on every rank (one rank raising alone would leave the
other waiting in the next collective). (3) B12: a window poisoned on one rank is skipped on both.
(4) A SIGTERM that reached one rank stops both at the step boundary. Run by tests/test_dist.py."""

import os
import signal
from types import SimpleNamespace

import torch

from minirl import dist, grpo
from minirl.accumulator import Accumulator
from minirl.batch import plan_chunks

world = dist.init()
r = world.rank

# ---- (1) X1: rank 0's rows need 3 micro-batches of a 40-token budget, rank 1's fit in one ----
lengths = [20, 20, 20, 20, 20, 20] if r == 0 else [2, 3, 2, 1, 3, 2]  # padded cost: rows x longest
plan = plan_chunks(lengths, n_mini=1, micro_rows=0, max_tokens=40)
alone = 3 if r == 0 else 1
assert len(plan[0]) == 3, f"rank {r}: {len(plan[0])} micro-batches; alone it needs {alone}, the mesh 3"
assert sorted(i for b in plan[0] for i in b) == list(range(6)) and all(b for b in plan[0])
if r == 1:  # its one micro-batch halved, longer rows apart from shorter ([1, 4, 0] | [2, 5, 3]), then the costlier
    assert plan[0] == [[0, 4], [1], [2, 3, 5]], plan[0]
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

# ---- (3) B12: a window poisoned on rank 0 only is dropped on both ranks (no rank steps alone) ----
model = torch.nn.Linear(3, 1)
acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), n_micro=1)
loss = model(torch.ones(1, 3)).sum() * (float("nan") if r == 0 else 1.0)
out = acc.backward(loss, torch.tensor(1.0))
assert acc.steps == 0 and acc.skipped == 1 and out == {"skipped_nonfinite": 1.0}, (r, out)
print(f"rank {r}: B12 poisoned on one rank, skipped on both", flush=True)

# ---- (4) a SIGTERM that reached rank 1 only: both ranks save and stop at the step boundary ----
stop = dist.sigterm_flag()
stop.armed = True  # the steps have begun (run.Run.steps)
if r == 1:
    os.kill(os.getpid(), signal.SIGTERM)
assert stop() and stop.name == "SIGTERM", r
print(f"rank {r}: SIGTERM on one rank, both stop", flush=True)
dist.shutdown()
