"""tools/plan.py: `--dry-run` shows every rank's role, devices, share and memory before a GPU is touched.
The GPU recipes are planned at their world size on CUDA from the recipe models' config.json files
(tests/data/models: configs only, no weights)."""

import os
import re
import sys

import pytest
import tyro

from conftest import ROOT, run
from minirl.tools import plan
from minirl.config_grpo import GRPOArgs
from minirl.config_ppo import PPOArgs
from test_recipes import RECIPES, flags

MODELS = os.path.join(ROOT, "tests", "data", "models")
LINE = re.compile(r"rank (\d+): (?:node=\d+ )?role=(rollout|train|both) trainer=(\S+) engine=(\S+) params=(\w+) "
                  r"compute=(\w+) \| (.*) \| (.*)")
GPU_RECIPES = [r for r in RECIPES if "gsm8k" in os.path.basename(r)]


def recipe_args(path, tmp_path):
    module, nproc, argv, nnodes = flags(path)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "q", "answer": "1"}\n' * 10)
    argv = [str(data) if a.endswith(".jsonl") else a for a in argv]
    i = argv.index("--model.path")
    argv[i + 1] = os.path.join(MODELS, os.path.basename(argv[i + 1]))  # Qwen/X -> tests/data/models/X
    cls = {"minirl.grpo": GRPOArgs, "minirl.ppo": PPOArgs}[module]
    args = tyro.cli(cls, args=argv + ["--dry-run", "--dry-run-world-size", str(nproc), "--dry-run-nnodes", str(nnodes),
                                      "--dry-run-device", "cuda"])
    return args, nproc


@pytest.mark.parametrize("path", GPU_RECIPES, ids=os.path.basename)
def test_every_gpu_recipe_plans_its_devices_and_fits_an_80_gib_card(path, tmp_path):
    args, nproc = recipe_args(path, tmp_path)
    lines = plan.dry_run(args)
    ranks = [LINE.fullmatch(line) for line in lines if line.startswith("rank ")]
    assert len(ranks) == nproc and all(ranks), lines
    assert "unknown" not in "\n".join(lines)
    node = lambda m: int(m.group(1)) // (nproc // args.dry_run_nnodes)  # noqa: E731  (ranks go node by node)
    engines = [(node(m), m.group(4)) for m in ranks if m.group(4) != "-"]
    trainers = [(node(m), m.group(3)) for m in ranks if m.group(3) != "-"]
    if isinstance(args, PPOArgs) and args.grid.gpu_placement == "disaggregated":
        assert len(set(engines)) == len(engines) == args.grid.rollout_ranks
        assert not set(engines) & set(trainers)
    else:
        assert all(m.group(2) == "both" and m.group(3) == m.group(4) == f"cuda:{m.group(1)}" for m in ranks)
    assert all(m.group(5) == "float32" for m in ranks if m.group(2) != "rollout")  # master weights
    assert all(m.group(6) == "bfloat16" for m in ranks)
    for m in ranks:
        peak = float(re.search(r"peak ([\d.]+) of 80 \(fits\)", m.group(8)).group(1))
        assert 1.0 < peak <= 80.0, m.group(0)


def test_two_nodes_number_cards_per_node(tmp_path):
    """`--dry-run-nnodes 2`: ranks are numbered node by node and a card is a rank's index on its node,
    so 2 nodes of 8 use cuda:0..7 on each (the old plan printed cuda:8..15 for node 1)."""
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_ppo_8gpu.sh"), tmp_path)
    args.dry_run_world_size, args.dry_run_nnodes, args.grid.rollout_ranks = 16, 2, 4  # 252 prompts / 12
    lines = plan.dry_run(args)
    ranks = [re.match(r"rank (\d+): node=(\d) role=(\w+) trainer=(\S+) engine=(\S+)", line)
             for line in lines if line.startswith("rank ")]
    assert len(ranks) == 16 and all(ranks), lines
    for m in ranks:
        g, node, role = int(m.group(1)), int(m.group(2)), m.group(3)
        assert node == g // 8 and role == ("rollout" if g < 4 else "train")
        assert m.group(5 if role == "rollout" else 4) == f"cuda:{g % 8}"
    args.dry_run_nnodes = 3
    with pytest.raises(Exception, match="--dry-run-nnodes"):
        plan.dry_run(args)


def test_memory_estimate_counts_the_model(tmp_path):
    """0.5B at 16 bytes per parameter (float32 masters, grads, AdamW) on one rank is about 7.3 GiB."""
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_grpo_1gpu.sh"), tmp_path)
    hf, _ = plan.model_config(args.model)
    assert abs(plan.parameter_counts(hf)["total"] / 1e9 - 0.494) < 0.005  # Qwen2.5-0.5B: 494M parameters
    line = [x for x in plan.dry_run(args) if x.startswith("rank 0")][0]
    terms = dict(re.findall(r"(\w+) ([\d.]+)", line.split("memory GiB:")[1].split("|")[0]))
    assert abs(float(terms["grads"]) + float(terms["optimizer"]) - 12 * 494e6 / 2**30) < 0.1
    args.rl.micro_batch_per_replica = 256  # the whole batch in one forward, every block's activations kept:
    args.model.activation_checkpointing = False  # far over a card
    assert "DOES NOT FIT" in plan.dry_run(args)[1]


