"""Peak memory of one GRPO optimizer step, un-chunked vs micro-batched (B16: micro-batching
is what fixes the OOM), through the real update path (grpo.update, FSDP2 world of one, CPU).

    python bench/micro_memory.py --n-micro 1 8           # peaks side by side, and the gradient difference
    python bench/micro_memory.py --n-micro 1 --budget-mib 300   # fails (exit 3) if the step needs more
    python bench/micro_memory.py --vocab 151936 --rows 8 --completion 256 --n-micro 1 --logprobs plain chunked
        # a real vocabulary: the full-vocabulary log-softmax (before) vs the chunked logprob head (after)
    python bench/micro_memory.py --n-micro 1 --packing off on
        # padded (before) vs padding-free (--model.packing): the rows' lengths are 1024, 512, 341, 256
    python bench/micro_memory.py --n-micro 1 --checkpointing off on
        # every block's activations kept (before) vs --model.activation-checkpointing: peak and step time

--budget-mib caps the address space this process may ADD after the model and batch are built
(RLIMIT_AS = current size + budget), so a step that needs more fails with an out-of-memory error.
Prints one JSON line per configuration: {"n_micro", "logprobs", "packing", "peak_mib" (RSS growth over the step),
"step_s", "computed_tokens" (what the forwards computed, pads included), "floor_s" (6N FLOPs per real token over
this process's measured matmul rate), "grad_diff_vs_first"}.
"""

import argparse
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minirl import dist  # noqa: E402
from minirl.accumulator import Accumulator  # noqa: E402
from minirl.batch import RolloutStore, pack, plan_chunks  # noqa: E402
from minirl.config import ModelConfig
from minirl.config_grpo import GRPOArgs  # noqa: E402
from minirl.grpo import Probe, update  # noqa: E402
from minirl.launch import resolve_path  # noqa: E402
from minirl.models import load_policy  # noqa: E402
from minirl.rollout import Samples  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import matmul_flops_per_s  # noqa: E402


def batch(rows: int, completion: int) -> dict:
    g = torch.Generator().manual_seed(0)
    lens = [completion // (1 + i % 4) for i in range(rows)]  # unequal lengths
    comps = [torch.randint(3, 40, (n,), generator=g).tolist() for n in lens]
    s = Samples(list(range(rows)), [[5, 6, 7]] * rows, comps, [[-1.0] * n for n in lens], ["length"] * rows)
    return pack(s, torch.tensor([1.0, -1.0] * (rows // 2)), pad_id=0)


def vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def policy_model(path: str, vocab: int | None):
    """The tiny model, or the same shape at vocabulary `vocab` (random weights: only memory is measured)."""
    if not vocab:
        return load_policy(path)
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path)
    cfg.vocab_size, cfg.use_cache = vocab, False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def one_step(path, n_micro, rows, completion, budget_mib=None, vocab=None, logprobs="chunked", packing="off",
             checkpointing="off"):
    world = dist.init()
    args = GRPOArgs()
    args.rl.group_size, args.rl.batch_per_replica = 2, rows
    args.rl.micro_batch_per_replica = 0 if n_micro == 1 else rows // n_micro
    args.validate(1)
    if logprobs == "plain":  # before: the full-vocabulary float32 log-softmax of the whole micro-batch
        from minirl import grpo, models
        grpo.score = models.plain_token_logprobs
    model = policy_model(path, vocab)
    if checkpointing == "on":
        from minirl.models import checkpoint_blocks
        checkpoint_blocks(model)
    policy = dist.shard(model, world, torch.float32)
    policy.pack_rows = packing == "on"
    if policy.pack_rows:
        from minirl.models import packing_error
        assert packing_error(policy) is None, "this model mixes packed rows"
    grads = {}

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            grads.update({n: p.grad.full_tensor().clone() for n, p in policy.named_parameters()})
            return super().step(closure)

    acc = Accumulator(policy, Recording(policy.parameters(), lr=0.1), args.n_micro)
    b = batch(rows, completion)
    store = RolloutStore(b, plan_chunks(b["lengths"].tolist(), 1, args.micro_batch), 1)
    before = rss_mib()
    if budget_mib is not None:
        resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + budget_mib * 2**20, resource.RLIM_INFINITY))
    t0 = time.perf_counter()
    calls, _ = update(policy, None, acc, store, args, Probe(policy), ahead=False)
    tokens = int(b["lengths"].sum())
    flops = 6 * sum(p.numel() for p in policy.parameters()) * tokens
    return rss_mib() - before, grads, {"step_s": time.perf_counter() - t0, "floor_s": flops / matmul_flops_per_s(
        threads=torch.get_num_threads()), "computed_tokens": sum(c["grpo_computed_tokens"] for c in calls)}


def worker(a) -> None:
    """One configuration in this process (a peak RSS is a per-process high-water mark)."""
    try:
        peak, grads, timing = one_step(resolve_path(ModelConfig()), a.worker, a.rows, a.completion, a.budget_mib,
                                       a.vocab, a.logprobs[0], a.packing[0], a.checkpointing[0])
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError) and "alloc" not in str(e).lower():
            raise
        print(json.dumps({"n_micro": a.worker, "logprobs": a.logprobs[0], "packing": a.packing[0], "oom": True,
                          "error": str(e)[:200]}),
              flush=True)
        sys.exit(3)
    torch.save(grads, a.grads)
    print(json.dumps({"n_micro": a.worker, "logprobs": a.logprobs[0], "packing": a.packing[0],
                      "checkpointing": a.checkpointing[0], "peak_mib": round(peak, 1), **timing}),
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-micro", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--budget-mib", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None, help="the tiny model's shape at this vocabulary (e.g. 151936)")
    ap.add_argument("--logprobs", nargs="+", default=["chunked"], choices=["plain", "chunked"],
                    help="plain: the full-vocabulary log-softmax (before the chunked head); chunked: minirl's")
    ap.add_argument("--packing", nargs="+", default=["off"], choices=["off", "on"],
                    help="on: rows packed end to end (--model.packing); off: padded to the longest row")
    ap.add_argument("--checkpointing", nargs="+", default=["off"], choices=["off", "on"],
                    help="--model.activation-checkpointing off (every block's activations kept) and/or on")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--grads", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args()
    if a.worker is not None:
        return worker(a)
    import subprocess
    import tempfile
    rows, ref = [], None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    with tempfile.TemporaryDirectory() as tmp:
        for n, lp, pk, ac in [(n, lp, pk, ac) for ac in a.checkpointing for pk in a.packing for lp in a.logprobs
                              for n in a.n_micro]:
            gfile = os.path.join(tmp, f"g{n}{lp}{pk}{ac}.pt")
            cmd = [sys.executable, __file__, "--worker", str(n), "--grads", gfile, "--logprobs", lp, "--packing", pk,
                   "--checkpointing", ac, "--rows", str(a.rows), "--completion", str(a.completion)]
            if a.budget_mib is not None:
                cmd += ["--budget-mib", str(a.budget_mib)]
            if a.vocab:
                cmd += ["--vocab", str(a.vocab)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            row = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {"n_micro": n, "error": p.stderr[-500:]}
            if os.path.exists(gfile):
                grads = torch.load(gfile, weights_only=True)
                ref = ref or grads
                row["grad_diff_vs_first"] = max((grads[k] - ref[k]).abs().max().item() for k in ref)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": a.rows, "completion": a.completion, "budget_mib": a.budget_mib, "vocab": a.vocab,
                       "results": rows}, f, indent=1)
    sys.exit(3 if any(r.get("oom") for r in rows) else 0)


if __name__ == "__main__":
    main()
