"""config.py: derived counts and every validation error names its flag (B1, B2, B11); PPO's
streaming support limits (S1, S20)."""

import dataclasses
import json
import os
import re

import pytest

from minirl.config import ConfigError
from minirl.config_grpo import GRPOArgs
from minirl.config_ppo import PPOArgs


def args(**rl):
    a = GRPOArgs()
    for k, v in rl.items():
        setattr(a.rl, k, v)
    return a


def test_zero_means_whole_batch_and_one_chunk():
    a = args(batch_per_replica=32, group_size=8)
    assert (a.n_mini, a.n_micro) == (1, 1)


def test_derived_counts_are_dp_invariant():
    a = args(batch_per_replica=32, mini_batch_per_replica=16, micro_batch_per_replica=8, group_size=4)
    for world in (1, 2, 4):
        a.validate(world)
        dp_batch, dp_mini, dp_micro = 32 // world, 16 // world, 8 // world
        assert a.n_mini == dp_batch // dp_mini == 2 and a.n_micro == dp_mini // dp_micro == 2
        assert type(a.n_mini) is int and type(a.n_micro) is int  # counts of steps and calls, never 2.0


@pytest.mark.parametrize("rl, flag", [
    (dict(batch_per_replica=30, group_size=8), "--rl.batch-per-replica"),
    (dict(batch_per_replica=0), "--rl.batch-per-replica"),
    (dict(mini_batch_per_replica=12), "--rl.mini-batch-per-replica"),
    (dict(mini_batch_per_replica=16, micro_batch_per_replica=6), "--rl.micro-batch-per-replica"),
    (dict(micro_batch_per_replica=-1), "--rl.micro-batch-per-replica"),
    (dict(grad_accum=4), "--rl.micro-batch-per-replica"),
])
def test_bad_sizes_name_the_flag(rl, flag):
    with pytest.raises(ConfigError, match=flag.replace(".", r"\.")):
        args(**rl).validate(1)


def test_micro_batch_must_split_over_the_data_parallel_ranks():
    """Every level divides the one above (16 / 16 / 2 rows) and the batch splits into whole groups
    over 4 ranks, but a micro-batch of 2 rows cannot be shared by 4 ranks (B2)."""
    a = args(batch_per_replica=16, group_size=4, micro_batch_per_replica=2)
    a.validate(1)
    a.validate(2)
    with pytest.raises(ConfigError, match=r"--rl\.micro-batch-per-replica"):
        a.validate(4)


def test_micro_batches_are_sized_by_rows_or_by_a_token_budget_never_both():
    args(micro_batch_per_replica=8).validate(1)
    args(max_tokens_per_micro_batch=512).validate(1)
    with pytest.raises(ConfigError, match=r"set one of --rl\.micro-batch-per-replica \(fixed rows\) and "
                                          r"--rl\.max-tokens-per-micro-batch \(token budget\), not both"):
        args(micro_batch_per_replica=8, max_tokens_per_micro_batch=512).validate(1)


def test_grad_accum_is_retired_for_grpo():
    with pytest.raises(ConfigError, match="retired"):
        args(grad_accum=2).validate(1)


def test_batch_must_split_in_whole_groups_over_ranks():
    with pytest.raises(ConfigError, match="data-parallel"):
        args(batch_per_replica=24, group_size=8).validate(2)
    args(batch_per_replica=32, group_size=8).validate(2)


def test_unknown_flag_is_rejected(capsys):
    import tyro
    with pytest.raises(SystemExit):
        tyro.cli(GRPOArgs, args=["--rl.no-such-flag", "3"])
    assert "no-such-flag" in capsys.readouterr().err


def test_grpo_refuses_disaggregated_placement():
    a = args()
    a.grid.gpu_placement, a.grid.rollout_ranks = "disaggregated", 1
    with pytest.raises(ConfigError, match="--grid.gpu-placement colocated"):
        a.validate(2)


# ---- PPO (S1, S20) ----

@pytest.mark.parametrize("change, flag", [
    (lambda a: setattr(a.ppo, "ppo_epochs", 2), "--ppo.ppo-epochs"),  # streaming (min 4 < 16 prompts)
    (lambda a: setattr(a.grid, "gpu_placement", "colocated"), "separate generation ranks"),
    (lambda a: setattr(a.async_rl.sampler, "name", "random"), "--async-rl.sampler.name"),
    (lambda a: setattr(a.grid, "rollout_ranks", 0), "separate generation ranks"),
    (lambda a: setattr(a.async_rl, "min_groups_for_streaming_train", 0), "--async-rl.min-groups-for-streaming-train"),
])
def test_support_limits_are_rejected_at_setup(change, flag):
    a = PPOArgs()
    change(a)
    with pytest.raises(ConfigError, match=flag.replace(".", r"\.")):
        a.validate(2)


