"""Two ranks, FSDP2 over gloo: one optimizer step whose mini-batch is split over 2 ranks x 2 micro-batches
of unequal lengths equals the single-process step on the whole batch; the logged loss and counts,
rolled up per rank and then across ranks (B13), equal the whole batch's token mean, totals and per-token
rates though the ranks hold unequal token counts, and a skip count every rank shares is not summed over them; the
full parameters gathered for the engine equal the trainer's; in bf16 compute the gradients are reduced
in float32 (the float32 mean of the ranks' bf16 gradients). Run by tests/test_dist.py under torchrun --standalone."""

import sys

import torch

from minirl import dist, launch
from minirl.accumulator import Accumulator, across_ranks, roll_up
from minirl.models import load_policy, token_logprobs
from minirl.objective import policy_loss
from minirl.tasks import dp_partition

world = dist.init()
path = sys.argv[1]
g = torch.Generator().manual_seed(0)
B, T, V = 8, 12, 40
ids = torch.randint(3, V, (B, T), generator=g)
mask = torch.zeros(B, T)
for b, n in enumerate([1, 9, 2, 6, 10, 3, 4, 8]):
    mask[b, 2:2 + n] = 1.0
adv = torch.randn(B, generator=g)

# ---- the reference: one process, the whole batch, plain token mean ----
ref = load_policy(path)
opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
logp = token_logprobs(ref, ids)
ratio = torch.exp(logp - logp.detach())
per_tok = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
ref_loss = (per_tok * mask).sum() / mask.sum()
ref_loss.backward()
ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
opt_ref.step()

# ---- FSDP2: this rank's share, two micro-batches, deferred normalization ----
policy = dist.shard(load_policy(path), world, torch.float32)
opt = torch.optim.SGD(policy.parameters(), lr=0.5)
seen = {}
orig_step = opt.step


def recording_step(*a, **k):
    for n, p in policy.named_parameters():
        seen[n] = p.grad.full_tensor().clone()
    return orig_step(*a, **k)


opt.step = recording_step
acc = Accumulator(policy, opt, n_micro=2)
rows = dp_partition([(i // 2, i % 2) for i in range(B)], world.rank, world.world_size)  # whole groups of 2
calls = []
for micro in range(2):
    r = rows[micro * 2:(micro + 1) * 2]
    logp = token_logprobs(policy, ids[r])
    loss, div, m = policy_loss(logp, logp.detach(), adv[r], mask[r], clip_eps=0.2)
    calls.append(m)
    acc.backward(loss, div)
assert acc.steps == 1
local_tokens = mask[rows].sum().item()
others = dist.all_reduce(torch.tensor([local_tokens]))
assert others.item() - local_tokens != local_tokens, "the two ranks should hold unequal token counts"
logged = across_ranks(roll_up(calls))
assert abs(logged["grpo_loss"] - ref_loss.item()) < 1e-6, (logged["grpo_loss"], ref_loss.item())
assert logged["grpo_tokens"] == mask.sum().item() and logged["grpo_n"] == B
assert abs(logged["grpo_denom"] * world.world_size - mask.sum().item()) < 1e-6  # the DP mean of the count

# counts every rank holds alike (a skip is decided by an all-reduce) are not multiplied by the world
shared = across_ranks({"skipped_nonfinite": 1.0, "value_skipped_nonfinite": 2.0, "grpo_n": 3.0})
assert shared == {"skipped_nonfinite": 1.0, "value_skipped_nonfinite": 2.0, "grpo_n": 6.0}, shared

# a per-token rate is the whole batch's, weighted by each rank's tokens (1 clipped token of 2 here, none of 6
# there: 1 of 8, not the mean of the ranks' halves); a loss (normalized by the shared divisor) is the mean
mine = {"ppo_clipfrac": 0.5, "ppo_tokens": 2.0, "ppo_loss": 0.25, "grad_norm": 3.0} if world.rank == 0 else \
    {"ppo_clipfrac": 0.0, "ppo_tokens": 6.0, "ppo_loss": 0.75, "grad_norm": 3.0}
assert across_ranks(mine) == {"ppo_clipfrac": 0.125, "ppo_tokens": 8.0, "ppo_loss": 0.5, "grad_norm": 3.0}

# one token in the whole batch: the rate is that token's rank's; a family with no token on any rank (an all-masked
# batch) is the ranks' mean, never 0 / 0
edge = {"grpo_entropy": 2.0, "grpo_tokens": 1.0, "value_clipfrac": 0.5, "value_tokens": 0.0} if world.rank == 0 else \
    {"grpo_entropy": 0.0, "grpo_tokens": 0.0, "value_clipfrac": 0.0, "value_tokens": 0.0}
assert across_ranks(edge) == {"grpo_entropy": 2.0, "grpo_tokens": 1.0, "value_clipfrac": 0.25, "value_tokens": 0.0}

grad_diff = max((seen[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
grad_max = max(g.abs().max().item() for g in ref_grads.values())  # float32 sums in another order: relative
full = dict(dist.full_parameters(policy))
param_diff = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
assert set(full) == {n for n, _ in ref.named_parameters()}
if world.is_main:
    print(f"OK grad_diff={grad_diff:.3e} of {grad_max:.3e} param_diff={param_diff:.3e}")
assert grad_diff < 1e-6 * max(1.0, grad_max), (grad_diff, grad_max)
assert param_diff < 1e-6, param_diff

# ---- bf16 compute, float32 reduction: the reduced gradient is the float32 mean of the ranks' bf16 ones ----
mine = torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(100 + world.rank))
replica = load_policy(path)  # what FSDP2 gathers for a bf16 forward: the parameters cast (buffers stay float32)
for p in replica.parameters():
    p.data = p.data.to(torch.bfloat16)
token_logprobs(replica, mine).sum().backward()
expected = {n: dist.all_reduce(p.grad.float(), "avg") for n, p in replica.named_parameters()}  # float32 mean
bf16 = dist.shard(load_policy(path), world, torch.bfloat16)
token_logprobs(bf16, mine).sum().backward()
reduced = {n: p.grad.full_tensor() for n, p in bf16.named_parameters()}
assert {g.dtype for g in reduced.values()} == {torch.float32}
rel = max(((reduced[n] - expected[n]).abs().max() / expected[n].abs().max()).item() for n in expected)
if world.is_main:
    print(f"OK bf16 compute, float32 reduction: max relative diff {rel:.2e}")
assert rel < 1e-6, rel  # a bf16 reduce-scatter rounds each sum to 8 bits of mantissa: about 1e-3
dist.shutdown()
launch.leave(0)  # no interpreter teardown: see launch.leave
