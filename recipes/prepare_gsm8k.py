"""Write GSM8K as minirl JSONL ({"prompt", "answer"} per line), prompts in the model's chat format.

    pip install -e '.[gsm8k]'
    python recipes/prepare_gsm8k.py --model Qwen/Qwen2.5-0.5B-Instruct --out data/gsm8k
    python recipes/prepare_gsm8k.py --from ~/grade-school-math/data --out data/gsm8k   # no network, no datasets

Writes OUT/train.jsonl (7473 problems) and OUT/test.jsonl (1319). The instruction asks for the
final answer after "####", which is what the JSONL task's strict reward reads (minirl.rewards:gsm8k,
a regex, never eval).
The same prompt as verl's GSM8K example, so the numbers compare. `--from DIR` reads a local copy
instead of the hub: GSM8K's own train.jsonl and test.jsonl (each line {"question", "answer"}, as in
the grade-school-math repository), or the hub dataset's train/test parquet files.
"""

import argparse
import glob
import json
import os
import sys

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def rows(split: str, local: str):
    """GSM8K's `split` as (question, answer) pairs: from `local` when given, else the hub."""
    if local:
        jsonl = os.path.join(local, f"{split}.jsonl")
        if os.path.isfile(jsonl):
            with open(jsonl, encoding="utf-8") as f:
                return [(r["question"], r["answer"]) for r in map(json.loads, filter(str.strip, f))]
        parquet = sorted(glob.glob(os.path.join(local, "**", f"{split}-*.parquet"), recursive=True))
        if not parquet:
            sys.exit(f"prepare_gsm8k: error: --from {local!r} has neither {split}.jsonl nor {split}-*.parquet")
        import pyarrow.parquet as pq  # installed with datasets
        table = pq.read_table(parquet[0]).to_pydict()
        return list(zip(table["question"], table["answer"]))
    try:
        from datasets import load_dataset
    except ImportError:
        sys.exit("prepare_gsm8k: error: reading GSM8K from the hub needs `datasets` (pip install -e '.[gsm8k]'); "
                 "or give --from DIR with a local copy of its train.jsonl and test.jsonl")
    try:
        return [(r["question"], r["answer"]) for r in load_dataset("openai/gsm8k", "main", split=split)]
    except Exception as e:  # offline, a proxy, a moved dataset
        sys.exit(f"prepare_gsm8k: error: openai/gsm8k could not be fetched ({type(e).__name__}: "
                 f"{str(e).splitlines()[0][:160]}); give --from DIR with a local copy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="whose chat template formats the prompts")
    ap.add_argument("--out", default="data/gsm8k")
    ap.add_argument("--from", dest="local", default="", help="a local copy of GSM8K (train.jsonl and test.jsonl, "
                    "or the hub's parquet files) instead of the hub")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.chat_template is None:
        print(f"{a.model} has no chat template: prompts are the plain question and instruction")
    os.makedirs(a.out, exist_ok=True)
    for split in ("train", "test"):
        problems = rows(split, a.local)
        path = os.path.join(a.out, f"{split}.jsonl")
        with open(path, "w") as f:
            for question, answer in problems:
                text = f"{question} {INSTRUCTION}"
                prompt = text if tok.chat_template is None else tok.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
                f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
        print(f"{path}: {len(problems)} problems")


if __name__ == "__main__":
    main()