def test_full_batch_allows_several_policy_epochs_and_colocated_placement():
    a = PPOArgs()
    a.async_rl.min_groups_for_streaming_train = a.ppo.num_prompts_per_step
    a.ppo.ppo_epochs = 3
    a.validate(2)
    a.grid.gpu_placement = "colocated"
    a.validate(1)


@pytest.mark.parametrize("rl, flag", [
    (dict(clip_eps=-0.2), "--rl.clip-eps"),
    (dict(kl_coef=-0.1), "--rl.kl-coef"),
    (dict(max_grad_norm=-1.0), "--rl.max-grad-norm"),
    (dict(max_skipped_steps=0), "--rl.max-skipped-steps"),
])
def test_values_that_would_silently_change_the_objective_are_refused(rl, flag):
    with pytest.raises(ConfigError, match=flag.replace(".", r"\.")):
        args(**rl).validate(1)


def test_log_every_zero_is_refused_before_the_first_step():
    a = args()
    a.log.every = 0
    with pytest.raises(ConfigError, match=r"--log\.every=0 must be >= 1"):
        a.validate(1)
    p = PPOArgs()
    p.ppo.clip_eps = 0.0
    with pytest.raises(ConfigError, match=r"--ppo\.clip-eps"):
        p.validate(2)


def test_the_run_dir_must_be_a_writable_directory_that_holds_no_other_run(tmp_path):
    a = args()
    a.log.run_dir = str(tmp_path / "file")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        a.validate(1)
    a.log.run_dir = str(tmp_path / "file" / "run")
    with pytest.raises(ConfigError, match="is not writable"):
        a.validate(1)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    a.log.run_dir = str(run)
    with pytest.raises(ConfigError, match=r"already holds a run .* --checkpoint\.resume auto, .* --log\.overwrite"):
        a.validate(1)
    a.checkpoint.resume = "auto"
    a.validate(1)
    a.checkpoint.resume, a.log.overwrite = "", True
    a.validate(1)
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'  # validation never touches it
    a.log.overwrite = False
    (run / "metrics.jsonl").write_text("")  # a run that died before its first line is no run to keep
    a.validate(1)
    (run / "metrics.jsonl").write_text("{")  # one cut line is
    with pytest.raises(ConfigError, match="already holds a run"):
        a.validate(1)


def _set(a, path: str, value):
    *parents, name = path.split(".")
    obj = a
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, name, value)
    return a


@pytest.mark.parametrize("cls, path, value, says", [
    (GRPOArgs, "rollout.kv_cache_gib", float("nan"), "--rollout.kv-cache-gib=nan must be a finite number"),
    (GRPOArgs, "rl.kl_coef", float("inf"), "--rl.kl-coef=inf must be a finite number"),
    (GRPOArgs, "rl.lr", float("inf"), "--rl.lr=inf must be a finite number"),
    (PPOArgs, "ppo.value_lr", float("nan"), "--ppo.value-lr=nan must be"),
    (GRPOArgs, "model.tiny.num_heads", 0, "--model.tiny.num-heads=0 must be > 0"),
    (GRPOArgs, "seed", -1, "--seed=-1 must be >= 0"),
    (PPOArgs, "seed", 2**32, "--seed=4294967296 must be below 2**32"),
    (GRPOArgs, "task.reward_timeout", -1.0, "--task.reward-timeout=-1.0 must be >= 0"),
    (GRPOArgs, "task.eval_prompts", -1, "--task.eval-prompts=-1 must be >= 0"),
    (PPOArgs, "async_rl.sampler.max_lookahead_versions", -2, "--async-rl.sampler.max-lookahead-versions"),
    (GRPOArgs, "rollout.max_prompt_tokens", 0, "--rollout.max-prompt-tokens=0 must be > 0"),
    (GRPOArgs, "log.run_dir", "", "--log.run-dir is empty"),
])
def test_every_number_and_path_is_range_checked_before_any_build(cls, path, value, says):
    """No NaN or inf, no negative count, no zero size: one line naming the flag, from validate()."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        _set(cls(), path, value).validate(2 if cls is PPOArgs else 1)


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_the_first_save(tmp_path):
    a = GRPOArgs()
    a.log.run_dir, a.checkpoint.dir = str(tmp_path / "run"), str(tmp_path / "file")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--checkpoint.dir=.* is a file"):
        a.validate(1)


def test_the_specs_defaults():
    """The batching spec's table: batch_per_replica 32, mini and micro 0 (whole batch, one chunk); a colocated
    card and rollout sleep level 1 by default; GRPO's grad_accum at its one allowed value (B1, B11)."""
    a = GRPOArgs()
    assert (a.rl.batch_per_replica, a.rl.mini_batch_per_replica, a.rl.micro_batch_per_replica) == (32, 0, 0)
    assert (a.grid.gpu_placement, a.rollout.sleep_level, a.rl.grad_accum) == ("colocated", 1, 1)
    assert (a.n_mini, a.n_micro) == (1, 1)


