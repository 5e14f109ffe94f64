"""A shaping reward for recipes/cpu_smollm2_grpo.sh: a small bonus for showing the sum and ending on it.

The strict score (minirl.rewards:gsm8k, verl's) pays only a right `#### N`; SmolLM2-135M-Instruct almost
never writes the marker unasked-for, so at the start nearly every group scores all zeros and GRPO has
nothing to compare. This bonus (weight 0.2 in the recipe) pays the format: the completion works something out (an `=`)
and ends on a `#### N` line. A bonus for the marker alone was hacked within 3 steps (every completion
became `#### 20`, a guess: no work shown, no answer right); one that also asked the marker to repeat the
work's result (`= N` then `#### N`) paid no completion in the first 5 steps (32 a step), so GRPO had
nothing to learn from. Held-out accuracy is the first reward's, the strict one: the bonus never counts there.
"""

import re

_MARKED = re.compile(r"=[^\n]*\n(?:.*\n)*?####\s*-?\d+\s*$")


def shows_work_then_marker(completion: str, answer: str) -> float:
    return float(_MARKED.search(completion) is not None)
