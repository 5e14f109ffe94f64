"""Disaggregated placement, 3 ranks: rank 0 generates only (a vLLM engine in a private world of one),
ranks 1-2 train only (their own gloo group, FSDP2 over 2). The refit: the train ranks gather their
full weights and train rank 0 broadcasts them over the refit group (refit.send, buckets smaller than
the model so there are several); the rollout rank loads them as they arrive (refit.receive) and
samples greedily. The trainer then scores those tokens itself: the engine's logprobs must match
the weights it was sent. Run by tests/test_dist.py under torchrun --standalone."""

import json
import sys
import time

import torch

from minirl import dist, launch, refit
from minirl.config import RolloutConfig
from minirl.models import load_policy, load_tokenizer, token_logprobs

path = sys.argv[1]
roles, world, store = refit.init_disaggregated(rollout_ranks=1)
refit.BUCKET_BYTES = 1 << 20  # several buckets for the tiny model
if roles.trains:
    assert world.world_size == 2 and world.rank == roles.global_rank - 1
    policy = dist.shard(load_policy(path), world, torch.float32)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.5)  # a policy the engine has not seen
    buckets = refit.manifest(policy, torch.float32)
    assert len(buckets) > 1
    t = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(t)  # the train group is real and excludes the rollout rank
    assert t.item() == 3.0
    group = None
    if world.is_main:
        store.set("weights/manifest", json.dumps(buckets))
        group = refit.refit_group(store, 0, 2, world.device)
    named = dist.full_parameters(policy, torch.float32)  # collective over the train group only
    if world.is_main:
        assert refit.send(group, buckets, named) == sum(b["nbytes"] for b in buckets)
    else:
        for _ in named:
            pass
    out = json.loads(store.get("sampled"))  # the rollout rank's greedy tokens and engine logprobs
    with torch.no_grad():  # every train rank scores them (an FSDP forward is a collective)
        for prompt, comp, lps in zip(out["prompts"], out["completions"], out["logprobs"]):
            mine = token_logprobs(policy, torch.tensor([prompt + comp]))[0, len(prompt):]
            assert (mine - torch.tensor(lps)).abs().max().item() < 1e-4
    store.add("checked", 1)
    print(f"TRAIN rank {roles.global_rank} OK")
else:
    from minirl.rollout import Engine
    engine = Engine(path, RolloutConfig(max_tokens=4), max_model_len=32, device=roles.devices.engine, private=True)
    group = refit.refit_group(store, 1, 2, roles.devices.engine)
    buckets = json.loads(store.get("weights/manifest"))
    assert engine.load_weights(refit.receive(group, buckets)) == sum(len(b["entries"]) for b in buckets)
    tok = load_tokenizer(path)
    prompts = [tok(s, add_special_tokens=False).input_ids for s in ("ab#a=", "bba#a=", "a#a=")]
    out = engine.generate(prompts, [0, 1, 2], 1, greedy=True)
    store.set("sampled", json.dumps({"prompts": out.prompt_tokens, "completions": out.completion_tokens,
                                     "logprobs": out.logprobs}))
    while store.add("checked", 0) < 2:  # outside torchrun this rank hosts the store: outlive the trainers' reads
        time.sleep(0.01)
    engine.close()
    print("ROLLOUT OK")
dist.shutdown()
launch.leave(0)  # no interpreter teardown: see launch.leave
