"""launch.py and the commands: `--config` files (flags beside them win, a run's config.json reruns
it), the console scripts' exit codes, and `minirl-eval` / `minirl-export` on a finished run."""

import inspect
import json
import os
import re
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import run, start
from minirl import launch
from minirl.config import ConfigError
from minirl.config_grpo import GRPOArgs

BIN = os.path.dirname(sys.executable)  # the console scripts sit beside the interpreter


def script(name):
    return os.path.join(BIN, name)


def test_a_config_file_sets_defaults_and_flags_beside_it_win(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("steps: 7\nrl:\n  lr: 5.0e-5\n  group_size: 4\nlog:\n  eval_every: 3\n")
    args = launch.parse(GRPOArgs, ["--config", str(f), "--steps", "9"], "")
    assert (args.steps, args.rl.lr, args.rl.group_size, args.log.eval_every) == (9, 5e-5, 4, 3)
    (tmp_path / "bad.json").write_text(json.dumps({"rl": {"learning_rate": 1e-5}}))
    with pytest.raises(ConfigError, match=r"--config: rl\.learning_rate is not a flag"):
        launch.parse(GRPOArgs, ["--config", str(tmp_path / "bad.json")], "")
    with pytest.raises(ConfigError, match="--rl.grad-accum is retired"):  # hidden from --help, refused by name
        launch.parse(GRPOArgs, ["--rl.grad-accum", "4"], "")


def test_a_config_file_never_carries_the_runs_own_switches(tmp_path, capsys, monkeypatch):
    """Another run's config.json (run dir, overwrite, resume, checkpoint dir) reruns its recipe, never
    into that run: the switches come only from the command line. Each one the file holds is named in a line
    with the flag that would set it (a recipe's own run dir was dropped without a word), unless given."""
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"steps": 801, "log": {"run_dir": "runs/demo", "overwrite": True, "every": 3},
                             "checkpoint": {"resume": "auto", "dir": "runs/demo/checkpoints", "every": 5}}))
    capsys.readouterr()
    args = launch.parse(GRPOArgs, ["--config", str(f), "--steps", "2"], "")
    default = GRPOArgs()
    assert (args.steps, args.log.every, args.checkpoint.every) == (2, 3, 5)  # the recipe comes along
    assert (args.log.run_dir, args.log.overwrite, args.checkpoint.resume, args.checkpoint.dir) == (
        default.log.run_dir, False, "", "")
    said = capsys.readouterr().err.splitlines()
    assert said == [f"--config {f}: {key} is not taken from a file (a run's own switches come from the command line "
                    f"only): give {flag} to use it" for key, flag in (
                        ("checkpoint.dir='runs/demo/checkpoints'", "--checkpoint.dir runs/demo/checkpoints"),
                        ("checkpoint.resume='auto'", "--checkpoint.resume auto"),
                        ("log.overwrite=True", "--log.overwrite"),
                        ("log.run_dir='runs/demo'", "--log.run-dir runs/demo"))]
    args = launch.parse(GRPOArgs, ["--config", str(f), "--log.run-dir", "x", "--log.overwrite"], "")
    assert (args.log.run_dir, args.log.overwrite) == ("x", True)  # given on the command line, they count
    assert [line.split(": ")[1].split("=")[0] for line in capsys.readouterr().err.splitlines()] == [
        "checkpoint.dir", "checkpoint.resume"]  # and those given are not named
    launch.parse(GRPOArgs, ["--config", str(f), "--log.run-dir", "x", "--log.no-overwrite", "--checkpoint.resume",
                            "auto", "--checkpoint.dir", "d"], "")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MINIRL_REHEARSAL_CHILD", "1")  # `--dry-run --rehearse`: its child parses the flags again
    launch.parse(GRPOArgs, ["--config", str(f)], "")
    assert capsys.readouterr().err == ""