# (loop, flag path, values at or inside the bound, values just past it, world size, other settings)
BOUNDS = [
    (GRPOArgs, "steps", [1], [0], 1, {}),
    (GRPOArgs, "seed", [0, 2**32 - 1], [2**32], 1, {}),
    (GRPOArgs, "rl.group_size", [2], [0, 1], 1, {"rl.batch_per_replica": 32}),
    (GRPOArgs, "rl.batch_per_replica", [2], [0, 1], 1, {"rl.group_size": 2}),
    (GRPOArgs, "rl.mu_iterations", [1], [0], 1, {}),
    (GRPOArgs, "rl.lr", [1e-12], [0.0], 1, {}),
    (GRPOArgs, "rl.clip_eps", [1e-6], [0.0], 1, {}),
    (GRPOArgs, "rl.max_skipped_steps", [1], [0], 1, {}),
    (GRPOArgs, "rl.min_lr_ratio", [0.0, 1.0], [-0.01, 1.01], 1, {}),
    (GRPOArgs, "rl.dual_clip", [0.0, 1.01, 3.0], [0.5, 1.0], 1, {}),
    (GRPOArgs, "rl.weight_decay", [0.0], [-0.01], 1, {}),
    (GRPOArgs, "rl.max_grad_norm", [0.0, 0.5], [-0.01], 1, {}),
    (GRPOArgs, "rollout.temperature", [1e-5, 2.0], [0.0, 0.99e-5, 2.01], 1, {}),  # vLLM: greedy below 1e-5
    (GRPOArgs, "rollout.top_k", [-1, 0, 1], [-2], 1, {}),  # -1: verl's default, all tokens as for 0
    (GRPOArgs, "rollout.top_p", [1e-3, 1.0], [0.0, 1.01], 1, {}),
    (GRPOArgs, "rollout.gpu_memory_utilization", [1e-3, 1.0], [0.0, 1.01], 1, {}),
    (GRPOArgs, "rollout.min_tokens", [0, 8], [9], 1, {"rollout.max_tokens": 8}),
    (GRPOArgs, "log.every", [1], [0], 1, {}),
    (GRPOArgs, "log.target_eval_accuracy", [0.0, 1.0], [-0.01, 1.01], 1, {}),
    (GRPOArgs, "log.eval_every", [1], [0], 1, {"log.target_eval_accuracy": 0.5}),
    (GRPOArgs, "checkpoint.keep", [1], [0], 1, {}),
    (GRPOArgs, "dry_run_nnodes", [1], [0], 1, {}),
    (PPOArgs, "async_rl.min_groups_for_streaming_train", [1, 12], [0, 13], 2, {"ppo.num_prompts_per_step": 12}),
    (PPOArgs, "grid.rollout_ranks", [1, 3], [0, 4], 4, {"ppo.num_prompts_per_step": 6}),
    (PPOArgs, "ppo.adv_estimator.gamma", [0.0, 1.0], [-0.01, 1.01], 2, {}),
    (PPOArgs, "ppo.adv_estimator.lam", [0.0, 1.0], [-0.01, 1.01], 2, {}),
    (PPOArgs, "ppo.value_lr", [1e-12], [0.0], 2, {}),
    (PPOArgs, "ppo.weight_decay", [0.0], [-0.01], 2, {}),
    (PPOArgs, "ppo.critic_ppo_epochs", [1], [0], 2, {}),
    (PPOArgs, "ppo.critic_warmup_steps", [0, 19], [20], 2, {"steps": 20}),  # one step at least trains the policy
    (PPOArgs, "async_rl.rollout_groups_per_call", [1], [0], 2, {}),
]


