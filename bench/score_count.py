"""Score an exported policy on the built-in task's held-out prompts with Hugging Face `generate`, outside
minirl's engine and scorer: a prompt counts only when the greedy completion is exactly the count followed
by end of sequence. Prints the accuracy, the share of completions that ran to the cap, and a few
completions; exits 1 below --min-accuracy or above --max-capped.

    python bench/score_count.py runs/demo/final
"""

from __future__ import annotations

import argparse
import json
import sys


def score(path: str, prompts: int = 128, seed: int = 0, max_tokens: int = 8) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minirl.tasks import CountTask  # only for the held-out prompts and their answers

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    exact = capped = 0
    rows = []
    for p in CountTask(seed, prompts).eval_set:
        ids = tok(p.prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        ended = tok.eos_token_id in out
        text = tok.decode(out[:out.index(tok.eos_token_id)] if ended else out)
        exact += ended and text == p.answer
        capped += not ended
        rows.append({"prompt": p.prompt, "completion": text, "ended": ended, "answer": p.answer})
    n = len(rows)
    return {"accuracy": exact / n, "capped": capped / n, "prompts": n, "samples": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a Hugging Face folder, e.g. runs/demo/final")
    ap.add_argument("--prompts", type=int, default=128, help="held-out prompts (--task.eval-prompts)")
    ap.add_argument("--seed", type=int, default=0, help="the run's --seed (it picks the held-out set)")
    ap.add_argument("--min-accuracy", type=float, default=0.0)
    ap.add_argument("--max-capped", type=float, default=1.0)
    args = ap.parse_args()
    got = score(args.path, args.prompts, args.seed)
    for row in got["samples"][:4]:
        print(f"{row['prompt']!r} -> {row['completion']!r}{'' if row['ended'] else ' (no EOS)'} "
              f"(answer {row['answer']!r})")
    print(json.dumps({k: v for k, v in got.items() if k != "samples"}))
    sys.exit(0 if got["accuracy"] >= args.min_accuracy and got["capped"] <= args.max_capped else 1)


if __name__ == "__main__":
    main()