def test_a_path_that_starts_with_a_tilde_is_under_the_home_folder(tmp_path, monkeypatch):
    """`--log.run-dir=~/runs/x` (the shell leaves a ~ after `=`) and a config file's `~/...` are the home
    folder's, as TRL's output_dir is; they made a folder named `~` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "r.yaml").write_text("model:\n  path: ~/models/m\ntask:\n  eval_path: ~/test.jsonl\n")
    args = launch.parse(GRPOArgs, ["--config=~/r.yaml", "--log.run-dir=~/runs/x", "--task.path=~/train.jsonl",
                                   "--task.reward=~/rewards.py:f", "--checkpoint.dir", "~"], "")
    home = str(tmp_path)
    assert (args.config, args.model.path, args.task.eval_path, args.log.run_dir, args.task.path, args.task.reward,
            args.checkpoint.dir) == (f"{home}/r.yaml", f"{home}/models/m", f"{home}/test.jsonl", f"{home}/runs/x",
                                     f"{home}/train.jsonl", [f"{home}/rewards.py:f"], home)
    args = launch.parse(GRPOArgs, ["--log.run-dir", "runs/a~b", "--log.wandb-project", "p~"], "")
    assert (args.log.run_dir, args.log.wandb_project) == ("runs/a~b", "p~")  # only a leading ~ is the home
    from minirl.tools import export, plot  # the tools' paths too, quoted or after `=`
    with pytest.raises(ConfigError, match=re.escape(f"CHECKPOINT='{home}/nope' is not a folder")):
        export.main(["~/nope", "~/out"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n'
                                                    '{"step": 1, "reward_mean": 0.7}\n')
    plot.main(["~/run", "--out=~/curve.png"])
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_a_config_file_never_carries_the_runs_own_switches_in_the_flags_own_spelling_either(tmp_path):
    """A YAML written like the flags (`log: {run-dir: X}`, `checkpoint: {resume: auto}`) is read as the
    same flags: the run's own switches stay the command line's (they were taken from the dashed
    spelling), and one flag given in both spellings is refused naming both."""
    f = tmp_path / "c.yaml"
    f.write_text("log:\n  run-dir: runs/other\n  overwrite: true\n  eval-every: 7\n"
                 "checkpoint:\n  resume: auto\n  dir: elsewhere\n")
    args = launch.parse(GRPOArgs, ["--config", str(f)], "")
    default = GRPOArgs()
    assert args.log.eval_every == 7  # the recipe comes along
    assert (args.log.run_dir, args.log.overwrite, args.checkpoint.resume, args.checkpoint.dir) == (
        default.log.run_dir, False, "", "")
    f.write_text("rl:\n  lr: 1.0e-5\n  lr-warmup-steps: 3\n  lr_warmup_steps: 4\n")
    with pytest.raises(ConfigError, match=r"rl\.lr_warmup_steps is given twice \(also as rl\.lr-warmup-steps\)"):
        launch.parse(GRPOArgs, ["--config", str(f)], "")


@pytest.mark.parametrize("text, says", [
    ("steps: abc\n", "steps='abc' is not an integer"),
    ("steps: 2.5\n", "steps=2.5 is not an integer"),
    ("rl:\n  lr: [1]\n", "rl.lr=[1] is not a number"),
    ("rl:\n  lr: true\n", "rl.lr=True is not a number"),  # YAML's true is a bool, never 1
    ("steps: yes\n", "steps=True is not an integer"),
    ("log:\n  tensorboard: 1\n", "log.tensorboard=1 is not true or false"),
    ("rl:\n  lr_schedule: linear\n", "rl.lr_schedule='linear' is not one of 'constant', 'cosine'"),
    ("a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\n", "aliases"),
])
def test_config_values_are_checked_as_the_flags_are(tmp_path, text, says):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(says)):
        launch.parse(GRPOArgs, ["--config", str(f)], "")


def test_yaml_numbers_in_1_1_form_are_numbers(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("steps: 7\nrl:\n  lr: 1e-4\n  clip_eps: 2e-1\n")  # PyYAML reads 1e-4 as a string
    args = launch.parse(GRPOArgs, ["--config", str(f)], "")
    assert (args.steps, args.rl.lr, args.rl.clip_eps) == (7, 1e-4, 0.2) and isinstance(args.rl.lr, float)


def test_a_yaml_bomb_exits_2_within_seconds(tmp_path):
    """A 339-byte billion-laughs file under a real flag (nine levels of nine aliases): it used to hang
    with growing memory; it is refused at once, before anything is expanded."""
    import time
    levels = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    f = tmp_path / "bomb.yaml"
    f.write_text("task:\n  path: [" + ", ".join(levels) + "]\n")
    t0 = time.time()
    p = run([script("minirl-grpo"), "--config", str(f), "--log.run-dir", str(tmp_path / "r")], timeout=60)
    assert p.returncode == 2 and "aliases" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert time.time() - t0 < 30


def test_console_scripts_exit_0_on_success_and_2_on_a_bad_flag(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n')
    errors = [([script("minirl-grpo"), "--rl.clip-eps", "-1"], "minirl.grpo: error: --rl.clip-eps"),
              ([script("minirl-ppo"), "--grid.gpu-placement", "colocated", "--async-rl.min-groups-for-"
                "streaming-train", "16", "--ppo.lr", "0"], "minirl.ppo: error: --ppo.lr"),
              ([script("minirl-eval"), "--checkpoint", str(tmp_path / "none")], "minirl.eval: error:"),
              ([script("minirl-export"), str(tmp_path / "none"), str(tmp_path / "out")], "minirl.export: error:")]
    # together: each command is mostly one core importing torch
    ok, ppo, unknown, plot = (start(cmd, timeout=120) for cmd in (
        [script("minirl-grpo"), "--dry-run"], [script("minirl-ppo"), "--dry-run", "--dry-run-world-size", "2"],
        [script("minirl-grpo"), "--rl.no-such-flag", "1"], [script("minirl-plot"), str(tmp_path)]))
    failed = [start(cmd, timeout=120) for cmd, _ in errors]
    ok = ok()
    assert ok.returncode == 0 and "rank 0: role=both" in ok.stdout and "{" not in ok.stdout.splitlines()[-1]
    assert ppo().returncode == 0
    for (cmd, says), result in zip(errors, failed):
        p = result()
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr[-1500:])
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert unknown().returncode == 2
    assert plot().returncode == 0


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    d = tmp_path_factory.mktemp("finished")
    p = run([script("minirl-grpo"), "--steps", "2", "--log.eval-every", "2", "--checkpoint.every", "2",
             "--rl.batch-per-replica", "16", "--rl.group-size", "4", "--log.run-dir", str(d)])
    assert p.returncode == 0 and (d / "final" / "README.md").exists()
    return d


def steps(d):
    return [{k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s", "memory"))}
            for r in map(json.loads, open(d / "metrics.jsonl"))]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_runs_config_json_reruns_that_run(finished, tmp_path):
    p = run([script("minirl-grpo"), "--config", str(finished / "config.json"), "--log.run-dir", str(tmp_path)])
    assert p.returncode == 0
    assert steps(finished) == steps(tmp_path)


@pytest.mark.vllm
@pytest.mark.slow
def test_eval_and_export_of_a_finished_run(finished, tmp_path):
    """minirl-eval scores final/ and the last checkpoint alike, with the number the run itself
    logged for its last evaluation, and prints the completions that evaluation wrote to samples.jsonl;
    minirl-export writes that checkpoint as final/ was written. Each export carries the run's config
    (minirl_config.json), which minirl-eval reads for the run's task. The checkpoint is scored by a TRL
    function that scores every other prompt (None for the rest): on those 64 (it said "on 128")."""
    last = [r["eval_accuracy"] for r in map(json.loads, open(finished / "metrics.jsonl")) if "eval_accuracy" in r][-1]
    logged = [json.loads(line) for line in open(finished / "samples.jsonl")][-128:]
    right = [float(r["completion"] == r["answer"] and not r["clipped"]) for r in logged]
    (tmp_path / "half.py").write_text("def half(completions, answer, **kw):\n"
                                      "    return [float(c == a) if i % 2 == 0 else None\n"
                                      "            for i, (c, a) in enumerate(zip(completions, answer))]\n")
    ckpt = finished / "checkpoints" / "step_00000002"
    lines = []
    for flags, half in ((["--model.path", str(finished / "final")], False),
                        (["--checkpoint", str(ckpt), "--task.reward", f"{tmp_path}/half.py:half"], True)):
        p = run([script("minirl-eval"), *flags])
        assert p.returncode == 0
        lines.append(p.stdout.strip().splitlines()[-1])
        shown = [line for line in p.stdout.splitlines() if line.startswith("  sample: ")]
        expected = [f"  sample: {r['prompt']!r} -> {r['completion']!r} (answer {r['answer']!r}, reward "
                    f"{0 if half and i % 2 else r['reward']:.3g}" for i, r in enumerate(logged[:4])]
        assert len(shown) == 4 and all(line.startswith(e) for line, e in zip(shown, expected)), (shown, expected)
        noise = [line for line in (p.stdout + p.stderr).splitlines() if line.strip() and "Warning" not in line
                 and not line.startswith(("exported", "eval_accuracy", "  sample: "))]
        assert len(noise) <= 3, noise  # the engine's own lines go to its log file (about 22 lines before)
    assert lines[0] == f"eval_accuracy {last:.4f} on 128 prompts"
    assert lines[1] == f"eval_accuracy {sum(right[::2]) / 64:.4f} on 64 prompts"  # the prompts it scored
    p = run([script("minirl-export"), str(ckpt), str(tmp_path / "out")])
    assert p.returncode == 0 and p.stdout.splitlines() == [  # a line before the minutes a large model takes
        f"exporting {ckpt}: loading the model and its trained policy, then writing {tmp_path / 'out'} ...",
        f"exported {ckpt} to {tmp_path / 'out'}"], p.stdout
    a, b = load_file(finished / "final" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert oct(os.stat(tmp_path / "out" / "model.safetensors").st_mode & 0o777) == "0o644"
    card = (tmp_path / "out" / "README.md").read_text()  # the model card the README promises
    assert "step_00000002 (exported)" in card and "| steps | 2 |" in card
    assert card.startswith("---\n") and str(tmp_path) not in card  # a hub metadata header, no absolute path
    final = (finished / "final" / "README.md").read_text()  # the run's own card names its loop and task
    assert "| algorithm | GRPO |" in final and "| task | count |" in final and "| steps | 2 |" in final
    config = json.loads((finished / "config.json").read_text())
    assert json.loads((finished / "final" / "minirl_config.json").read_text()) == config
    assert json.loads((tmp_path / "out" / "minirl_config.json").read_text()) == config


def test_a_model_card_names_a_hub_base_model_in_its_metadata_and_a_folder_by_its_name(tmp_path, monkeypatch):
    """The hub links a card's `base_model` to that model's page: a hub name goes there, a local folder (even one
    that looks like org/name) only by its name in the table, never its path."""
    from minirl.run import model_card
    monkeypatch.chdir(tmp_path)
    hub = model_card("m", "Qwen/Qwen2.5-0.5B-Instruct", {})
    assert "base_model: Qwen/Qwen2.5-0.5B-Instruct" in hub and "| base model | Qwen/Qwen2.5-0.5B-Instruct |" in hub
    (tmp_path / "models" / "smollm2").mkdir(parents=True)
    for folder in ("models/smollm2", str(tmp_path / "models" / "smollm2")):
        card = model_card("m", folder, {})
        assert "base_model" not in card and "| base model | smollm2 |" in card and str(tmp_path) not in card


def test_export_overwrites_only_a_folder_an_export_wrote(tmp_path):
    """--overwrite replaces an earlier export (its minirl model card, config.json, weights) and nothing
    else: a model folder of one's own, with a config.json, JSON and text files and even weights, is not
    one and is refused before anything is deleted."""
    from minirl.run import model_card
    from minirl.tools.export import check_out
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name in ("config.json", "tokenizer.json", "notes.txt", "model.safetensors"):
        (theirs / name).write_text("{}")
    with pytest.raises(ConfigError, match="does not hold an export .*no minirl model card"):
        check_out(str(theirs), str(ckpt), overwrite=True)
    (theirs / "README.md").write_text("# my model\n")
    with pytest.raises(ConfigError, match="does not hold an export"):
        check_out(str(theirs), str(ckpt), overwrite=True)
    (theirs / "README.md").write_text(model_card("an earlier export", "tiny", {"steps": 1}))
    check_out(str(theirs), str(ckpt), overwrite=True)  # an earlier export: may be replaced
    (theirs / "train.py").write_text("# mine")  # a file no export writes, put beside one: refused, not deleted
    with pytest.raises(ConfigError, match=r"does not hold an export \(it has \['train.py'\]\)"):
        check_out(str(theirs), str(ckpt), overwrite=True)
    (theirs / "train.py").unlink()
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(ConfigError, match=r"OUT=.*a_file' is a file; give a folder"):
        check_out(str(tmp_path / "a_file"), str(ckpt), overwrite=True)
    assert sorted(os.listdir(theirs)) == ["README.md", "config.json", "model.safetensors", "notes.txt",
                                          "tokenizer.json"]


@pytest.mark.vllm
@pytest.mark.slow
def test_export_and_eval_of_what_is_no_checkpoint_say_what_it_is(finished, tmp_path):
    """A run directory, its final/ export or a missing folder given as the checkpoint: one line saying
    what it is and what to give (it said "partial", or advised --model-path)."""
    from minirl.tools.export import check_checkpoint
    newest = finished / "checkpoints" / "step_00000002"
    for given, says in [(finished, f"is a run directory; give one of its checkpoints (the newest is {newest}), or "
                                    f"use its exported policy: --model.path {finished / 'final'}"),
                        (finished / "final", "is not a training checkpoint (no loop_state.json); give <run dir>/"
                                             "checkpoints/step_N, or a Hugging Face folder as --model.path"),
                        (tmp_path / "none", "is not a folder")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            check_checkpoint(str(given), "--checkpoint")
    check_checkpoint(str(newest), "--checkpoint")


@pytest.mark.vllm
@pytest.mark.slow
def test_export_never_deletes_what_it_did_not_write(finished, tmp_path):
    """OUT may be new or empty, or with --overwrite an earlier export; a folder of one's own files, the
    run's own directory, the current directory and `/` are refused with one line, before any load."""
    ckpt = str(finished / "checkpoints" / "step_00000002")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for out, flags, says in [(mine, [], "is not empty"), (mine, ["--overwrite"], "does not hold an export"),
                             (finished, [], "holds the checkpoint or its run"), (".", [], "the current directory"),
                             ("/", ["--overwrite"], "the current directory")]:
        p = run([script("minirl-export"), ckpt, str(out), *flags], timeout=120)
        assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, (out, p.stderr)
    assert os.listdir(mine) == ["notes.txt"] and (finished / "metrics.jsonl").exists()
    out = tmp_path / "out"
    assert run([script("minirl-export"), ckpt, str(out)], timeout=120).returncode == 0
    assert run([script("minirl-export"), ckpt, str(out)], timeout=120).returncode == 2  # an export, but not told
    assert run([script("minirl-export"), ckpt, str(out), "--overwrite"], timeout=120).returncode == 0
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize("loop", ["grpo", "ppo"])
def test_help_describes_the_command_for_users_without_rule_ids(loop, capsys):
    """--help opens with the command's one-line description and names no rule of docs/invariants.md."""
    import re
    from minirl.config_grpo import GRPOArgs
    from minirl.config_ppo import PPOArgs
    cls = {"grpo": GRPOArgs, "ppo": PPOArgs}[loop]
    with pytest.raises(SystemExit):
        launch.parse(cls, ["--help"], inspect.cleandoc(cls.__doc__))
    out = capsys.readouterr().out
    assert cls.__doc__.splitlines()[0] in out
    assert not re.findall(r"\b[BSX]\d{1,2}\b|B_r\b", out), re.findall(r".{30}\b[BSX]\d{1,2}\b.{10}", out)