@pytest.mark.parametrize("cls, path, inside, past, world, other", BOUNDS, ids=[f"{b[0].LOOP}-{b[1]}" for b in BOUNDS])
def test_every_range_takes_its_bounds_and_refuses_just_past_them(tmp_path, cls, path, inside, past, world, other):
    """A range check that is off by one refuses a value a user may give (top-p 1.0, gamma 1.0, a full-batch
    minimum) or lets one through that breaks the run later: each flag's bounds pass, and a value just past
    them is refused naming the flag."""
    def launch(value):
        a = _set(cls(), "log.run_dir", str(tmp_path / "run"))
        for k, v in other.items():
            _set(a, k, v)
        return _set(a, path, value)

    flag = "--" + path.replace("_", "-")
    for value in inside:
        launch(value).validate(world)
    for value in past:
        with pytest.raises(ConfigError, match=re.escape(flag)):
            launch(value).validate(world)


def test_a_dry_run_may_name_the_cpu_and_only_the_rehearsal_refuses_it(tmp_path):
    """--dry-run-device cpu plans a CPU launch; --rehearse plays a CUDA one, so only the two together are refused."""
    a = GRPOArgs(dry_run=True, dry_run_device="cpu")
    a.log.run_dir = str(tmp_path / "run")
    a.validate(1)
    a.dry_run_device, a.rehearse = "cuda", True
    a.validate(1)
    a.dry_run_device = "cpu"
    with pytest.raises(ConfigError, match="--rehearse plays a CUDA launch"):
        a.validate(1)


def test_a_refused_size_suggests_one_that_runs():
    with pytest.raises(ConfigError, match=re.escape("(e.g. 32)")):
        args(batch_per_replica=30, group_size=8).validate(1)
    with pytest.raises(ConfigError, match=re.escape("--rl.micro-batch-per-replica (e.g. 16)")):
        args(grad_accum=4, batch_per_replica=32).validate(1)
    with pytest.raises(ConfigError, match=re.escape("use a multiple of 16")):
        args(batch_per_replica=24, group_size=8).validate(2)
    p = PPOArgs()
    p.ppo.num_prompts_per_step = 6
    with pytest.raises(ConfigError, match=re.escape("--grid.rollout-ranks in [1, 3] (this launch has 4 rank(s); start "
                                                    "it with torchrun --nproc-per-node 5 or more")):  # 4 and a trainer
        _set(p, "grid.rollout_ranks", 4).validate(4)
    with pytest.raises(ConfigError, match=re.escape("ranks: two ranks or more (this launch has 1 rank(s); start it "
                                                    "with torchrun --nproc-per-node 2 or more, or use --grid.gpu-placement "
                                                    "colocated with full batch: --async-rl.min-groups-for-streaming-"
                                                    "train=6)")):  # not "in [1, 0]", nor full batch without its flag
        _set(p, "grid.rollout_ranks", 1).validate(1)
    with pytest.raises(ConfigError, match=re.escape("=6 must split evenly over 4 train rank(s); use a multiple of 4, "
                                                    "or --grid.rollout-ranks 3 (3 train rank(s))")):  # the fewest
        _set(p, "grid.rollout_ranks", 2).validate(6)
    with pytest.raises(ConfigError, match=re.escape("use a multiple of 4, or --grid.rollout-ranks 1 (6 train rank(s))")):
        _set(p, "grid.rollout_ranks", 3).validate(7)
    with pytest.raises(ConfigError, match=re.escape("--grid.rollout-ranks in [1, 1] (this launch has 2 rank(s)")):
        _set(p, "grid.rollout_ranks", 2).validate(2)
    p.grid.gpu_placement, p.async_rl.min_groups_for_streaming_train = "colocated", 6  # full batch on every rank
    with pytest.raises(ConfigError, match=r"over 4 train rank\(s\); use a multiple of 4$"):  # no rollout ranks to move
        p.validate(4)


def test_one_rule_says_when_an_eval_is_due_and_one_when_a_save_is():
    """Evals: before the first update, every --log.eval-every, after the last step; never at 0. Saves: every
    --checkpoint.every, never after a step that took no update; never at 0."""
    from minirl.config import CheckpointConfig, LogConfig
    assert [v for v in range(9) if LogConfig(eval_every=3).evaluates(v, 7)] == [0, 3, 6, 7]
    assert not any(LogConfig(eval_every=0).evaluates(v, 7) for v in range(9))
    assert [s for s in range(1, 8) if CheckpointConfig(every=3).saves(s, True)] == [3, 6]
    assert not CheckpointConfig(every=3).saves(3, False)
    assert not any(CheckpointConfig(every=0).saves(s, True) for s in range(1, 8))


