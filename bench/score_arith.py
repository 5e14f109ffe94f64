"""Score a Hugging Face folder on recipes/cpu_smollm2_grpo.sh's held-out arithmetic with Hugging Face
`generate`, outside minirl's engine and scorer: the chat template applied by transformers, greedy
decoding to --max-tokens, and a prompt counts only when the completion ended on its own (end of turn)
and the last `#### N` in it (verl's strict pattern, written out here) is the answer. Prints the accuracy,
the share that wrote the marker at all, the share cut at the cap, and a few completions.

    python bench/score_arith.py runs/cpu_smollm2_grpo/final            # after the run
    python bench/score_arith.py models/smollm2-135m-instruct           # the model before it
"""

from __future__ import annotations

import argparse
import json
import re

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def score(path: str, data: str, prompts: int, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(data)][:prompts]
    right = marked = capped = 0
    out = []
    for r in rows:
        ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, ids["input_ids"].shape[1]:].tolist()
        ended = tok.eos_token_id in gen
        text = tok.decode(gen[:gen.index(tok.eos_token_id)] if ended else gen, skip_special_tokens=True)
        found = STRICT.findall(text[-300:])
        right += ended and bool(found) and found[-1].replace(",", "") == r["answer"]
        marked += "####" in text
        capped += not ended
        out.append({"question": r["prompt"][-1]["content"], "completion": text, "answer": r["answer"]})
    n = len(rows)
    return {"accuracy": right / n, "wrote_marker": marked / n, "capped": capped / n, "prompts": n, "samples": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a Hugging Face folder, e.g. runs/cpu_smollm2_grpo/final")
    ap.add_argument("--data", default="data/arith/test.jsonl", help="the held-out rows (recipes/prepare_arith.py)")
    ap.add_argument("--prompts", type=int, default=100, help="held-out prompts (the recipe's --task.eval-prompts)")
    ap.add_argument("--max-tokens", type=int, default=32, help="the recipe's --rollout.max-tokens")
    args = ap.parse_args()
    got = score(args.path, args.data, args.prompts, args.max_tokens)
    for row in got["samples"][:6]:
        print(f"{row['question']!r} -> {row['completion']!r} (answer {row['answer']!r})")
    print(json.dumps({k: v for k, v in got.items() if k != "samples"}))


if __name__ == "__main__":
    main()