def test_output_into_a_closed_pipe_is_no_lost_peer_and_help_names_the_command_as_it_was_run(tmp_path):
    """`python -m minirl.grpo --help | head`: the help into a pipe its reader has closed was "this rank lost a
    peer: Broken pipe", exit 4 (Python's BrokenPipeError taken for gloo's), and so was a run whose `tee` died;
    the usage line named the module's file (`usage: /path/to/minirl/grpo.py`) where `python -m minirl.grpo`
    was typed."""
    import subprocess
    r, w = os.pipe()
    os.close(r)  # no reader: the first write fails with EPIPE
    try:
        said = [subprocess.run([sys.executable, "-m", "minirl.grpo", *flags], stdout=w, stderr=subprocess.PIPE,
                               text=True, timeout=300) for flags in (["--help"], ["--log.run-dir", str(tmp_path)])]
    finally:
        os.close(w)
    assert (said[0].returncode, said[0].stderr) == (1, "")  # Python's own convention for EPIPE, and quiet
    assert (said[1].returncode, said[1].stderr) == (1, "minirl.grpo: stopped: its output goes to a pipe whose "
                                                       "reader has closed it (Broken pipe)\n")
    p = run([sys.executable, "-m", "minirl.grpo", "--help"], timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("usage: python -m minirl.grpo [-h]"), p.stdout[:80]
    p = run([script("minirl-ppo"), "--help"], timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("usage: minirl-ppo [-h]"), p.stdout[:80]


@pytest.mark.parametrize("loop", ["grpo", "ppo"])
def test_each_flags_help_is_one_paragraph_wrapped_to_the_terminal(loop, capsys, monkeypatch):
    """In an 80-column terminal every line of a flag's help but its last is filled: tyro kept the line breaks
    of each source docstring (its lines joined before they were dedented), so `--task.path` alone had a line
    of 33 characters ("array, .parquet or .arrow file of")."""
    from minirl.config_grpo import GRPOArgs
    from minirl.config_ppo import PPOArgs
    cls = {"grpo": GRPOArgs, "ppo": PPOArgs}[loop]
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        launch.parse(cls, ["--help"], inspect.cleandoc(cls.__doc__))
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {os.path.basename(sys.argv[0])} [-h]")  # not run as python -m minirl.*: argv[0]
    entries = [[]]  # one per flag: the lines of its help, indented under its name
    for line in out.splitlines():
        if re.match(r"[│ ] {7}\S", line):  # the panel's edge is a space when the output is no terminal
            entries[-1].append(line.strip("│ "))
        else:  # a flag's name, a panel's edge
            entries.append([])
    cut = [line for lines in entries for line in lines[:-1] if len(line) < 40]
    assert sum(map(bool, entries)) > 50 and not cut, cut


@pytest.mark.parametrize("argv, says", [
    (["--learning_rate", "1e-5"], "--learning_rate is not a flag of this command (see --help); did you mean --rl.lr?"),
    (["--num-generations=4"], "--num-generations is not a flag of this command (see --help); did you mean "
                              "--rl.group-size?"),
    (["--rl.beta", "0.1"], "did you mean --rl.kl-coef"),
    # open-r1's GRPO recipes (TRL's GRPOConfig beside open-r1's script and model arguments)
    (["--torch_dtype", "bfloat16"], "did you mean --model.dtype?"),
    (["--dataset_prompt_column", "problem"], "did you mean --task.prompt-key?"),
    (["--warmup_ratio", "0.1"], "did you mean --rl.lr-warmup-steps?"),
    (["--log_completions"], "did you mean --log.train-samples?"),
    # verl's Hydra overrides, all at once (a value after a flag is the flag's, whatever it holds)
    (["--steps", "2", "actor_rollout_ref.actor.optim.lr=1e-6", "--log.run-dir", "a=b", "+data.train_batch_size=4"],
     "minirl takes flags (--name value), not Hydra's key=value: 2 keys are not flags of this command (see --help): "
     "actor_rollout_ref.actor.optim.lr (did you mean --rl.lr?), data.train_batch_size (TRL's and verl's names"),
    (["--log.run-dir", "a=b", "--learning_rate", "1"], "--learning_rate is not a flag of this command (see --help); "
                                                     "did you mean"),
    (["--task.reward", "a:f", "b:g", "--steps", "2"], "--task.reward takes one function; repeat the flag for each: "
                                                      "--task.reward a:f --task.reward b:g"),
    (["--task.reward=a:f", "b:g"], "repeat the flag for each: --task.reward a:f --task.reward b:g"),
])
def test_trl_and_verl_names_get_minirls_flag(argv, says):
    from minirl.config_grpo import GRPOArgs
    with pytest.raises(ConfigError, match=re.escape(says)):
        launch.parse(GRPOArgs, argv, "")


def test_a_config_key_with_no_name_to_give_gets_no_pointer_to_the_names(tmp_path):
    from minirl.config_grpo import GRPOArgs
    f = tmp_path / "c.yaml"
    f.write_text("use_vllm: true\n")
    with pytest.raises(ConfigError) as e:
        launch.parse(GRPOArgs, ["--config", str(f)], "")
    assert str(e.value) == "--config: use_vllm is not a flag of this command (see --help)"


def test_a_reward_given_last_is_one_function_not_a_list():
    from minirl.config_grpo import GRPOArgs
    for argv in (["--steps", "2", "--task.reward", "m:f"], ["--task.reward=m:f"]):
        assert launch.parse(GRPOArgs, argv, "").task.reward == ["m:f"]


def test_every_flag_a_trl_or_verl_name_is_pointed_to_is_one_of_that_commands():
    from minirl.config_grpo import GRPOArgs
    from minirl.config_ppo import PPOArgs
    from minirl.flags import CRITIC, ELSEWHERE, _flags, elsewhere
    for cls in (GRPOArgs, PPOArgs):
        names = [*ELSEWHERE, *(f"critic.{name}" for name in CRITIC), "custom_reward_function.path"]
        pointed = {f for name in names for f in re.findall(r"--([\w.-]+)", elsewhere(name, cls))}
        assert pointed and pointed <= _flags(cls), sorted(pointed - _flags(cls))


def test_verls_critic_keys_point_to_the_critics_flags_in_ppo_and_nowhere_in_grpo(tmp_path):
    """`critic.optim.lr` was pointed to the policy's --ppo.lr by its last name (and to --rl.lr in GRPO, which has
    no critic)."""
    from minirl.config_grpo import GRPOArgs
    from minirl.config_ppo import PPOArgs
    f = tmp_path / "c.yaml"
    f.write_text("critic:\n  optim:\n    lr: 1.0e-5\n    weight_decay: 0.01\n  ppo_epochs: 2\n")
    with pytest.raises(ConfigError, match=re.escape("critic.optim.lr (did you mean --ppo.value-lr?), "
                                                    "critic.optim.weight_decay (did you mean --ppo.weight-decay?), "
                                                    "critic.ppo_epochs (did you mean --ppo.critic-ppo-epochs?)")):
        launch.parse(PPOArgs, ["--config", str(f)], "")
    with pytest.raises(ConfigError) as e:
        launch.parse(GRPOArgs, ["--config", str(f)], "")
    assert str(e.value).endswith("(see --help): critic.optim.lr, critic.optim.weight_decay, critic.ppo_epochs")


@pytest.mark.parametrize("text, says", [
    ("rl.lr: 1e-4\n", "rl.lr is not a flag of this command (see --help); keys nest: write rl: {lr: ...}"),
    ("rl:\n  learning_rate: 1e-4\n", "rl.learning_rate is not a flag of this command (see --help); did you mean "
                                     "--rl.lr"),
    # TRL's config files are flat: a key minirl has under another group is named there
    ("temperature: 0.7\n", "temperature is not a flag of this command (see --help); did you mean "
                           "--rollout.temperature"),
    ("max_grad_norm: 1.0\n", "did you mean --rl.max-grad-norm"),
    ("chat_template_kwargs: {}\n", "did you mean --task.chat-template-kwargs"),
    ("rl:\n  seed: 1\n", "rl.seed is not a flag of this command (see --help); did you mean --seed?"),
    ("every: 5\n", "did you mean --checkpoint.every or --log.every?"),
    # verl's reward function is a path and a name: one flag here (by its last name, `path` was --model.path)
    ("custom_reward_function:\n  path: my.py\n  name: compute_score\n", "custom_reward_function.path (did you mean "
     "--task.reward path/to/file.py:function?), custom_reward_function.name (did you mean --task.reward"),
    # verl's keys that mean something else than minirl's flag of their last name get no pointer (they got
    # --model.path for the reward model's path, --rollout.temperature for the validation's, --task.name for vllm)
    ("reward_model:\n  model:\n    path: rm\nactor_rollout_ref:\n  rollout:\n    val_kwargs:\n      temperature: 0\n"
     "    name: vllm\ntrainer:\n  nnodes: 1\n", "(see --help): reward_model.model.path, "
     "actor_rollout_ref.rollout.val_kwargs.temperature, actor_rollout_ref.rollout.name, trainer.nnodes"),
    # every key a file cannot take at once: a TRL file's, and each one in a group minirl lacks (verl's)
    ("learning_rate: 1e-6\nbf16: true\nuse_vllm: true\n", "--config: 3 keys are not flags of this command (see "
     "--help): learning_rate (did you mean --rl.lr?), bf16 (did you mean --model.dtype bfloat16?), use_vllm (TRL's"),
    ("actor_rollout_ref:\n  model:\n    path: m\n  actor:\n    optim:\n      lr: 1.0e-6\n    use_kl_loss: true\n",
     "--config: 3 keys are not flags of this command (see --help): actor_rollout_ref.model.path (did you mean "
     "--model.path?), actor_rollout_ref.actor.optim.lr (did you mean --rl.lr?), actor_rollout_ref.actor.use_kl_loss ("),
])
def test_a_config_file_with_a_dotted_or_trl_key_says_what_to_write(tmp_path, text, says):
    from minirl.config_grpo import GRPOArgs
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(says)):
        launch.parse(GRPOArgs, ["--config", str(f)], "")


@pytest.mark.parametrize("inside", ["step_00000001/hf", "hf", "step_00000002"])
def test_an_export_inside_the_checkpoint_folder_is_refused(tmp_path, inside):
    """A folder a keep-last-K prune or --log.overwrite would remove, the export with it."""
    from minirl.tools.export import check_out
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    with pytest.raises(ConfigError, match="is inside the checkpoint folder .* a prune or --log.overwrite removes it"):
        check_out(str(ckpt.parent / inside), str(ckpt), overwrite=False)
    check_out(str(tmp_path / "run" / "hf"), str(ckpt), overwrite=False)  # beside it: fine


@pytest.mark.parametrize("name, text", [("twice.yaml", "rl:\n  lr: 1e-4\n  lr: 1e-5\n"),
                                        ("twice.json", '{"rl": {"lr": 1e-4, "lr": 1e-5}}'),
                                        ("after.yaml", "rl:\n  clip_eps: 0.1\n  lr: 1e-4\n  lr: 1e-5\n")])
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=r"the key 'lr' is given twice; give it once"):
        launch.parse(GRPOArgs, ["--config", str(tmp_path / name)], "")


