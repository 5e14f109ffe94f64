"""A shaping reward for recipes/cpu_smollm2_grpo.sh: a small bonus for showing the sum and ending on it.

The strict score (minirl.rewards:gsm8k, verl's) pays only a right `#### N`; SmolLM2-135M-Instruct almost
never writes the marker unasked-for, so at the start nearly every group scores all zeros and GRPO has
nothing to compare. This bonus (weight 0.2 in the recipe) pays the format: the completion works the sum
out (`... = N`) and ends on `#### N` with that same N. A bonus for the marker alone was hacked within
3 steps (every completion became `#### 20`, a guess: no work shown, no answer right); this one pays
only a completion whose marker repeats its own result, right or wrong. Held-out accuracy is the first
reward's, the strict one, so the bonus never counts there.
"""

import re

_WORKED = re.compile(r"=\s*(-?\d+)\s*\n+####\s*(-?\d+)\s*$")


def shows_its_result(completion: str, answer: str) -> float:
    m = _WORKED.search(completion)
    return float(m is not None and m.group(1) == m.group(2))