def test_files_the_flags_name_must_exist_and_an_existing_one_passes(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "answer": "1"}\n')
    for path, value, says in [("task.path", str(tmp_path / "none.jsonl"), "--task.path"),
                              ("task.eval_path", str(tmp_path / "none.jsonl"), "--task.eval-path"),
                              ("checkpoint.resume", str(tmp_path / "none"), "--checkpoint.resume")]:
        a = _set(_set(args(), "task.name", "jsonl"), "task.path", str(rows))
        a.log.run_dir = str(tmp_path / "run")
        a.validate(1)
        with pytest.raises(ConfigError, match=re.escape(says)):
            _set(a, path, value).validate(1)
        _set(a, path, str(rows) if path != "checkpoint.resume" else str(tmp_path)).validate(1)


@pytest.mark.parametrize("path", ["task.path", "task.eval_path", "task.answer_key"])
def test_a_file_given_to_the_built_in_task_asks_for_task_name_jsonl(tmp_path, path):
    """`--task.path rows.jsonl` without `--task.name jsonl` trained on the built-in counting task, silently."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "answer": "1"}\n')
    a = _set(args(), path, str(rows))
    a.log.run_dir = str(tmp_path / "run")
    flag = "--" + path.replace("_", "-")
    with pytest.raises(ConfigError, match=re.escape(f"{flag} is for your own prompts, and --task.name is count, the "
                                                    "built-in task, which reads no file: add --task.name jsonl")):
        a.validate(1)
    _set(_set(a, "task.name", "jsonl"), "task.path", str(rows)).validate(1)


@pytest.mark.parametrize("flag, module", [("log.tensorboard", "tensorboard"), ("log.wandb_project", "wandb")])
def test_an_optional_sink_is_refused_only_where_its_package_is_missing(tmp_path, monkeypatch, flag, module):
    import importlib.util
    real = importlib.util.find_spec
    a = _set(args(), flag, True if flag == "log.tensorboard" else "p")
    a.log.run_dir = str(tmp_path / "run")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *r: object() if name == module else real(name, *r))
    a.validate(1)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *r: None if name == module else real(name, *r))
    with pytest.raises(ConfigError, match=re.escape(f"pip install -e '.[{module}]'")):
        a.validate(1)


def test_a_config_file_takes_only_the_values_a_choice_flag_lists():
    from minirl.flags import fill
    assert fill(GRPOArgs(), {"rollout": {"sleep_level": 2}}, "").rollout.sleep_level == 2
    with pytest.raises(ConfigError, match=r"rollout\.sleep_level=3 is not one of 1, 2"):
        fill(GRPOArgs(), {"rollout": {"sleep_level": 3}}, "")


DEFAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "defaults.json")


def defaults() -> dict:
    from minirl.tools.eval import EvalArgs
    return {"grpo": GRPOArgs().to_dict(), "ppo": PPOArgs().to_dict(), "eval": dataclasses.asdict(EvalArgs())}


def _flat(d: dict, prefix: str = "") -> dict:
    """{"rl": {"lr": 1e-4}} -> {"rl.lr": 1e-4}"""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_every_default_is_the_recorded_one():
    """A default is part of every run that does not set it (a recipe, a user's config.json): a changed one is
    a decision made in tests/data/defaults.json's diff, never a silent edit. To record a deliberate change:
    .venv/bin/python tests/test_config.py"""
    with open(DEFAULTS) as f:
        recorded = json.load(f)
    for loop, now in defaults().items():
        now, then = _flat(now), _flat(recorded[loop])
        pairs = {k: (then.get(k, "absent"), now.get(k, "absent")) for k in now.keys() | then.keys()}
        changed = {k: pair for k, pair in pairs.items() if pair[0] != pair[1]}
        assert not changed, f"minirl.{loop} defaults changed (recorded, now): {changed}"


def test_the_engines_context_adds_the_prompt_budget_and_the_completion_cap():
    """`RolloutConfig.max_model_len`, the one place every engine, the preflight and the plan take it from."""
    from minirl.config import RolloutConfig
    assert RolloutConfig(max_prompt_tokens=200, max_tokens=100).max_model_len == 300


if __name__ == "__main__":  # record the defaults as they are now
    with open(DEFAULTS, "w") as f:
        f.write(json.dumps(defaults(), indent=1) + "\n")