def test_a_config_file_over_64_kib_is_refused_before_it_is_read(tmp_path):
    """A 600 KB flat list (no nesting, no aliases) kept PyYAML busy for 41 s before its type was refused."""
    (tmp_path / "long.yaml").write_text("task:\n  reward: [" + ", ".join(["x"] * 200_000) + "]\n")
    with pytest.raises(ConfigError, match=r"is over 64 KiB; a config file holds flags"):
        launch.parse(GRPOArgs, ["--config", str(tmp_path / "long.yaml")], "")


def test_a_deeply_nested_config_file_is_refused_before_yaml_scans_it(tmp_path):
    """Nested flow sequences (under the size cap, no aliases: 600 KB kept PyYAML's scanner busy for
    minutes); the depth is counted first, in one pass."""
    import time
    f = tmp_path / "deep.yaml"
    f.write_text("rl: " + "[" * 30_000 + "]" * 30_000 + "\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"nests \[ or \{ more than 32 deep"):
        launch.parse(GRPOArgs, ["--config", str(f)], "")
    assert time.perf_counter() - t0 < 5  # a guard against a hang, not a benchmark (it takes ~0.1 s)


# ---- what flags.py's mutation run asked for: each bound at its edge, each value type both ways ----

def test_a_config_file_of_exactly_64_kib_and_32_levels_is_read(tmp_path):
    at_size = tmp_path / "full.yaml"
    head = "steps: 3\n#"
    at_size.write_text(head + "x" * (64 * 1024 - len(head) - 1) + "\n")
    assert os.path.getsize(at_size) == 64 * 1024 and launch.parse(GRPOArgs, ["--config", str(at_size)], "").steps == 3
    deep = tmp_path / "deep.yaml"
    deep.write_text("task:\n  reward: " + "[" * 31 + "[]" + "]" * 31 + "\n")  # 32 deep, with the closing ones counted down
    with pytest.raises(ConfigError, match=r"task\.reward="):  # read, then refused as a value, not as too deep
        launch.parse(GRPOArgs, ["--config", str(deep)], "")


@pytest.mark.parametrize("text, ok", [
    ('{"task": {"reward": ["m:f", "n:g"]}}', True), ('{"task": {"reward": {"m": "f"}}}', False),
    ('{"task": {"reward_weights": [1, 0.5]}}', True), ('{"task": {"reward_weights": [true]}}', False),
    ('{"rollout": {"enforce_eager": null}}', True), ('{"rollout": {"enforce_eager": true}}', True),
    ('{"rollout": {"enforce_eager": 1}}', False), ('{"steps": 2.5}', False), ('{"steps": "3"}', True),
    ('{"rl": {"lr": 2}}', True), ('{"task": {"path": 3}}', False), ('{"task": {"path": "p.jsonl"}}', True),
    ('{"dry_run_device": null}', True), ('{"model": {"path": null}}', False)])
def test_each_config_value_is_taken_or_refused_as_its_flags_type(tmp_path, text, ok):
    f = tmp_path / "c.json"
    f.write_text(text)
    if ok:
        launch.parse(GRPOArgs, ["--config", str(f)], "")
    else:
        with pytest.raises(ConfigError, match=r"--config: .* is not "):
            launch.parse(GRPOArgs, ["--config", str(f)], "")


def test_a_list_flags_one_item_may_be_written_bare_in_a_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("task:\n  reward: m:f\n  reward_weights: 0.5\n")  # as --task.reward m:f --task.reward-weights 0.5
    a = launch.parse(GRPOArgs, ["--config", str(f)], "")
    assert (a.task.reward, a.task.reward_weights) == (["m:f"], [0.5])


def test_config_may_be_the_last_flag_and_a_key_given_once_is_taken(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("steps: 4\nseed: 4\n")
    assert launch.parse(GRPOArgs, ["--seed", "1", "--config", str(f)], "").steps == 4
    assert launch.parse(GRPOArgs, [f"--config={f}"], "").seed == 4
    with pytest.raises(ConfigError, match=r"--config='' is not a file"):  # a path forgotten: said, not an IndexError
        launch.parse(GRPOArgs, ["--config"], "")
    (tmp_path / "other.yaml").write_text("steps: 9\n")  # two files: the first was read and the last recorded
    for argv in (["--config", str(f), "--config", str(tmp_path / "other.yaml")], [f"--config={f}", "--config=x"]):
        with pytest.raises(ConfigError, match=r"^--config is given more than once; give one file"):
            launch.parse(GRPOArgs, argv, "")


def test_minirls_own_flags_and_values_spelled_like_trls_names_are_taken():
    """A flag of minirl's whose last part is a TRL name, and a value that is one, are not read as TRL's flags."""
    args = launch.parse(GRPOArgs, ["--rl.max-grad-norm", "0.5", "--rl.loss-agg-mode", "seq-mean-token-mean",
                                   "--log.run-dir", "beta"], "")
    assert (args.rl.max_grad_norm, args.rl.loss_agg_mode, args.log.run_dir) == (0.5, "seq-mean-token-mean", "beta")


def test_without_an_argv_the_command_line_is_parsed(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["minirl-grpo", "--steps", "3", f"--config={tmp_path / 'a=b.yaml'}"])
    (tmp_path / "a=b.yaml").write_text("seed: 5\n")  # a path with an `=` in it, after --config=
    args = launch.parse(GRPOArgs, None, "")
    assert (args.steps, args.seed, args.config) == (3, 5, str(tmp_path / "a=b.yaml"))


def test_a_config_key_is_refused_or_skipped_by_what_it_is_and_which_command_reads_it():
    """Strict (the training commands): a group given a value, a value given a group and a key nested too deep
    are each named. Lenient (minirl-eval reading a run's config.json): keys it lacks are skipped, and so is
    a group where it has a value (a run's `checkpoint` group; eval's --checkpoint is a folder)."""
    from minirl.flags import fill
    from minirl.tools.eval import EvalArgs
    with pytest.raises(ConfigError, match=r"--config: rl must be a mapping"):
        fill(GRPOArgs(), {"rl": 3}, "")
    with pytest.raises(ConfigError, match=r"--config: steps=\{'a': 1\} is not an integer"):
        fill(GRPOArgs(), {"steps": {"a": 1}}, "")
    with pytest.raises(ConfigError, match=r"log\.x\.y is not a flag .* keys nest: write log: \{x\.y: \.\.\.\}"):
        fill(GRPOArgs(), {"log.x.y": 1}, "")
    run = GRPOArgs(seed=7).to_dict()
    run["model"]["path"] = "runs/demo/final"
    got = fill(EvalArgs(), run, "", lenient=True)
    assert (got.seed, got.model.path, got.checkpoint) == (7, "runs/demo/final", "")
    with pytest.raises(ConfigError, match=r"--config: checkpoint must be|checkpoint=.* is not a string"):
        fill(EvalArgs(), {"checkpoint": {"every": 5}}, "")  # strict: said, not skipped


@pytest.mark.parametrize("name, text, says", [
    ("bad.json", '{"steps": }', "not valid JSON (JSONDecodeError: Expecting value: line 1 column 11 (char 10))"),
    ("bad.yaml", "steps: !!python/object:" + "x" * 300 + " {}\n",
     "not valid YAML (ConstructorError: " + ("could not determine a constructor for the tag "
                                            "'tag:yaml.org,2002:python/object:" + "x" * 300)[:160] + ")")])
def test_an_unreadable_config_file_is_named_with_the_parsers_first_line_cut_at_160_characters(tmp_path, name, text,
                                                                                               says):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as e:
        launch.parse(GRPOArgs, ["--config", str(tmp_path / name)], "")
    assert str(e.value).endswith(says)


@pytest.mark.parametrize("name, data, says", [
    ("latin1.yaml", "steps: 5 # caf\u00e9\n".encode("latin-1"), "is not UTF-8 text (invalid continuation byte at byte"),
    ("list.yaml", b"- steps\n- 5\n", ": expected a mapping of flags, got a list"),
    ("number.json", b"5", ": expected a mapping of flags, got a int")], ids=["latin-1", "a-list", "a-number"])
def test_a_config_file_must_be_utf8_text_holding_a_mapping(tmp_path, name, data, says):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ConfigError, match=re.escape(f"--config={str(tmp_path / name)!r}") + ".*" + re.escape(says)):
        launch.parse(GRPOArgs, ["--config", str(tmp_path / name)], "")


def test_a_config_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    """A JSON file that begins with a UTF-8 byte-order mark (Windows editors write one) was refused:
    "Unexpected UTF-8 BOM"; YAML read it already."""
    for name in ("bom.json", "bom.yaml"):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + (b'{"steps": 7}' if name.endswith("json") else b"steps: 7\n"))
        assert launch.parse(GRPOArgs, ["--config", str(tmp_path / name)], "").steps == 7


@pytest.mark.parametrize("error, code, line", [
    (None, 0, None),
    (ConfigError("--rl.lr=-1 must be > 0"), 2, "minirl.grpo: error: --rl.lr=-1 must be > 0"),
    ("reward", 1, "minirl.grpo: error: --task.reward m:f failed on 'abc': ValueError: no"),
    ("late", 2, "minirl.grpo: error: --task.reward m:f failed on 'abc': took over 60 s"),
    (KeyboardInterrupt(), 130, "minirl.grpo: interrupted (Ctrl-C)"),
    (SystemExit(143), 143, "minirl.grpo: stopped by SIGTERM"),
    ("stalled", 3, "minirl.grpo: stopped: 3 steps in a row were not finite"),
    (RuntimeError("[/gloo/pair.cc:534] Connection closed by peer [10.0.0.2]:41234"), 4,
     "minirl.grpo: error: this rank lost a peer: Connection closed by peer [10.0.0.2]:41234"),
], ids=["done", "flag", "reward", "reward-timeout", "ctrl-c", "sigterm", "stalled", "lost-peer"])
def test_each_way_a_command_ends_is_one_line_and_its_exit_code(monkeypatch, capsys, tmp_path, error, code, line):
    """launch.run: one line on stderr, no traceback, and the exit code the module docstring lists (a run that
    ends well: 0 and nothing on stderr); the process group is shut down on every way out. Under torchrun a
    failure's line is the worker's error file too (what torchrun's summary shows); a stop's is not (torchrun
    stops the other workers itself: their lines are no cause)."""
    from minirl import dist, rewards
    from minirl.accumulator import StalledError
    error = {"reward": rewards.RewardError("m:f", "'abc'", "ValueError: no"),
             "late": rewards.RewardTimeout("m:f", "'abc'", "took over 60 s"),
             "stalled": StalledError("3 steps in a row were not finite")}.get(error, error)
    ended = []
    monkeypatch.setattr(dist, "_here", {"rank": None, "store": None})
    monkeypatch.setattr(dist, "shutdown", lambda: ended.append("shutdown"))
    monkeypatch.setattr(launch, "leave", lambda c: ended.append(c))

    def main(argv):
        if error is not None:
            raise error

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(launch.time, "time", lambda: 1000.5)
    launch.run("minirl.grpo", main, [])
    assert ended == ["shutdown", code] and capsys.readouterr().err.splitlines() == ([line] if line else [])
    told = json.loads((tmp_path / "error.json").read_text()) if code not in (0, 130, 143) else {}
    assert told.get("message") == (None if code in (0, 130, 143) else line)
    assert (tmp_path / "error.json").exists() == bool(told)
    # torchrun's root cause is the earliest whole second, a tie to the lowest rank: a lost peer (another rank's
    # failure seen from here) comes a second after a failure of the same moment
    assert told.get("timestamp") == (None if not told else 1001 if code == 4 else 1000)


def test_torchruns_failure_summary_shows_the_ranks_one_line():
    """A bad flag combination under torchrun: a rank says it in one line, and torchrun's summary of the failure
    (the last lines of the launch) shows that line as the failed rank's `traceback`, where it pointed to torch's
    docs on how to record one (a rank torchrun stopped first is said to have had its SIGTERM)."""
    p = run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", "2",
             "-m", "minirl.ppo", "--grid.gpu-placement", "colocated", "--ppo.num-prompts-per-step", "4",
             "--async-rl.min-groups-for-streaming-train", "2"], timeout=300)
    line = ("minirl.ppo: error: PPO streaming needs separate generation ranks: use --grid.gpu-placement "
            "disaggregated, or full batch colocated with --async-rl.min-groups-for-streaming-train=4")
    assert p.returncode != 0 and p.stderr.count(line) >= 2, p.stderr[-3000:]  # a rank's own, and the summary's
    summary = p.stderr[p.stderr.index("minirl.ppo FAILED"):]  # torchrun may stop one rank before it says its line
    assert f"traceback : {line}" in summary and "To enable traceback" not in summary, summary