def test_a_model_without_a_readable_config_gets_memory_unknown(tmp_path):
    args = tyro.cli(PPOArgs, args=["--model.path", "someorg/not-in-the-cache", "--grid.rollout-ranks", "1"])
    args.dry_run_world_size, args.dry_run_device = 2, "cuda"
    lines = plan.dry_run(args)
    assert len(lines) == 3 and all("memory: unknown" in x for x in lines[1:])


def test_dry_run_exits_0_without_loading_or_building(tmp_path):
    """Through the command line: no process group, no weights, no engine (the tiny model is not even built)."""
    cache = tmp_path / "cache"
    p = run([sys.executable, "-m", "minirl.ppo", "--dry-run", "--dry-run-world-size", "8", "--dry-run-device", "cuda",
             "--grid.rollout-ranks", "2", "--ppo.num-prompts-per-step", "12", "--log.run-dir", str(tmp_path / "r")],
            timeout=120, env={"MINIRL_CACHE": str(cache)})
    assert p.returncode == 0
    assert [line.split(" ")[1] for line in p.stdout.splitlines() if line.startswith("rank ")] == \
        [f"{r}:" for r in range(8)]
    assert "rank 1: role=rollout trainer=- engine=cuda:1" in p.stdout
    assert "rank 2: role=train trainer=cuda:2 engine=-" in p.stdout
    assert not cache.exists() and not (tmp_path / "r").exists()
    bad = run([sys.executable, "-m", "minirl.grpo", "--dry-run", "--dry-run-world-size", "3"], timeout=120)
    assert bad.returncode == 2 and "--rl.batch-per-replica" in bad.stderr


def test_a_train_rank_that_does_not_fit_is_told_the_largest_micro_batch_that_does(tmp_path):
    """The PPO recipe without activation checkpointing on 10 GiB cards: its train ranks do not fit at 8
    rows per micro-batch; the plan
    names the largest count that fits, which does (re-planned), and one more row does not."""
    import dataclasses
    args, nproc = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_ppo_8gpu.sh"), tmp_path)
    args.dry_run_card_gib, args.model.activation_checkpointing = 10.0, False
    line = next(x for x in plan.dry_run(args) if x.startswith("rank 2:"))
    hint = re.search(r"\(DOES NOT FIT\); fits with --ppo.policy-micro-batch-rows (\d+) "
                     r"--ppo.critic-micro-batch-rows (\d+) \(peak ([\d.]+)\)$", line)
    assert hint and hint.group(1) == hint.group(2), line
    m = int(hint.group(1))
    assert 1 <= m < 8

    def peak(rows):
        tried = dataclasses.replace(args, ppo=dataclasses.replace(args.ppo, policy_micro_batch_rows=rows,
                                                                  critic_micro_batch_rows=rows))
        return float(re.search(r"peak ([\d.]+) of", next(x for x in plan.dry_run(tried) if x.startswith("rank 2:")))
                     .group(1))
    assert peak(m) <= 10.0 < peak(m + 1) and abs(peak(m) - float(hint.group(3))) < 0.05


def test_a_colocated_plan_counts_the_publish_where_engine_weights_and_trainer_overlap(tmp_path):
    """The hand-off's publish wakes the engine's weights (compute dtype, whole) while the trainer's shards
    and AdamW state are still resident: at 8 ranks of the 3B GRPO recipe with a small engine share and
    one row per micro-batch, that moment is the card's peak, not the larger of the two phases."""
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_grpo_3b.sh"), tmp_path)
    args.rollout.gpu_memory_utilization, args.rl.micro_batch_per_replica = 0.1, 8
    line = [x for x in plan.dry_run(args) if x.startswith("rank 0")][0]
    terms = dict(re.findall(r"(\w+) ([\d.]+)", line.split("memory GiB:")[1].split("|")[0]))
    hf, _ = plan.model_config(args.model)
    weights = plan.parameter_counts(hf)["total"] * 2 / 2**30  # bf16
    assert float(terms["publish"]) == pytest.approx(weights + float(terms["params"]) + float(terms["optimizer"]),
                                                    abs=0.02)
    trainer = sum(float(terms[k]) for k in ("params", "grads", "optimizer", "activations", "logits"))
    assert float(terms["publish"]) > max(trainer, float(terms["engine"]))
    peak = float(re.search(r"peak ([\d.]+) of", line).group(1))
    assert peak == pytest.approx(float(terms["publish"]) + plan.BASELINE_GIB, abs=0.06)
