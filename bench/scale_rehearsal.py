"""Scale rehearsal on CPU: a Qwen2.5-0.5B-shaped model through the real code paths.

    python bench/scale_rehearsal.py              # about 15 minutes on 2 cores, peaks near 20 GB
    python bench/scale_rehearsal.py --only refit # one part (grpo | refit); the other's last result is kept

The model: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151,936, tied
embeddings, random weights, float32, with the built-in character tokenizer (no download). It is
written once into the cache folder. Then:
1. one GRPO step: `python -m minirl.grpo --model.path <it> --steps 1` (one process: the engine, the
   FSDP2 policy, AdamW, the colocated hand-off), a tiny batch; `MINIRL_PROFILE_LOOP=1` gives the
   phase times; the peak RSS is the process's high-water mark;
2. one disaggregated refit: `bench/weight_sync.py --model-path <it>` (torchrun, 1 train rank + 1
   rollout rank: `refit.send` over the refit group into the engine), against the colocated load,
   and whether its time per GB matches the 66 MiB model's (bench/results/weight_sync.json).
A full PPO step at this size does not fit this 24 GB machine (policy and critic with AdamW are
about 16 GB on the train rank, beside the rollout rank's engine); the refit is what PPO adds.
Writes bench/results/scale_rehearsal.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import LAUNCH_VARS, RESULTS, ROOT, metrics, write  # noqa: E402

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=151_936, tie_word_embeddings=True, max_position_embeddings=512)


def build(folder: str) -> str:
    """The 0.5B-shaped model with random weights and the built-in tokenizer, written once."""
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from minirl.models import _char_tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_object=_char_tokenizer(), pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, dtype="float32"))
    tmp = folder + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def child_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["grpo", "refit"], default=None)
    a = ap.parse_args()
    cache = os.environ.get("MINIRL_CACHE", os.path.join(ROOT, ".cache", "minirl"))
    t0 = time.perf_counter()
    folder = build(os.path.join(cache, "qwen2.5-0.5b-shaped-random"))
    previous = os.path.join(RESULTS, "scale_rehearsal.json")
    out: dict = json.load(open(previous)) if a.only and os.path.exists(previous) else {}
    out.update(model=SHAPE, build_s=time.perf_counter() - t0)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(MINIRL_CACHE=cache, MINIRL_PROFILE_LOOP="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")

    if a.only != "refit":
        grpo_step(folder, env, out)
    if a.only != "grpo":
        refit_once(folder, env, out)
    print(write("scale_rehearsal", out))


def grpo_step(folder: str, env: dict, out: dict) -> None:
    """1. one GRPO step through the real entrypoint."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "minirl.grpo", "--model.path", folder, "--steps", "1",
               "--rl.group-size", "2", "--rl.batch-per-replica", "4", "--rollout.max-tokens", "16",
               "--rollout.max-prompt-tokens", "16", "--rollout.kv-cache-gib", "1", "--log.eval-every", "0",
               "--log.run-dir", run_dir]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode:
            out["grpo"] = {"failed": p.stderr[-2000:]}
        else:
            rec = metrics(run_dir)[-1]
            out["grpo"] = {"wall_s": wall, "peak_rss_gib": child_peak_gib(), "step_s": rec["time/step"],
                           "phases_s": {k: v for k, v in rec["grpo_step"].items() if k.endswith("/s")},
                           "rss_mib_at": {k: v for k, v in rec["grpo_step"].items() if k.endswith("/rss_mib")},
                           "build_trainer_s": rec.get("time/build_trainer"), "build_engine_s": rec.get("time/build_engine")}
    print("grpo", json.dumps(out["grpo"]), flush=True)


def refit_once(folder: str, env: dict, out: dict) -> None:
    """2. one disaggregated refit against the colocated load."""
    p = subprocess.run([sys.executable, "bench/weight_sync.py", "--model-path", folder, "--rollout-ranks", "1",
                        "--repeats", "2", "--arms", "colocated", "disaggregated", "--name", "weight_sync_0.5b"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        out["refit"] = {"failed": p.stderr[-2000:]}
    else:
        big = json.load(open(os.path.join(RESULTS, "weight_sync_0.5b.json")))["sizes"][0]
        small = [s for s in json.load(open(os.path.join(RESULTS, "weight_sync.json")))["sizes"]
                 if s.get("hidden") == 512 and s["rollout_ranks"] == 1]
        gb = big["bytes"] / 1e9
        out["refit"] = {"line": [x for x in p.stdout.splitlines() if x.startswith("refit ")][0],
                        "bytes": big["bytes"], "colocated_s": big["colocated_s"],
                        "disaggregated_s": big["disaggregated_s"], "ratio": big["ratio"],
                        "disaggregated_s_per_gb": big["disaggregated_s"] / gb, "peak_rss_gib": big["peak_rss_gib"]}
        if small:
            out["refit"]["disaggregated_s_per_gb_at_66_mib"] = small[0]["disaggregated_s"] / (small[0]["bytes"] / 1e9)
    print("refit", json.dumps(out["refit"]), flush=True)


if __name__ == "__main__":
    main()