def test_any_other_error_keeps_its_traceback_and_still_shuts_the_group_down(monkeypatch, tmp_path):
    from minirl import dist
    ended = []
    monkeypatch.setattr(dist, "shutdown", lambda: ended.append("shutdown"))
    monkeypatch.setattr(launch, "leave", lambda c: ended.append(c))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # torchrun's summary: the first line
    monkeypatch.setattr(launch.time, "time", lambda: 1000.5)

    def main(argv):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(more on another line)")

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        launch.run("minirl.grpo", main, [])
    assert ended == ["shutdown"]
    told = json.loads((tmp_path / "error.json").read_text())
    assert told == {"message": "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", "timestamp": 1000}


def test_export_reads_the_model_from_the_checkpoints_run_or_asks_for_the_flag(tmp_path):
    """A checkpoint's model is its run's: <run dir>/config.json's model section; without one, say which
    file is missing and which flag names the model instead. --model.path moves the folder only: the run's
    dtype stays, so the export is written as the run's final/ was."""
    from minirl.tools.export import run_model_config
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    with pytest.raises(ConfigError, match=re.escape(f"{ckpt}: no {tmp_path / 'run' / 'config.json'} to say which "
                                                    "model it belongs to; pass --model.path")):
        run_model_config(str(ckpt))
    got = run_model_config(str(ckpt), "/models/moved")
    assert (got.path, got.dtype) == ("/models/moved", "float32")
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": {"path": "/models/mine", "dtype": "bfloat16"}}))
    got = run_model_config(str(ckpt))
    assert (got.path, got.dtype) == ("/models/mine", "bfloat16")
    got = run_model_config(str(ckpt), "/models/moved")
    assert (got.path, got.dtype) == ("/models/moved", "bfloat16")


