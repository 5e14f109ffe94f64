"""Every recipe's flags parse and pass validation at the world size it launches (the GPU recipes
cannot run here; a typo in them must still fail CI). Data files are swapped for a temp file."""

import glob
import os
import re
import shlex

import pytest
import tyro

from conftest import ROOT
from minirl.config_grpo import GRPOArgs
from minirl.config_ppo import PPOArgs

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.sh")))


def flags(path):
    text = open(path).read()
    cmd = text[text.index("exec "):].replace("\\\n", " ").split("\n")[0]
    words = shlex.split(cmd.replace('"$@"', ""))
    module = words[words.index("-m") + 1]
    nproc = int(re.search(r"--nproc-per-node[ =](\d+)", cmd).group(1)) if "--nproc-per-node" in cmd else 1
    return module, nproc, words[words.index("-m") + 2:]


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_flags_parse_and_validate(path, tmp_path):
    module, nproc, argv = flags(path)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "q", "answer": "1"}\n' * 10)
    argv = [str(data) if a.endswith(".jsonl") else a for a in argv]
    cls = {"minirl.grpo": GRPOArgs, "minirl.ppo": PPOArgs}[module]
    cls_args = tyro.cli(cls, args=argv)
    cls_args.validate(nproc)
    assert len(RECIPES) >= 5


def test_prepare_gsm8k_reads_a_local_copy_without_the_hub(tmp_path, tiny_path):
    """`--from DIR` with GSM8K's own train.jsonl / test.jsonl: no network, no `datasets`; the output is
    a JSONL the task loads, its answers read by the strict `#### N` extraction."""
    import json
    import subprocess
    import sys

    from minirl.config import TaskConfig
    from minirl.tasks import make_task
    src = tmp_path / "gsm8k"
    src.mkdir()
    for split, n in (("train", 6), ("test", 2)):
        (src / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"What is {k} + 1?",
                                                                "answer": f"{k} + 1 = {k + 1}\n#### {k + 1}"}) + "\n"
                                                    for k in range(n)))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "recipes/prepare_gsm8k.py", "--model", tiny_path, "--from", str(src),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "train.jsonl: 6 problems" in p.stdout and "test.jsonl: 2 problems" in p.stdout
    task = make_task(TaskConfig(name="jsonl", path=str(out / "train.jsonl"), eval_path=str(out / "test.jsonl")), 0)
    assert len(task.rows) == 6 and [q.answer for q in task.eval_set] == ["1", "2"]
    p = subprocess.run([sys.executable, "recipes/prepare_gsm8k.py", "--model", tiny_path, "--from", str(tmp_path),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "has neither train.jsonl" in p.stderr and "Traceback" not in p.stderr
