"""The trainer side on a lent GPU (no vLLM there: its CUDA wheel is too large to carry): one prepared run, one JSON.

    bash bench/gpu_check.sh                            # on the H200 (through the device tool)
    python bench/gpu_check.py --size tiny --rows 4 --completion 64   # CPU smoke run of the same code

With a randomly initialised Qwen2-0.5B-shaped policy and value (FSDP2 world of one, bf16 compute,
fp32 master weights), it measures:
1. step throughput: policy forward/backward/AdamW and value forward/backward/AdamW on
   rows x (prompt + completion) tokens: seconds, tokens/s, peak memory, and the FLOP floor
   (6N per token and model) against the device's measured bf16 matmul rate;
2. micro-batching memory at long completions: one policy step un-chunked vs n_micro 2/4/8
   (accumulator.Accumulator), peak allocated memory and the max gradient difference to un-chunked;
3. offload/onload (offload.TrainerOffload): seconds, device memory released, bit-exact round trip;
4. determinism mode (dist.set_deterministic): the same step twice gives equal gradients;
5. float32 master weights (dist.shard): after a step with bf16 compute, every local parameter,
   gradient and AdamW state is float32 and the decoder computes in bf16;
6. the chunked logprob head (models.token_logprobs) against the plain full-vocabulary
   log-softmax at vocab 151,936: value and gradient differences, and peak memory of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minirl import dist  # noqa: E402
from minirl.accumulator import Accumulator  # noqa: E402
from minirl import models  # noqa: E402
from minirl.models import ValueModel, token_logprobs  # noqa: E402
from minirl.objective import policy_loss, value_loss  # noqa: E402
from minirl.offload import TrainerOffload  # noqa: E402

SIZES = {  # Qwen2 shapes
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=256, vocab_size=1000),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_mib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def allocated_mib(device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None


def build(size: str, world, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

    cfg = Qwen2Config(**SIZES[size], tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(seed)
    compute = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    policy = dist.shard(Qwen2ForCausalLM(cfg), world, compute)
    value = dist.shard(ValueModel(Qwen2Model(cfg), cfg.hidden_size), world, compute)
    return cfg, policy, value


def batch(rows: int, prompt: int, completion: int, vocab: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + completion), generator=g)
    mask = torch.zeros(rows, prompt + completion)
    for i in range(rows):  # unequal completion lengths, as rollouts have
        mask[i, prompt:prompt + completion // (1 + i % 4)] = 1.0
    adv = torch.randn(rows, prompt + completion, generator=g) * mask
    return ids.to(device), mask.to(device), adv.to(device)


def policy_step(policy, opt, ids, mask, adv, n_micro: int) -> list[torch.Tensor]:
    """One optimizer step over the rows in n_micro chunks; returns the gradients it applied."""
    seen = []
    acc = Accumulator(policy, opt, n_micro, max_grad_norm=0.0)
    orig = opt.step

    def recording_step(*a, **k):
        seen.extend(p.grad.full_tensor().detach().float().clone() for p in policy.parameters())
        return orig(*a, **k)

    opt.step = recording_step
    for part in zip(ids.chunk(n_micro), mask.chunk(n_micro), adv.chunk(n_micro)):
        logp = token_logprobs(policy, part[0])
        loss, divisor, _ = policy_loss(logp, logp.detach(), part[2], part[1], 0.2, prefix="ppo")
        acc.backward(loss, divisor)
    opt.step = orig
    return seen


def throughput(policy, value, popt, vopt, ids, mask, adv, device, repeats: int) -> dict:
    times = []
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        policy_step(policy, popt, ids, mask, adv, 1)
        v = value(ids)
        loss, _, _ = value_loss(v, v.detach(), adv, mask, 0.2)
        loss.backward()
        vopt.step()
        vopt.zero_grad(set_to_none=True)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return {"step_s": sorted(times)[len(times) // 2], "tokens": ids.numel()}


def matmul_rate(device, dtype) -> float:
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--n-micro", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/gpu_check.json")
    a = ap.parse_args()
    world = dist.init()
    device = world.device
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "args": vars(a)}
    cfg, policy, value = build(a.size, world)
    n_params = sum(p.numel() for p in policy.parameters())
    popt, vopt = torch.optim.AdamW(policy.parameters(), lr=1e-6), torch.optim.AdamW(value.parameters(), lr=1e-6)
    ids, mask, adv = batch(a.rows, a.prompt, a.completion, cfg.vocab_size, device)

    # 1. throughput at the micro-batch that fits: a quarter of the rows
    rows = max(1, a.rows // 4)
    reset_peak(device)
    t = throughput(policy, value, popt, vopt, ids[:rows], mask[:rows], adv[:rows], device, a.repeats)
    rate = matmul_rate(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    floor = 2 * 6 * n_params * t["tokens"] / rate  # policy + value, 6N per token each
    out["throughput"] = {**t, "params": n_params, "tokens_per_s": t["tokens"] / t["step_s"],
                         "peak_mib": peak_mib(device), "matmul_flops_per_s": rate, "floor_s": floor,
                         "step_over_floor": t["step_s"] / floor}
    print("throughput", json.dumps(out["throughput"]), flush=True)

    # 2. micro-batching memory: one policy step at long completions
    out["micro_batching"], ref = [], None
    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    for n in [n for n in a.n_micro if n <= a.rows]:
        policy.load_state_dict(state)
        popt.state.clear()
        reset_peak(device)
        try:
            grads = policy_step(policy, popt, ids, mask, adv, n)
            row = {"n_micro": n, "peak_mib": peak_mib(device)}
            ref = ref or grads
            row["grad_diff"] = max((x - y).abs().max().item() for x, y in zip(grads, ref))
            row["grad_max"] = max(x.abs().max().item() for x in ref)
        except torch.OutOfMemoryError as e:
            row = {"n_micro": n, "oom": str(e)[:160]}
            popt.zero_grad(set_to_none=True)
        out["micro_batching"].append(row)
        print("micro_batching", json.dumps(row), flush=True)
    policy.load_state_dict(state)

    # 3. offload / onload
    policy_step(policy, popt, ids[:rows], mask[:rows], adv[:rows], 1)
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    off = TrainerOffload(policy, popt)
    sync(device)
    m0, t0 = allocated_mib(device), time.perf_counter()
    off.offload()
    sync(device)
    m1, t1 = allocated_mib(device), time.perf_counter()
    off.onload()
    sync(device)
    t2 = time.perf_counter()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    exact = all(torch.equal(full(before[k]), full(v)) for k, v in policy.state_dict().items())
    out["offload"] = {"offload_s": t1 - t0, "onload_s": t2 - t1, "allocated_before_mib": m0,
                      "allocated_offloaded_mib": m1, "released_mib": (m0 - m1) if m0 is not None else None,
                      "bit_exact": exact}
    print("offload", json.dumps(out["offload"]), flush=True)

    # 4. determinism mode: the same step twice
    dist.set_deterministic()
    runs = []
    for _ in range(2):
        policy.load_state_dict(state)
        popt.state.clear()
        runs.append(policy_step(policy, popt, ids[:rows], mask[:rows], adv[:rows], 2))
    out["determinism"] = {"equal_gradients": all(torch.equal(x, y) for x, y in zip(*runs))}
    print("determinism", json.dumps(out["determinism"]), flush=True)
    torch.use_deterministic_algorithms(False)

    # 5. float32 master weights under bf16 compute
    policy.load_state_dict(state)
    seen = []
    hook = policy.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    policy_step(policy, popt, ids[:rows], mask[:rows], adv[:rows], 1)
    hook.remove()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    out["fp32_master"] = {
        "params": sorted({str(local(p).dtype) for p in policy.parameters()}),
        "optimizer": sorted({str(local(v).dtype) for s in popt.state.values() for v in s.values() if v.numel() > 1}),
        "compute": sorted(set(seen))}
    print("fp32_master", json.dumps(out["fp32_master"]), flush=True)

    # 6. chunked logprobs vs the plain log-softmax at the real vocabulary
    out["logprobs"] = {}
    lp_ids = ids[:rows]
    ref_lp = None
    for name, fn in (("plain", models.plain_token_logprobs), ("chunked", models.token_logprobs)):
        policy.load_state_dict(state)
        popt.zero_grad(set_to_none=True)
        reset_peak(device)
        base = allocated_mib(device)
        sync(device)
        t0 = time.perf_counter()
        try:
            lp = fn(policy, lp_ids)
            (lp * mask[:rows]).sum().backward()
            sync(device)
            grads = [full(p.grad).float().clone() for p in policy.parameters()]
            row = {"s": time.perf_counter() - t0, "peak_over_start_mib": (peak_mib(device) or 0) - (base or 0)}
            if ref_lp is None:
                ref_lp, ref_g = lp.detach(), grads
            else:
                row["max_logprob_diff"] = (lp.detach() - ref_lp).abs().max().item()
                row["max_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(grads, ref_g))
                row["grad_max"] = max(g.abs().max().item() for g in ref_g)
        except torch.OutOfMemoryError as e:
            row = {"oom": str(e)[:160]}
        out["logprobs"][name] = row
        print("logprobs", name, json.dumps(row), flush=True)
    popt.zero_grad(set_to_none=True)

    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(a.out)


if __name__ == "__main__":
    main()
