"""Word arithmetic with `#### N` answers, generated in code: the task of recipes/cpu_smollm2_grpo.sh.

    python recipes/prepare_arith.py --out data/arith     # train.jsonl (4,000 rows), test.jsonl (200)

Each row asks for the sum or difference of two numbers from 1 to 20 (three in one row of four), in words, as chat messages:
{"prompt": [{"role": "user", "content": "What is 12 plus 7? ..."}], "answer": "19"}. The held-out
problems are disjoint from the training ones (a problem is held out iff its hash says so), and both
files are a pure function of the seed.
"""

import argparse
import hashlib
import json
import os
import random

ASK = "{q} End your answer with #### and the result."


def problem(rng: random.Random) -> tuple[str, int]:
    terms = [rng.randint(1, 20) for _ in range(rng.choice((2, 2, 2, 3)))]
    ops = [rng.choice(("plus", "minus")) for _ in terms[1:]]
    value, words = terms[0], [str(terms[0])]
    for op, t in zip(ops, terms[1:]):
        value = value + t if op == "plus" else value - t
        words += [op, str(t)]
    return f"What is {' '.join(words)}?", value


def held_out(question: str) -> bool:
    return hashlib.blake2b(question.encode(), digest_size=2).digest()[0] % 8 == 0


def rows(n: int, test: bool, seed: int) -> list[dict]:
    rng, out, seen = random.Random(f"{seed}:{test}"), [], set()
    while len(out) < n:
        q, a = problem(rng)
        if held_out(q) == test and q not in seen:
            seen.add(q)
            out.append({"prompt": [{"role": "user", "content": ASK.format(q=q)}], "answer": str(a)})
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name, n, test in (("train", a.train, False), ("test", a.test, True)):
        with open(os.path.join(a.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(n, test, a.seed))
    print(a.out)
