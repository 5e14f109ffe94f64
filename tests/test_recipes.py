"""Every recipe's flags parse and pass validation at the world size it launches (the GPU recipes
cannot run here; a typo in them must still fail CI). Data files are swapped for a temp file."""

import glob
import os
import re
import shlex

import pytest
import tyro

from conftest import ROOT
from minirl.config import GRPOArgs, PPOArgs

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
