"""Write GSM8K as minirl JSONL ({"prompt", "answer"} per line), prompts in the model's chat format.

    pip install -e '.[gsm8k]'
    python recipes/prepare_gsm8k.py --model Qwen/Qwen2.5-0.5B-Instruct --out data/gsm8k

Writes OUT/train.jsonl (7473 problems) and OUT/test.jsonl (1319). The instruction asks for the
final answer after "####", which is what tasks.JsonlTask's reward reads (a regex, never eval).
The same prompt as verl's GSM8K example, so the numbers compare.
"""

import argparse
import json
import os

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="whose chat template formats the prompts")
    ap.add_argument("--out", default="data/gsm8k")
    a = ap.parse_args()
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    os.makedirs(a.out, exist_ok=True)
    for split in ("train", "test"):
        rows = load_dataset("openai/gsm8k", "main", split=split)
        path = os.path.join(a.out, f"{split}.jsonl")
        with open(path, "w") as f:
            for r in rows:
                messages = [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}]
                prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                f.write(json.dumps({"prompt": prompt, "answer": r["answer"]}) + "\n")
        print(f"{path}: {len(rows)} problems")


if __name__ == "__main__":
    main()