@pytest.mark.parametrize("loop, world_size", [("ppo", "2"), ("grpo", None)])
def test_a_resume_is_checked_against_the_train_ranks_not_the_launchs(tmp_path, world, tiny_path, monkeypatch, loop,
                                                                     world_size):
    """The checkpoint a run's trainer wrote is the one to resume: PPO launched on 2 ranks, one of them
    generating, resumes its 1 train rank's; GRPO started without a launcher (no WORLD_SIZE) is one rank,
    which a batch of one group fits."""
    from minirl import checkpoint, models
    from minirl.config_ppo import PPOArgs
    kinds = ("policy", "value") if loop == "ppo" else ("policy",)
    built = {kind: models.sharded(tiny_path, kind, world, "float32") for kind in kinds}
    parts = {kind: (m, models.adamw(m, 1e-4, 0)) for kind, m in built.items()}
    state = {"loop": loop, **({"optimizer_steps": 1, "skipped": 0, "probe_done": True} if loop == "grpo" else {})}
    saved = checkpoint.save(str(tmp_path / "ckpt"), 1, parts, state, keep=1)
    if world_size:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    cls, sizes = (PPOArgs, []) if loop == "ppo" else (GRPOArgs, ["--rl.batch-per-replica", "8", "--rl.group-size", "8"])
    ready = launch.preflight(cls, [*sizes, "--steps", "2", "--log.eval-every", "0", "--checkpoint.resume", saved,
                                   "--log.run-dir", str(tmp_path / "run")], None)
    assert ready.resume == saved


