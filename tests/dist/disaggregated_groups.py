"""Disaggregated placement, 3 ranks: rank 0 generates only (a vLLM engine in a private world of one),
ranks 1-2 train only (their own gloo group, FSDP2 over 2). The sides meet through the TCPStore:
the train ranks gather their full weights and the rollout rank loads them and samples.
Run by tests/test_dist.py under torchrun --standalone."""

import io
import sys

import torch

from minirl import dist
from minirl.config import RolloutConfig
from minirl.models import load_policy, load_tokenizer

path = sys.argv[1]
roles, world, store = dist.init_disaggregated(rollout_ranks=1)
if roles.trains:
    assert world.world_size == 2 and world.rank == roles.global_rank - 1 and roles.train_ranks == [1, 2]
    policy = dist.shard(load_policy(path), world, torch.float32)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.5)  # a policy the engine has not seen
    full = {n: t.clone() for n, t in dist.full_parameters(policy)}  # collective over the train group only
    t = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(t)  # the train group is real and excludes the rollout rank
    assert t.item() == 3.0
    if world.is_main:
        buf = io.BytesIO()
        torch.save(full, buf)
        store.set("weights", buf.getvalue())
    store.wait(["sampled"])
    print(f"TRAIN rank {roles.global_rank} OK")
else:
    from minirl.rollout import Engine
    engine = Engine(path, RolloutConfig(max_tokens=4), max_model_len=32, device=roles.devices.engine, private=True)
    weights = torch.load(io.BytesIO(store.get("weights")), weights_only=True)
    engine.load_weights(weights.items())
    tok = load_tokenizer(path)
    out = engine.generate([tok("ab#a=", add_special_tokens=False).input_ids], [0], 2)
    assert len(out.completion_tokens) == 2
    store.set("sampled", b"1")
    engine.close()
    print("ROLLOUT OK")
dist.shutdown()
