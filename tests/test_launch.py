"""launch.py and the commands: `--config` files (flags beside them win, a run's config.json reruns
it), the console scripts' exit codes, and `minirl-eval` / `minirl-export` on a finished run."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import run
from minirl import launch
from minirl.config import ConfigError, GRPOArgs

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


def test_console_scripts_exit_0_on_success_and_2_on_a_bad_flag(tmp_path):
    ok = run([script("minirl-grpo"), "--dry-run"], timeout=120)
    assert ok.returncode == 0 and "rank 0: role=both" in ok.stdout and "{" not in ok.stdout.splitlines()[-1]
    assert run([script("minirl-ppo"), "--dry-run", "--dry-run-world-size", "2"], timeout=120).returncode == 0
    for cmd, says in [([script("minirl-grpo"), "--rl.clip-eps", "-1"], "minirl.grpo: error: --rl.clip-eps"),
                      ([script("minirl-ppo"), "--grid.gpu-placement", "colocated", "--async-rl.min-groups-for-"
                        "streaming-train", "16", "--ppo.lr", "0"], "minirl.ppo: error: --ppo.lr"),
                      ([script("minirl-eval"), "--checkpoint", str(tmp_path / "none")], "minirl.eval: error:"),
                      ([script("minirl-export"), str(tmp_path / "none"), str(tmp_path / "out")], "minirl.export: error:")]:
        p = run(cmd, timeout=120)
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr[-1500:])
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert run([script("minirl-grpo"), "--rl.no-such-flag", "1"], timeout=120).returncode == 2
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n')
    assert run([script("minirl-plot"), str(tmp_path)], timeout=120).returncode == 0


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
    logged for its last evaluation; minirl-export writes that checkpoint as final/ was written."""
    last = [r["eval_accuracy"] for r in map(json.loads, open(finished / "metrics.jsonl")) if "eval_accuracy" in r][-1]
    ckpt = finished / "checkpoints" / "step_00000002"
    lines = []
    for flags in (["--model.path", str(finished / "final")], ["--checkpoint", str(ckpt)]):
        p = run([script("minirl-eval"), *flags])
        assert p.returncode == 0
        lines.append(p.stdout.strip().splitlines()[-1])
    assert lines[0] == lines[1] == f"eval_accuracy {last:.4f} on 128 prompts"
    p = run([script("minirl-export"), str(ckpt), str(tmp_path / "out")])
    assert p.returncode == 0
    a, b = load_file(finished / "final" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert oct(os.stat(tmp_path / "out" / "model.safetensors").st_mode & 0o777) == "0o644"