@pytest.mark.parametrize("loop, claimer", [("ppo", 1), ("grpo", 0)])
def test_the_run_directory_is_claimed_by_train_rank_0_the_rank_that_writes_it(tmp_path, tiny_path, monkeypatch, loop,
                                                                              claimer):
    """PPO on 2 ranks, one generating: global rank 1 is train rank 0, which writes the logs and the checkpoints'
    identity, so it takes the run directory's lock and writes run.json; rank 0 leaves both alone (it waits for
    them: refit.share_claim). Colocated GRPO on 2 ranks: rank 0 trains, and claims."""
    from minirl.config_ppo import PPOArgs
    cls, sizes = (PPOArgs, []) if loop == "ppo" else (GRPOArgs, ["--rl.batch-per-replica", "8", "--rl.group-size", "4"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        d = tmp_path / f"run{rank}"
        ready = launch.preflight(cls, [*sizes, "--steps", "2", "--log.eval-every", "0", "--log.run-dir", str(d)], None)
        claimed = rank == claimer
        assert bool(ready.owner) == claimed and (d / ".lock").exists() == claimed
        assert launch.identity(str(d)) == (ready.owner if claimed else {})


def test_the_engines_context_is_the_prompt_budget_plus_the_completion_cap(tmp_path, tiny_path):
    """200 prompt tokens and 100 completion tokens do not fit the built-in model's 256 positions: refused
    before anything is built, naming both flags."""
    with pytest.raises(ConfigError, match=r"--rollout.max-prompt-tokens \+ --rollout.max-tokens = 300 tokens is "
                                          r"over the model's 256 positions"):
        launch.preflight(GRPOArgs, ["--rollout.max-prompt-tokens", "200", "--rollout.max-tokens", "100",
                                    "--log.run-dir", str(tmp_path)], None)


def test_a_model_the_cpu_engine_cannot_train_is_refused_before_anything_is_built_naming_its_flag(
        tmp_path, tiny_path, moe_paths, monkeypatch):
    """A mixture of experts: vLLM's CPU engine packs its experts once, at load, and a weight sync cannot replace
    them (`rollout.check_reloads`), so training one on a CPU is refused in one line by both commands, before the
    tokenizer, the task or the run directory; on CUDA it is not. A head size the CPU attention cannot run names
    --model.path for a model folder (it named --model.tiny.num-heads, the built-in model's flag)."""
    import shutil
    from minirl import models, rollout
    from minirl.config_ppo import PPOArgs
    monkeypatch.setattr(models, "load_tokenizer", lambda path: pytest.fail("the tokenizer was loaded"))
    for path in moe_paths.values():
        for cls, sizes in ((GRPOArgs, []), (PPOArgs, ["--grid.gpu-placement", "colocated",
                                                      "--async-rl.min-groups-for-streaming-train", "16"])):
            with pytest.raises(ConfigError, match=r"^--model.path is a mixture-of-experts model \(model\.layers\.0\.mlp"
                                                  r"\.experts\.gate_up_proj\): vLLM's CPU engine cannot reload"):
                launch.preflight(cls, [*sizes, "--model.path", path, "--log.run-dir", str(tmp_path / "run")], None)
        rollout.check_reloads(path, "cuda")
    rollout.check_reloads(tiny_path, "cpu")
    assert not os.path.exists(tmp_path / "run")
    wide = tmp_path / "wide"
    shutil.copytree(tiny_path, wide)
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(tiny_path)
    config.num_attention_heads = config.hidden_size // 16
    AutoModelForCausalLM.from_config(config).save_pretrained(wide)  # its weights of that shape too
    with pytest.raises(ConfigError, match=r"^--model.path: head_dim 16 "):
        launch.preflight(GRPOArgs, ["--model.path", str(wide), "--log.run-dir", str(tmp_path / "run")], None)
    with pytest.raises(ConfigError, match=r"^--model.tiny.num-heads: head_dim 16 "):
        launch.preflight(GRPOArgs, ["--model.tiny.num-heads", "8", "--log.run-dir", str(tmp_path / "run")], None)


def test_a_quantized_model_is_refused_for_training_by_both_commands_and_their_dry_runs_on_any_device(
        tmp_path, tiny_path, monkeypatch):
    """A quantized checkpoint serves and is not trained: the policy's load asked for its quantizer's kernels
    ("pip install gptqmodel" for AWQ, bitsandbytes for 4-bit) after the world was up, and with them installed the
    trainer would train its packed tensors. Both commands and their dry runs refuse it in one line before the
    tokenizer or the run directory, on a CPU and on CUDA; minirl-eval still scores one (test_models.py)."""
    import shutil
    from minirl import models, rollout
    from minirl.config_ppo import PPOArgs
    d = tmp_path / "awq"
    shutil.copytree(tiny_path, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq", "bits": 4}}))
    monkeypatch.setattr(models, "load_tokenizer", lambda path: pytest.fail("the tokenizer was loaded"))
    ppo = ["--grid.gpu-placement", "colocated", "--async-rl.min-groups-for-streaming-train", "16"]
    for cls, sizes in ((GRPOArgs, []), (PPOArgs, ppo)):
        for dry in ([], ["--dry-run"], ["--dry-run", "--dry-run-device", "cuda"]):
            with pytest.raises(ConfigError, match=r"^--model.path is a quantized model \(awq\): minirl trains"):
                launch.preflight(cls, [*sizes, *dry, "--model.path", str(d), "--log.run-dir", str(tmp_path / "run")],
                                 None)
    with pytest.raises(ConfigError, match="quantized model"):
        rollout.check_reloads(str(d), "cuda")
    assert not os.path.exists(tmp_path / "run")


def test_a_dry_run_prints_the_plan_builds_nothing_and_rehearses_only_when_asked(tmp_path, monkeypatch, capsys):
    """`--dry-run` is the tools' one door: the plan is printed and no run comes back; the rehearsal (its child
    process stood in for here) starts only under --rehearse, and only on rank 0."""
    from minirl.tools import rehearse
    rehearsed = []
    monkeypatch.setattr(rehearse, "run", lambda argv, loop: rehearsed.append((loop, argv)))
    monkeypatch.delenv("MINIRL_REHEARSAL_CHILD", raising=False)
    monkeypatch.delenv("RANK", raising=False)  # started without a launcher: rank 0
    flags = ["--dry-run", "--dry-run-device", "cuda", "--log.run-dir", str(tmp_path / "run")]
    assert launch.preflight(GRPOArgs, flags, None) is None
    assert rehearsed == [] and "plan: minirl.grpo" in capsys.readouterr().out and not os.path.exists(tmp_path / "run")
    assert launch.preflight(GRPOArgs, [*flags, "--rehearse"], None) is None
    assert rehearsed == [("grpo", [*flags, "--rehearse"])]  # the child gets this command's own flags
    monkeypatch.setenv("RANK", "1")
    assert launch.preflight(GRPOArgs, [*flags, "--rehearse"], None) is None and len(rehearsed) == 1


def test_rows_are_padded_with_the_tokenizers_pad_or_else_its_eos():
    """A tokenizer without a pad token (many base models) pads with EOS; one whose pad id is 0 keeps 0."""
    from types import SimpleNamespace
    tok = SimpleNamespace(pad_token_id=None, eos_token_id=7)
    assert launch.Ready(None, "", tok, None, None).pad_id == 7
    tok.pad_token_id = 0
    assert launch.Ready(None, "", tok, None, None).pad_id == 0


def test_what_a_checkpoint_argument_is_instead_is_said_from_its_files(tmp_path):
    """check_checkpoint reads only names: a run directory (by its metrics.jsonl or its checkpoints/) names its
    newest complete checkpoint or says it has none, and points at final/ only where there is one; a folder is a
    checkpoint by its loop_state.json or DCP's .metadata; a folder with neither gets the Hugging Face hint only
    where it holds a config.json."""
    from minirl.tools.export import check_checkpoint

    def says(folder):
        with pytest.raises(ConfigError) as e:
            check_checkpoint(str(folder), "CHECKPOINT")
        return str(e.value).split(" is ", 1)[1]

    logged, saved = tmp_path / "logged", tmp_path / "saved"
    logged.mkdir()
    (logged / "metrics.jsonl").write_text("")
    assert says(logged) == "a run directory; give one of its checkpoints (it has none)"
    newest = saved / "checkpoints" / "step_00000002"
    newest.mkdir(parents=True)
    (newest / "COMPLETE").write_text("2\n")
    (newest / "loop_state.json").write_text('{"steps_done": 2}')
    assert says(saved) == f"a run directory; give one of its checkpoints (the newest is {newest})"
    assert says(saved / "checkpoints") == ("a folder of checkpoints; give one of its checkpoints "
                                           f"(the newest is {newest})")
    (saved / "final").mkdir()
    assert says(saved).endswith(f"), or use its exported policy: --model.path {saved / 'final'}")
    assert says(saved / "final") == ("not a training checkpoint (no loop_state.json); give <run dir>/checkpoints/"
                                     "step_N")
    (saved / "final" / "config.json").write_text("{}")
    assert says(saved / "final").endswith("step_N, or a Hugging Face folder as --model.path")
    for name in ("loop_state.json", ".metadata"):  # either file makes it a checkpoint; a partial one fails at load
        one = tmp_path / name
        one.mkdir()
        (one / name).write_text("{}")
        check_checkpoint(str(one), "CHECKPOINT")


@pytest.mark.parametrize("out", ["/", ".", "..", "run", "run/checkpoints/step_00000002"])
def test_export_never_writes_over_the_root_the_working_directory_or_the_run(tmp_path, monkeypatch, out):
    """OUT may not be `/`, the working directory or a folder above it, the checkpoint's run or the checkpoint
    itself, even with --overwrite: refused from the paths alone, before anything is loaded."""
    from minirl.tools.export import check_out
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    out = out if out in ("/", ".", "..") else str(tmp_path / out)
    with pytest.raises(ConfigError, match="is the current directory, a folder above it, or holds the checkpoint"):
        check_out(out, str(ckpt), overwrite=True)


def test_eval_of_a_checkpoint_reads_its_runs_config_first_and_the_flags_beside_it_win(tmp_path, capsys, monkeypatch):
    """`minirl-eval --checkpoint <run>/checkpoints/step_N` (or `--checkpoint=`) takes the run's config.json
    as `--config` would, leniently (its training flags are skipped); a flag given beside it wins; an
    explicit `--config`, a run without config.json or a `--checkpoint` with no value reads nothing more.
    So does `--model.path` of a run's export, its final/ or minirl-export's, by the run config it carries
    (minirl_config.json; it was scored on the built-in task); another model folder reads nothing more."""
    from minirl.tools.eval import EvalArgs, _with_run_config
    run_dir = tmp_path / "lr=1e-6"  # an `=` in the path, after --checkpoint= too
    ckpt = run_dir / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    config = GRPOArgs(seed=7, steps=40).to_dict()
    config["rollout"]["max_tokens"], config["model"]["path"] = 12, str(tmp_path / "model")
    config["log"]["run_dir"], config["checkpoint"]["resume"] = str(run_dir), "auto"  # a run's own: skipped, unsaid
    (run_dir / "config.json").write_text(json.dumps(config))
    for argv in (["--checkpoint", str(ckpt)], [f"--checkpoint={ckpt}"]):
        assert _with_run_config(argv) == ["--config", str(run_dir / "config.json"), *argv]
        args = launch.parse(EvalArgs, _with_run_config([*argv, "--seed", "3"]), "", lenient=True)
        assert (args.seed, args.rollout.max_tokens, args.model.path, args.checkpoint, args.steps) == (
            3, 12, str(tmp_path / "model"), str(ckpt), 40)  # --steps: a TRL function's trainer_state
    assert "not taken" not in capsys.readouterr().err
    for export in (run_dir / "final", tmp_path / "exported"):
        export.mkdir()
        (export / "minirl_config.json").write_text(json.dumps(config))
        for argv in (["--model.path", str(export)], [f"--model.path={export}/", "--seed", "3"]):
            assert _with_run_config(argv) == ["--config", os.path.join(f"{export}/" if "=" in argv[0] else export,
                                                                       "minirl_config.json"), *argv]
    monkeypatch.setenv("HOME", str(tmp_path))  # `--model.path=~/exported`: the home folder's, as the flags read it
    assert _with_run_config(["--model.path=~/exported"]) == ["--config", f"{tmp_path}/exported/minirl_config.json",
                                                             "--model.path=~/exported"]
    (tmp_path / "model").mkdir()
    for argv in (["--checkpoint", str(ckpt), "--config", "other.yaml"], [f"--config={tmp_path}/x.json",
                 "--checkpoint", str(ckpt)], ["--checkpoint", str(tmp_path / "elsewhere" / "step_1")],
                 ["--samples", "2", "--checkpoint"], ["--model.path", str(tmp_path / "model")],
                 ["--model.path", str(tmp_path / "elsewhere" / "final")]):
        assert _with_run_config(argv) == argv


@pytest.mark.parametrize("flags, says", [
    (["--task.path", "{rows}"], "--task.path is for your own prompts, and --task.name is count"),
    (["--task.name", "jsonl", "--task.path", "{rows}x"], "--task.path='{rows}x' is not a file"),
])
def test_eval_of_a_task_file_it_cannot_read_is_refused_before_anything_is_built(tmp_path, monkeypatch, flags, says):
    """It scored the built-in task when --task.name jsonl was left out, and a missing file was a traceback."""
    from minirl.tools import eval as evaluate
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "answer": "1"}\n')
    monkeypatch.setattr("minirl.dist.init", lambda *a, **k: pytest.fail("the world was set up"))
    with pytest.raises(ConfigError, match=re.escape(says.format(rows=rows))):
        evaluate.main([f.format(rows=rows) for f in flags])


def test_eval_without_held_out_prompts_is_refused_before_the_engine(world, tiny_path, monkeypatch):
    """`minirl-eval` always scores: a task with no held-out prompts is refused naming the flags, before
    an engine is built (not `eval_accuracy 0.0000 on 0 prompts`)."""
    from minirl.tools import eval as evaluate
    monkeypatch.setattr("minirl.rollout.Engine", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(ConfigError, match=r"no held-out prompts to score \(--task.eval-prompts is 0: raise it; "):
        evaluate.main(["--task.eval-prompts", "0"])


def test_a_sigterm_during_eval_exits_143_and_leaves_no_temporary_folder(world, tiny_path, tmp_path, monkeypatch):
    """minirl-eval keeps the engine's log (and a checkpoint's export) in a temporary folder: a SIGTERM (a
    scheduler's preemption) unwinds through it, exit 143, and the folder is gone."""
    import signal
    import tempfile
    import time
    from minirl.tools import eval as evaluate
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folders = []

    def engine(*args, log_file=None, **kwargs):  # the engine's build, where the signal lands
        folders.append(os.path.dirname(log_file))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    monkeypatch.setattr("minirl.rollout.Engine", engine)
    before = signal.signal(signal.SIGTERM, lambda *_: pytest.fail("minirl-eval set no SIGTERM handler"))
    try:
        with pytest.raises(SystemExit) as stopped:
            evaluate.main(["--model.path", tiny_path])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == 143 and folders[0].startswith(str(tmp_path)) and not os.path.exists(folders[0])


def test_eval_of_a_checkpoint_checks_its_model_and_task_before_the_export(world, tiny_path, tmp_path, monkeypatch):
    """A checkpoint is exported before it is scored, which for a large model takes minutes: the model's
    checks, its tokenizer and the task (a reward file that does not exist, here) come first. Its run's
    config.json is read first, leniently (a training run's flags are not the command's)."""
    from minirl.tools import eval as evaluate
    monkeypatch.setattr("minirl.tools.export.export", lambda *a, **k: pytest.fail("the checkpoint was exported"))
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "loop_state.json").write_text("{}")
    config = GRPOArgs().to_dict()
    config["model"]["path"] = tiny_path
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no_such_reward.py"):
        evaluate.main(["--checkpoint", str(ckpt), "--task.reward", str(tmp_path / "no_such_reward.py") + ":score"])
